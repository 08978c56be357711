"""Interpreter tier: the merge's backward kernel (kernels/merge.merge_backward_triton) equals MergeStates' PyTorch
backward (merge.merge_backward_torch): parts empty on some rows with NaN outputs there, a row where every part
is empty, with and without an lse gradient, one chunk of parts and many (the two-pass path)."""
import pytest
import torch

from flashport.kernels.merge import merge_backward_triton, merge_states_triton
from flashport.merge import merge_backward_torch


def _case(n, dtype, seed, dv=16):
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(2, 5, 3, dv, generator=g).to(dtype) for _ in range(n)]
    lses = [torch.randn(2, 3, 5, generator=g) * 3 for _ in range(n)]
    lses[1][0, :, 2] = float("-inf")          # one part empty on some rows ...
    outs[1][0, 2] = float("nan")              # ... whose output is garbage there
    for l in lses:
        l[1, 0, 4] = float("-inf")            # a row where every part is empty
    _, lse = merge_states_triton(outs, lses)
    dout = torch.randn(2, 5, 3, dv, generator=g).to(dtype)
    dlse = torch.randn(2, 3, 5, generator=g)
    return outs, lses, lse, dout, dlse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_dlse", [True, False])
def test_merge_backward_kernel_matches_torch(dtype, with_dlse):
    outs, lses, lse, dout, dlse = _case(3, dtype, seed=1)
    dlse = dlse if with_dlse else None
    got = merge_backward_triton(outs, lses, lse, dout, dlse)
    want = merge_backward_torch(outs, lses, lse, dout, dlse)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert a.dtype == b.dtype and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_merge_backward_kernel_many_parts_in_chunks():
    """9 parts read 2 at a time (tile_elems lowered): sum_q w_q r_q is taken over every chunk before any write."""
    outs, lses, lse, dout, dlse = _case(9, torch.float32, seed=2)
    got = merge_backward_triton(outs, lses, lse, dout, dlse, tile_elems=2 * 16)
    want = merge_backward_torch(outs, lses, lse, dout, dlse)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

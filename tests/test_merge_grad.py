"""merge_attention_states' own backward (merge.MergeStates): equal to autograd through the PyTorch merge and to
float64 finite differences, parts that are empty (lse = -inf, garbage outputs) included."""
from __future__ import annotations

import pytest
import torch

import flashport
from flashport.merge import merge_states_torch


def _parts(dtype, empty_rows=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(2, 5, 3, 4, generator=g, dtype=dtype) for _ in range(3)]
    lses = [torch.randn(2, 3, 5, generator=g, dtype=torch.float32) * 3 for _ in range(3)]
    if empty_rows:
        lses[1][0, :, 2] = float("-inf")            # one part empty on some rows
        outs[1][0, 2] = float("nan")                # whose output is garbage there
        for l in lses:
            l[1, 0, 4] = float("-inf")              # a row where every part is empty
    return [o.requires_grad_() for o in outs], [l.requires_grad_() for l in lses]


def test_merge_gradients_equal_autograd_through_the_torch_merge():
    outs, lses = _parts(torch.float32)
    out, lse = flashport.merge_attention_states(outs, lses)
    g = torch.Generator().manual_seed(1)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    got = torch.autograd.grad((out, lse), (*outs, *lses), (dout, dlse))
    # the oracle: autograd through the PyTorch merge, the garbage part's NaN replaced by zeros (the merge selects
    # it away; autograd's where would still multiply NaN by zero in its backward)
    clean = [o.detach().nan_to_num(0.0).requires_grad_() for o in outs]
    lses2 = [l.detach().requires_grad_() for l in lses]
    o2, l2 = merge_states_torch(clean, lses2)
    want = torch.autograd.grad((o2, l2), (*clean, *lses2), (dout, dlse))
    for a, b in zip(got, want):   # (the oracle's lse gradient is NaN on the row where every part is empty: log 0)
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b.nan_to_num(0.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, o2, rtol=1e-6, atol=1e-6)


def _merge64(outs, lses):
    """The merge in float64 throughout (merge_states_torch accumulates in float32, too coarse for finite differences)."""
    lse = torch.logsumexp(torch.stack(lses), 0)
    return sum(torch.exp(l - lse).transpose(1, 2)[..., None] * o for o, l in zip(outs, lses)), lse


def test_merge_gradients_pass_gradcheck_in_float64():
    outs, lses = _parts(torch.float64, empty_rows=False)
    lses = [l.detach().double().requires_grad_() for l in lses]
    f = lambda *xs: flashport.merge.MergeStates.apply(_merge64, 3, *xs)  # noqa: E731
    assert torch.autograd.gradcheck(f, (*outs, *lses), eps=1e-6, atol=1e-8)


def test_merge_lse_gradients_keep_their_precision_in_bfloat16():
    """<d out, out> comes from the parts in float32, not from the merged output rounded to bf16: the lse gradients
    of bf16 parts stay as exact as the PyTorch merge's (which computes in float32 throughout)."""
    g = torch.Generator().manual_seed(3)
    outs = [(torch.randn(2, 64, 4, 128, generator=g) + 3.0).to(torch.bfloat16).requires_grad_() for _ in range(4)]
    lses = [(torch.randn(2, 4, 64, generator=g) * 2).requires_grad_() for _ in range(4)]
    dout = torch.randn(2, 64, 4, 128, generator=g).to(torch.bfloat16)
    out, lse = flashport.merge_attention_states(outs, lses)
    got = torch.autograd.grad(out, lses, dout)
    l64 = [l.detach().double().requires_grad_() for l in lses]
    o64, _ = _merge64([o.detach().double() for o in outs], l64)
    want = torch.autograd.grad(o64, l64, dout.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4)
    total = sum(got)   # sum_p d lse_p = d lse (here 0): the weights sum to one
    assert total.abs().max() < 1e-4


def test_merge_supports_torch_func_grad():
    outs, lses = _parts(torch.float64, empty_rows=False)
    lses = [l.detach().double() for l in lses]
    f = lambda l0: flashport.merge.MergeStates.apply(_merge64, 3, *outs, l0, *lses[1:])[1].sum()  # noqa: E731
    torch.testing.assert_close(torch.func.grad(f)(lses[0]), torch.autograd.functional.jacobian(f, lses[0]))


def test_a_backward_kernel_that_fails_falls_back_to_the_torch_backward_with_a_warning(monkeypatch):
    """Where the Triton merge backward is chosen (CUDA) and the toolchain rejects it, the PyTorch backward serves and
    says so once, instead of failing the user's backward."""
    from flashport import merge

    def broken(*a):
        raise RuntimeError("rejected by the compiler")
    monkeypatch.setattr(merge, "_backward_for", lambda o: broken)
    monkeypatch.setattr(merge, "_fell_back", [])
    outs, lses = _parts(torch.float32, empty_rows=False)
    with pytest.warns(RuntimeWarning, match="rejected by the compiler"):
        out, lse = flashport.merge_attention_states(outs, lses)
        got = torch.autograd.grad(out.sum(), outs)
    want = merge.merge_backward_torch([o.detach() for o in outs], [l.detach() for l in lses], lse.detach(),
                                      torch.ones_like(out), None)[0]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_double_backward_runs_the_recorded_pytorch_backward(monkeypatch):
    """With create_graph=True the backward must be differentiable: the kernel's outputs would carry no graph (second
    derivatives silently zero), so the PyTorch backward runs there even where the kernel is chosen."""
    from flashport import merge

    def like_the_kernel(*args):   # right values, no graph: what a Triton launch returns
        with torch.no_grad():
            return merge.merge_backward_torch(*args)
    monkeypatch.setattr(merge, "_backward_for", lambda o: like_the_kernel)
    outs, lses = _parts(torch.float64, empty_rows=False)
    lses = [l.detach().double().requires_grad_() for l in lses]
    f = lambda *xs: flashport.merge.MergeStates.apply(_merge64, 3, *xs)  # noqa: E731
    assert torch.autograd.gradgradcheck(f, (*outs, *lses), eps=1e-6, atol=1e-7)


def test_out_of_memory_in_the_backward_kernel_is_raised_not_retried(monkeypatch):
    from flashport import merge

    def oom(*a):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(merge, "_backward_for", lambda o: oom)
    outs, lses = _parts(torch.float32, empty_rows=False)
    out, _ = flashport.merge_attention_states(outs, lses)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.autograd.grad(out.sum(), outs)

"""GPU tier of the KV-cache path (skipped without CUDA): dense and paged caches, split-KV decode and
chunked prefill in bf16 against the float64 reference under the tolerance rule, the merge kernel,
and CUDA-graph capture of a decode step (no host synchronisation on the hot path)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import flashport  # noqa: E402
from conformance import assert_within_rule  # noqa: E402
from flashport.backend.reference import materialized_attention  # noqa: E402
from flashport.kvcache import gather_pages  # noqa: E402
from flashport.merge import merge_states_torch  # noqa: E402

DEV = "cuda"


def _cache(b, cap, hkv, d, page, dtype, g):
    """Random cache content plus (k_cache, v_cache, block_table) in dense or shuffled-paged layout."""
    k = torch.randn(b, cap, hkv, d, generator=g, device=DEV).to(dtype)
    v = torch.randn(b, cap, hkv, d, generator=g, device=DEV).to(dtype)
    if not page:
        return k, v, None
    n = cap // page
    nblk = b * n + 5
    bt = torch.randperm(nblk, generator=g, device=DEV)[: b * n].reshape(b, n).to(torch.int32)
    kc = torch.full((nblk, page, hkv, d), float("nan"), device=DEV, dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    pos = torch.arange(cap, device=DEV)
    for i in range(b):
        blocks = bt[i].long()[pos // page]
        kc[blocks, pos % page] = k[i]
        vc[blocks, pos % page] = v[i]
    return kc, vc, bt


@pytest.mark.parametrize("page", [0, 16, 256], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("sq,s_new,window,softcap", [(1, 1, (-1, -1), 0.0), (5, 5, (-1, -1), 0.0),
                                                     (1, 1, (300, 0), 0.0), (3, 0, (-1, -1), 20.0)],
                         ids=["decode", "verify5", "window", "softcap"])
def test_kvcache_bf16(page, sq, s_new, window, softcap):
    g = torch.Generator(device=DEV).manual_seed(0)
    b, cap, hq, hkv, d, dt = 3, 2048, 8, 2, 128, torch.bfloat16
    kc, vc, bt = _cache(b, cap, hkv, d, page, dt, g)
    lens = torch.tensor([0, 777, cap - s_new], dtype=torch.int32, device=DEV)
    q = torch.randn(b, sq, hq, d, generator=g, device=DEV).to(dt)
    kn = torch.randn(b, s_new, hkv, d, generator=g, device=DEV).to(dt) if s_new else None
    vn = torch.randn(b, s_new, hkv, d, generator=g, device=DEV).to(dt) if s_new else None
    kw = dict(causal=True, window_size=window, softcap=softcap)
    ref_k, ref_v = kc.clone(), vc.clone()  # the cache before the append, for the reference
    out, lse = flashport.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=bt,
                                                return_lse=True, backend="triton", **kw)
    ref, ref_lse = flashport.attention_with_kvcache(
        q.double(), ref_k.double(), ref_v.double(), None if kn is None else kn.double(),
        None if vn is None else vn.double(), cache_seqlens=lens, block_table=bt, return_lse=True,
        backend="reference", **kw)
    kd = gather_pages(kc, bt) if bt is not None else kc   # the cache after triton's in-place append
    vd = gather_pages(vc, bt) if bt is not None else vc
    low, _ = materialized_attention(q, kd.nan_to_num(0), vd.nan_to_num(0), scale=d ** -0.5, softcap=softcap,
                                    left=window[0], right=0, seqlens_k=lens + s_new, compute_dtype=dt)
    assert_within_rule("kvcache out", out, ref, low, dt, 2)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-2


def test_merge_kernel_matches_torch():
    g = torch.Generator(device=DEV).manual_seed(1)
    outs = [torch.randn(2, 7, 4, 64, generator=g, device=DEV).to(torch.bfloat16) for _ in range(3)]
    lses = [torch.randn(2, 4, 7, generator=g, device=DEV) for _ in range(3)]
    lses[1][0, 0, :] = float("-inf")
    outs[1][0, :, 0] = float("nan")  # garbage in an empty part must not leak
    out, lse = flashport.merge_attention_states(outs, lses)
    want, want_lse = merge_states_torch(outs, lses)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse)


def test_decode_step_captures_in_cuda_graph():
    g = torch.Generator(device=DEV).manual_seed(2)
    b, cap, hq, hkv, d, dt = 4, 4096, 32, 8, 128, torch.bfloat16
    kc, vc, bt = _cache(b, cap, hkv, d, 16, dt, g)
    lens = torch.tensor([100, 2000, 4000, 7], dtype=torch.int32, device=DEV)
    q = torch.randn(b, 1, hq, d, generator=g, device=DEV).to(dt)
    eager = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=bt, backend="triton")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=bt, backend="triton")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=bt, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)

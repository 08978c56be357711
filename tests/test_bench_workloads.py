"""The `workloads` bench suite's shapes (issue [8]): windows and Dv != D reach every implementation the
harness calls, FLOPs count visible pairs, and the FlexAttention window mask is flashport's rule."""
from __future__ import annotations

import pytest
import torch

import flashport
from flashport.backend.reference import materialized_attention
from flashport.bench import peers
from flashport.bench.shapes import Shape, flops, gpu_suite, workloads
from flashport.masks import visible


def test_workloads_suite_is_well_formed():
    shapes = workloads()
    labels = [s.label() for s in shapes]
    assert len(set(labels)) == len(labels)
    assert any(s.window >= 0 for s in shapes) and any(s.dv and s.dv != s.d for s in shapes)
    assert {s.d for s in shapes} >= {72, 80, 96, 128, 192, 256}
    assert any(s.kind == "dense" and 16 * s.sk <= s.sq for s in shapes)   # cross-attention over a short context
    assert gpu_suite("workloads", quick=True) and all(s.sq <= 4096 for s in gpu_suite("workloads", quick=True))
    assert "window4096" in Shape("m", 1, 16384, 16384, 32, 8, 128, causal=True, window=4096).label()


def test_flops_count_the_window_and_dv():
    s = Shape("t", 2, 64, 64, 4, 2, 16, causal=True, window=7, dv=8)
    i, j = torch.arange(64)[:, None], torch.arange(64)[None, :]
    pairs = int(((j <= i) & (j >= i - 7)).sum())
    assert flops(s, "fwd") == 2 * (16 + 8) * 2 * 4 * pairs
    dense = Shape("t", 2, 64, 64, 4, 4, 16)
    assert flops(dense, "fwd") == 4 * 2 * 4 * 64 * 64 * 16 and flops(dense, "bwd") == 2.5 * flops(dense, "fwd")


def test_flashport_peer_serves_windows_and_dv_exactly():
    s = Shape("t", 1, 40, 40, 4, 2, 16, causal=True, window=9, dv=8, dtype="float32")
    q, k, v = peers.make_inputs(s, torch.device("cpu"), requires_grad=False)
    assert v.shape[-1] == 8
    out = peers.dense_fn("flashport", s, q, k, v)()
    ref, _ = materialized_attention(q, k, v, scale=16 ** -0.5, left=9, right=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sdpa_peer_refuses_a_window():
    s = Shape("t", 1, 8, 8, 2, 2, 16, causal=True, window=3, dtype="float32")
    q, k, v = peers.make_inputs(s, torch.device("cpu"), requires_grad=False)
    with pytest.raises(peers.NotApplicable, match="window"):   # n/a, never a dense call timed in its place
        peers.dense_fn("sdpa-cudnn", s, q, k, v)()


def test_flex_mask_mods_are_the_visibility_rule():
    for kw in (dict(causal=True, window=5), dict(causal=False, window=3), dict(causal=True)):
        s = Shape("t", 1, 20, 20, 1, 1, 16, **kw)
        left, right = s.window_size if s.window >= 0 else (-1, 0)
        i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
        assert torch.equal(peers._mask_mod(s, "cpu")(0, 0, i, j), visible(i, j, 20, 20, left, right).reshape(20, 20))
    chunk = Shape("t", 1, 6, 20, 1, 1, 16, causal=True, kind="chunked", modes=("fwd",))
    i, j = torch.arange(6)[:, None], torch.arange(20)[None, :]
    assert torch.equal(peers._mask_mod(chunk, "cpu")(0, 0, i, j), j <= i + 14)      # bottom-right
    docs = Shape("t", 1, 9, 9, 1, 1, 16, causal=True, kind="varlen", docs=(2, 3, 4))
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2])
    assert torch.equal(peers._mask_mod(docs, "cpu")(0, 0, i, j), (doc[:, None] == doc[None, :]) & (j <= i))


def test_varlen_shape_runs_packed_documents():
    s = Shape("t", 1, 23, 23, 4, 2, 16, causal=True, kind="varlen", docs=(5, 17, 1), dtype="float32")
    q, k, v = peers.make_inputs(s, torch.device("cpu"), requires_grad=True)
    out = peers.dense_fn("flashport", s, q, k, v)()
    assert out.shape == (1, 23, 4, 16)
    start = 0
    for n in s.docs:
        sl = slice(start, start + n)
        ref, _ = materialized_attention(q[:, sl], k[:, sl], v[:, sl], scale=16 ** -0.5, left=-1, right=0)
        torch.testing.assert_close(out[:, sl], ref, atol=1e-5, rtol=1e-5)
        start += n
    out.sum().backward()
    assert q.grad is not None
    with pytest.raises(peers.NotApplicable):
        peers.dense_fn("sdpa-fa2", s, q, k, v)
    pairs = 5 * 6 // 2 + 17 * 18 // 2 + 1
    assert flops(s, "fwd") == 2 * 32 * 4 * pairs


@pytest.mark.parametrize("page", [0, 4])
def test_chunked_prefill_shape_reads_the_cache_bottom_right(page):
    s = Shape("t", 2, 6, 24, 4, 2, 16, causal=True, modes=("fwd",), kind="chunked", page=page, dtype="float32")
    q, k, v = peers.make_inputs(s, torch.device("cpu"), requires_grad=False)
    out = peers.dense_fn("flashport", s, q, k, v)()
    ref, _ = materialized_attention(q, k, v, scale=16 ** -0.5, left=-1, right=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if not page:    # SDPA with causal_lower_right is the same problem (its math kernel on a CPU)
        torch.testing.assert_close(peers.dense_fn("sdpa-fa2", s, q, k, v)(), ref, atol=1e-5, rtol=1e-5)
    else:
        with pytest.raises(peers.NotApplicable, match="paged"):
            peers.dense_fn("sdpa-fa2", s, q, k, v)


def test_ragged_decode_lengths_and_bytes():
    from flashport.bench.shapes import decode_lens, kv_bytes
    s = Shape("t", 8, 1, 64, 4, 2, 16, modes=("fwd",), kind="decode", page=16, ragged=True)
    lens = decode_lens(s)
    assert torch.equal(lens, decode_lens(s)) and 1 <= int(lens.min()) and int(lens.max()) <= 64
    assert len(set(lens.tolist())) > 1
    assert kv_bytes(s) == int(lens.sum()) * 2 * 16 * 2 * 2
    q, kc, vc, got, table = peers.make_cache(s, torch.device("cpu"))
    assert torch.equal(got, lens)
    with pytest.raises(peers.NotApplicable, match="ragged"):
        peers.decode_fn("sdpa-fa2", Shape("t", 8, 1, 64, 4, 2, 16, modes=("fwd",), kind="decode", ragged=True),
                        q, kc, vc, got, None)


def test_ratios_to_the_best_peer_and_the_workloads_plot(tmp_path):
    from flashport.bench import gpu, report
    s = Shape("t", 1, 64, 64, 2, 2, 16, causal=True)
    dec = Shape("r", 4, 1, 64, 2, 2, 16, modes=("fwd",), kind="decode", page=16, ragged=True)

    def e(shape, impl, ms, **kw):
        return dict(label=shape.label(), shape=shape.as_dict(), impl=impl, mode="fwd", status="ok", ms=ms, **kw)
    entries = [e(s, "flashport", 2.0, tflops=1.0), e(s, "sdpa-cudnn", 1.0, tflops=2.0), e(s, "flex", 3.0, tflops=0.5),
               e(dec, "flashport-triton", 1.0, gbps=1.0, frac_of_copy=0.7), e(s, "fa4", 0.5, tflops=4.0)]
    gpu.add_ratios(entries, {})
    assert entries[0]["vs_best_peer"] == 0.25 and entries[0]["best_peer"] == "fa4"
    assert entries[0]["vs_best_bar_peer"] == 0.5      # issue [8]'s bar: cuDNN, FA2, FlexAttention
    assert "vs_best_peer" not in entries[3]
    doc = {"suite": "workloads", "results": entries, "ceilings": {}, "environment": {"card": "test card"}}
    report.plot_gpu(doc, str(tmp_path / "w.png"))
    assert (tmp_path / "w.png").stat().st_size > 1000


def test_fa4_peer_is_marked_not_installed_with_the_reason(monkeypatch):
    import builtins
    from flashport.bench import gpu
    real_import = builtins.__import__

    def no_fa4(name, *a, **kw):   # whether or not flash-attn-4 is installed here, the absent case is what's tested
        if name.startswith("flash_attn"):
            raise ImportError("No module named 'flash_attn'")
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_fa4)
    for kind, kw in (("dense", {}), ("varlen", dict(docs=(3, 5))), ("chunked", dict(modes=("fwd",)))):
        s = Shape("t", 1, 8, 8, 2, 2, 16, causal=True, kind=kind, dtype="float32", **kw)
        q, k, v = peers.make_inputs(s, torch.device("cpu"), requires_grad=False)
        with pytest.raises(peers.NotInstalled, match="flash-attn-4 not installed") as e:
            peers.dense_fn("fa4", s, q, k, v)
        assert gpu._status(e.value) == "not installed"
    assert "fa4" in peers.DENSE and "fa4" in peers.DECODE
    assert set(peers.versions()) == {"flash-attn-4", "nvidia-cutlass-dsl"}


def test_cross_attention_peers_serve_a_short_context_exactly():
    """Sq >> Sk, no mask (top-left and bottom-right agree): flashport and SDPA on the CPU against the reference."""
    s = Shape("t", 1, 48, 5, 2, 2, 16, dtype="float32")
    q, k, v = peers.make_inputs(s, torch.device("cpu"), requires_grad=False)
    ref, _ = materialized_attention(q, k, v, scale=16 ** -0.5)
    for impl in ("flashport", "sdpa-cudnn"):
        try:
            out = peers.dense_fn(impl, s, q, k, v)()
        except peers.NotApplicable:   # a CUDA-only peer on this machine
            continue
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert flops(s, "fwd") == 4 * 1 * 2 * 48 * 5 * 16

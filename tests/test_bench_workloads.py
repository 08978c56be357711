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


def test_flex_window_mask_is_the_visibility_rule():
    for causal, window in ((True, 5), (False, 3)):
        s = Shape("t", 1, 20, 20, 1, 1, 16, causal=causal, window=window)
        mod = peers._window_mod(*s.window_size)
        i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
        left, right = s.window_size
        assert torch.equal(mod(0, 0, i, j), visible(i, j, 20, 20, left, right).reshape(20, 20))

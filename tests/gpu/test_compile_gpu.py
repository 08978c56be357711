"""GPU tier of issue [9]'s torch.compile support (skipped without CUDA): Inductor's "reduce-overhead" mode
captures flashport's custom ops into CUDA graphs (no cudagraph skip) forward and backward, replays equal
eager; and the fuzzer's random calls run through torch.compile(fullgraph=True)."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import flashport  # noqa: E402
from flashport.fuzz import format_summary, run_fuzz  # noqa: E402

N = int(os.environ.get("FLASHPORT_COMPILED_FUZZ_N", "200"))


def _layer(q, k, v):
    return flashport.attention(q, k, v, causal=True).float().square().sum()


@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 128), (16, 4, 64)])
def test_reduce_overhead_captures_forward_and_backward(hq, hkv, d):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(2, 1024, h, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    compiled = torch.compile(_layer, mode="reduce-overhead", fullgraph=True)
    for step in range(4):   # warm-up, record, then replays
        q, k, v = (t.requires_grad_() for t in (mk(hq), mk(hkv), mk(hkv)))
        loss = compiled(q, k, v)
        got = torch.autograd.grad(loss, (q, k, v))
        want = torch.autograd.grad(_layer(q, k, v), (q, k, v))
        torch.testing.assert_close(loss.detach(), _layer(q, k, v).detach(), rtol=1e-3, atol=1e-3)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph_skip" in k}
    assert not any(skips.values()), f"CUDA-graph capture skipped: {skips}"
    from torch._inductor.cudagraph_trees import get_container
    manager = get_container(torch.cuda.current_device()).tree_manager
    recorded = sum(len(nodes) for nodes in manager.roots.values()) if manager is not None else 0
    assert recorded >= 1, "no CUDA graph was recorded"


def test_compiled_fuzz_gpu():
    results, summary = run_fuzz(n=N, seed=3, device="cuda", size="full", compiled=True, verbose=False,
                                out=lambda *a: None)
    bad = [r for r in results if r["status"] not in ("PASS", "SKIP")]
    assert not bad, format_summary(summary) + "\n" + "\n".join(f"{r['repro']}: {r['note']}" for r in bad[:10])
    assert summary["ran"] == N

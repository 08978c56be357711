"""GPU tier of programmable attention (issue [15]), skipped without CUDA: the `flex` backend (compiled
FlexAttention), the `triton` kernels' compiled mods and blockwise on CUDA against the float64 reference, gradients of q, k, v, a captured table and
attn_bias included (Flex has no backward on a CPU, so this is where its gradients are checked); a new sequence
length does not recompile; auto picks the compiled mods (triton), and blockwise for a mod they refuse."""
from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import flashport  # noqa: E402
from flashport.fuzz import mods as fuzz_mods  # noqa: E402

N = int(os.environ.get("FLASHPORT_MODS_FUZZ_N", "300"))
# Each new mod / dtype / head dim is a Flex compile of several seconds: fewer cases there.
N_FLEX = int(os.environ.get("FLASHPORT_MODS_FUZZ_N_FLEX", "40"))
# Each new mod structure is a kernel compile (48 cases took 150 s on the H200 in the 16th session).
N_TRITON = int(os.environ.get("FLASHPORT_MODS_FUZZ_N_TRITON", "100"))


@pytest.mark.parametrize("backend", ["blockwise", "flex", "triton", None], ids=["blockwise", "flex", "triton", "auto"])
def test_mods_fuzz_on_cuda(backend):
    # auto (None): the compiled mods where they compile, blockwise where the generator refuses
    n = {"flex": N_FLEX, "triton": N_TRITON, None: N_TRITON}.get(backend, N)
    results, start = [], time.perf_counter()
    for i in range(n):
        case = fuzz_mods.draw(20261206, i)
        results.append(fuzz_mods.run(case, backend, "cuda"))
        if results[-1]["status"] == "FAIL":   # at once (with -s): a run cut at its time limit still names it
            print(f"FAIL {backend} case {i}: {case} -> {results[-1]['problems']}", flush=True)
        if (i + 1) % 10 == 0:                 # and how far it got: each new mod structure is a compile
            print(f"{backend}: {i + 1}/{n} cases in {time.perf_counter() - start:.0f} s", flush=True)
    fails = [(i, r["problems"]) for i, r in enumerate(results) if r["status"] == "FAIL"]
    passed = sum(r["status"] == "PASS" for r in results)
    print(f"{backend}: {passed} PASS, {len(fails)} FAIL, {n - passed - len(fails)} SKIP")
    assert not fails, fails[:5]
    assert passed >= n // 4   # flex declares head dims 16..256 powers of two: the others SKIP


def test_flex_does_not_recompile_for_new_lengths():
    from torch._dynamo.utils import counters
    from flashport import mods
    table = torch.randn(8, 33, device="cuda", requires_grad=True)
    def step(s):
        q, k, v = (torch.randn(2, s, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = flashport.attention(q, k, v, backend="flex", causal=True, score_mod=mods.relative_position(table))
        out.float().sum().backward()
    step(256)
    before = counters["stats"]["unique_graphs"]
    torch._logging.set_logs(recompiles=True)   # a failure prints the guard that failed
    for s in (384, 512, 1000):
        step(s)
    assert counters["stats"]["unique_graphs"] == before


def test_flex_backward_twice_with_retain_graph():
    """A compiled backward with donated buffers refuses retain_graph=True (the long suite's flex peer raised so in
    the 21st session's run); a user may retain any flashport output's graph."""
    from flashport import mods
    q, k, v = (torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashport.attention(q, k, v, backend="flex", causal=True, score_mod=mods.tanh_softcap(20.0))
    first = torch.autograd.grad(out.float().sum(), (q,), retain_graph=True)[0]
    second = torch.autograd.grad(out.float().sum(), (q,))[0]
    assert torch.equal(first, second)


def test_auto_serves_mods_on_cuda_with_a_declared_backend():
    from flashport import mods
    q = torch.randn(1, 512, 4, 64, device="cuda", dtype=torch.bfloat16)
    flashport.reset_stats()
    window = (lambda b, h, i, j: (i >= j) & (i - j <= 64))    # a mask_mod declaring no built-in rule (mods._rule)
    flashport.attention(q, q, q, mask_mod=window)
    used = [n for n, s in flashport.stats().items() if s["calls"]]
    assert used == ["triton"]   # the compiled mod, not blockwise at PyTorch-op speed
    # a ready-made window declares its rule: it runs as the built-in window, on the same backend, bit for bit
    runs = []
    for kw in (dict(window_size=(64, 0)), dict(mask_mod=mods.sliding_window(64))):
        flashport.reset_stats()
        out = flashport.attention(q, q, q, **kw)
        runs.append((out, [n for n, s in flashport.stats().items() if s["calls"]]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    # a mod the generator refuses goes to the next plan, with the reason in the slow-path warning
    from flashport.backend import triton as tb
    orig = tb.mod_reasons
    try:
        tb.mod_reasons = lambda spec, prog: ["pretend: not compilable"]
        flashport.reset_stats()
        flashport.attention(q, q, q, mask_mod=lambda b, h, i, j: (i >= j) & (i - j <= 32))
    finally:
        tb.mod_reasons = orig
    used = [n for n, s in flashport.stats().items() if s["calls"]]
    assert used == ["flex" if flashport.dispatch.get("flex").auto else "blockwise"]

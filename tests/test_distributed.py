"""flashport.distributed on CPU: ring attention over gloo in spawned processes (world sizes 2 and 4) equals
single-device attention under the tolerance rule, forward and backward; layouts; bad input; and a rank that
raises makes the others fail within the group's timeout instead of hanging.

Each world size is one spawn running every case (process start-up dominates on a 2-core CI box); the parent
unshards the ranks' outputs and gradients and checks them against the float64 reference."""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_worker
import flashport
from conformance import Case, _math, assert_within_rule, magnitude, make_inputs
from flashport.distributed import shard_sequence, unshard_sequence

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

TIMEOUT_S = 20          # the group's timeout in the correctness runs (they take seconds)
FAIL_TIMEOUT_S = 3      # ... and in the test of a failing rank

# (case, layout) per world size; sequence lengths with odd chunk lengths (13 and 9 tokens)
CASES = {
    2: [(Case(b=2, sq=52, sk=52, hq=4, hkv=2, d=16), "zigzag"),
        (Case(b=2, sq=52, sk=52, hq=4, hkv=2, d=16, causal=True), "zigzag"),
        (Case(b=1, sq=52, sk=52, hq=2, hkv=2, d=16, causal=True), "contiguous"),
        (Case(b=1, sq=52, sk=52, hq=4, hkv=1, d=16), "contiguous"),
        (Case(b=1, sq=52, sk=52, hq=2, hkv=1, d=16, window=(7, 3)), "zigzag"),
        (Case(b=1, sq=52, sk=52, hq=2, hkv=2, d=16, causal=True, window=(17, 0), scale=0.3), "contiguous"),
        (Case(b=1, sq=52, sk=52, hq=2, hkv=1, d=16, causal=True, dtype=torch.float64), "zigzag")],
    4: [(Case(b=1, sq=72, sk=72, hq=4, hkv=1, d=16, causal=True), "zigzag"),
        (Case(b=1, sq=72, sk=72, hq=2, hkv=2, d=16), "zigzag"),
        (Case(b=1, sq=72, sk=72, hq=4, hkv=2, d=16, causal=True), "contiguous"),
        (Case(b=1, sq=72, sk=72, hq=2, hkv=1, d=16, window=(11, 2)), "zigzag"),
        (Case(b=1, sq=72, sk=72, hq=2, hkv=2, d=16, causal=True, dtype=torch.float64), "contiguous")],
}


def launch(world, job, tmp_path, timeout_s=TIMEOUT_S, deadline_s=90.0, wait_for=None):
    """Run distributed_worker.main on `world` spawned ranks -> ({rank: result}, seconds); kills what is left
    at the deadline (a hang fails the test instead of blocking CI), and the ranks not in `wait_for` (default:
    all) once those have finished."""
    out = tmp_path / f"w{world}-{job[0]}"
    out.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=distributed_worker.main, daemon=True,
                         args=(r, world, str(out / "rendezvous"), job, str(out), timeout_s)) for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    waited = range(world) if wait_for is None else wait_for
    for r in waited:
        procs[r].join(max(0.0, deadline_s - (time.monotonic() - t0)))
    hung = [r for r in waited if procs[r].is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {deadline_s} s"
    results = {}
    for r in range(world):
        path = out / f"rank{r}.pt"
        assert path.exists(), f"rank {r} exited with {procs[r].exitcode} and wrote nothing"
        results[r] = torch.load(path, weights_only=False)
    return results, time.monotonic() - t0


def run_cases(world, tmp_path):
    """One spawn of `world` ranks running every case of CASES[world] -> per rank, per case (out, lse, dq, dk, dv)."""
    res, _ = launch(world, ("cases", (CASES[world],)), tmp_path)
    for r, x in res.items():
        assert "error" not in x, f"rank {r}: {x.get('traceback', x['error'])}"
    return [x["value"] for _, x in sorted(res.items())]


def check_case(case, layout, per_rank, index):
    got = [unshard_sequence([r[index][n] for r in per_rank], layout, dim=2 if n == 1 else 1) for n in range(5)]
    out, lse, dq, dk, dv = got
    q, k, v, do, _ = make_inputs(case)
    assert out.dtype == case.dtype and lse.dtype == torch.float32 and dk.shape == k.shape

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = _math(*ref_leaves, case, None, torch.float64)
    ref_g = torch.autograd.grad(ref, ref_leaves, do.double())
    if case.dtype == torch.float64:
        # the rule degenerates in float64 (the math path is the reference): tight closeness instead
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, (ref, ref_lse, *ref_g)):
            torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-10, atol=1e-10, msg=name)
        return
    low, low_lse = _math(*leaves, case, None, case.dtype)
    low_g = torch.autograd.grad(low, leaves, do)
    assert_within_rule("out", out, ref, low, case.dtype, 2)
    assert_within_rule("lse", lse, ref_lse, low_lse, case.dtype, 2)
    mag = magnitude(*ref_leaves, do)
    for name, a, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g, low_g):
        assert_within_rule(name, a, r, lo, case.dtype, 3, mag)
    # and the single-device entry point agrees too (same rule)
    single = flashport.attention(q, k, v, causal=case.causal, window_size=case.window, softmax_scale=case.scale)
    assert_within_rule("single-device out", single, ref, low, case.dtype, 2)


@pytest.mark.parametrize("world", sorted(CASES))
def test_ring_equals_single_device(world, tmp_path):
    """Forward and backward of every case (causal and not, GQA, windows, both layouts, fp32 and fp64); one
    test per world size, so that pytest-xdist never spawns the same ranks twice."""
    per_rank = run_cases(world, tmp_path)
    failures = []
    for index, (case, layout) in enumerate(CASES[world]):
        try:
            check_case(case, layout, per_rank, index)
        except AssertionError as e:
            failures.append(f"world {world} {layout} {case}: {e}")
    assert not failures, "\n".join(failures)


def test_unshardable_length_raises_on_every_rank(tmp_path):
    res, seconds = launch(2, ("unshardable", ()), tmp_path)
    for r, x in res.items():
        assert "error" not in x, x.get("traceback")
        assert x["value"] is not None and "cannot be sharded" in x["value"], x["value"]


def test_a_rank_that_raises_does_not_hang_the_others(tmp_path):
    hold = 60   # rank 1 stays alive well past the timeout (killed once rank 0 is done): only the timeout frees rank 0
    res, seconds = launch(2, ("fail", (hold,)), tmp_path, timeout_s=FAIL_TIMEOUT_S, deadline_s=45, wait_for=[0])
    assert "injected failure on rank 1" in res[1]["error"]
    r0 = res[0]["value"]
    assert r0["error"] is not None, "rank 0 finished although rank 1 never sent its block"
    assert r0["seconds"] < 4 * FAIL_TIMEOUT_S, f"rank 0 failed only after {r0['seconds']:.1f} s: {r0['error']}"


# ----------------------------------------------------------------------------- in this process
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_unshard_round_trip(world, layout):
    x = torch.arange(2 * 24 * 3, dtype=torch.float32).reshape(2, 24, 3)
    shards = [shard_sequence(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 24 // world, 3) for s in shards)
    assert torch.equal(unshard_sequence(shards, layout), x)
    pos = torch.cat([flashport.distributed.global_positions(r, world, 24 // world, layout) for r in range(world)])
    assert sorted(pos.tolist()) == list(range(24))
    assert torch.equal(unshard_sequence([shard_sequence(torch.arange(24), r, world, layout, dim=0)
                                         for r in range(world)], layout, dim=0), torch.arange(24))


def test_zigzag_layout_is_the_contracts():
    x = torch.arange(8)[None]   # W = 2: chunks of 2, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert shard_sequence(x, 0, 2).tolist() == [[0, 1, 6, 7]]
    assert shard_sequence(x, 1, 2).tolist() == [[2, 3, 4, 5]]
    assert shard_sequence(x, 1, 2, layout="contiguous").tolist() == [[4, 5, 6, 7]]


@pytest.mark.parametrize("call,exc,word", [
    (lambda x: shard_sequence(x, 0, 4), ValueError, "cannot be sharded"),                 # 12 % 8
    (lambda x: shard_sequence(x, 0, 5, layout="contiguous"), ValueError, "cannot be sharded"),
    (lambda x: shard_sequence(x, 0, 2, layout="ring"), ValueError, "layout"),
    (lambda x: shard_sequence(x, 2, 2), ValueError, "rank"),
    (lambda x: shard_sequence(x, 0, 0), ValueError, "world_size"),
    (lambda x: shard_sequence(x, 0, 2.0), TypeError, "world_size"),
    (lambda x: shard_sequence(x, 0, 2, dim=3), ValueError, "dim"),
    (lambda x: shard_sequence(x.numpy(), 0, 2), TypeError, "x"),
    (lambda x: unshard_sequence([x, x[:, :4]]), ValueError, "shards[1]"),
    (lambda x: unshard_sequence([]), TypeError, "shards"),
    (lambda x: unshard_sequence([x[:, :3]]), ValueError, "even"),
])
def test_layout_bad_input(call, exc, word):
    with pytest.raises(exc, match=word.replace("[", r"\[").replace("]", r"\]")):
        call(torch.zeros(1, 12, 2))


def test_ring_attention_needs_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    x = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="group"):
        flashport.distributed.ring_attention(x, x, x)


@pytest.fixture
def world_of_one(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kw,exc,word", [
    (dict(layout="ring"), ValueError, "layout"),
    (dict(window_size=(4,)), ValueError, "window_size"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(causal=True, window_size=(4, 2)), ValueError, "causal"),
    (dict(causal=1), TypeError, "causal"),
    (dict(group="world"), TypeError, "group"),
    (dict(softmax_scale="x"), TypeError, "softmax_scale"),
])
def test_ring_attention_bad_input(world_of_one, kw, exc, word):
    x = torch.randn(1, 8, 2, 16)
    with pytest.raises(exc, match=word):
        flashport.distributed.ring_attention(x, x, x, **kw)


def test_ring_attention_bad_tensors(world_of_one):
    x = torch.randn(1, 8, 4, 16)
    with pytest.raises(ValueError, match="cannot be sharded"):
        flashport.distributed.ring_attention(x[:, :7], x[:, :7], x[:, :7])
    with pytest.raises(ValueError, match="shard length"):
        flashport.distributed.ring_attention(x, x[:, :4], x[:, :4])
    with pytest.raises(ValueError):   # Hq % Hkv
        flashport.distributed.ring_attention(x, x[:, :, :3], x[:, :, :3])


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 2))])
def test_world_of_one_is_attention(world_of_one, causal, window):
    q, k, v, do, _ = make_inputs(Case(b=2, sq=18, sk=18, hq=4, hkv=2, d=16))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flashport.distributed.ring_attention(*leaves, causal=causal, window_size=window)
    got = (out, *torch.autograd.grad(out, leaves, do))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = flashport.attention(*leaves, causal=causal, window_size=window)
    for a, b in zip(got, (ref, *torch.autograd.grad(ref, leaves, do))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


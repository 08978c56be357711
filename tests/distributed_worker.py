"""The processes of tests/test_distributed.py: one per rank, started with multiprocessing's spawn.

Each joins a gloo group through a file:// rendezvous, runs its job and writes what it got (or the exception it
raised) to <out>/rank<r>.pt, so the parent compares whole sequences against single-device attention.
"""
from __future__ import annotations

import datetime
import os
import time
import traceback

import torch


def _cases(rank, world, cases):
    import flashport
    from conformance import make_inputs
    fd = flashport.distributed
    results = []
    for case, layout in cases:
        q, k, v, do, _ = make_inputs(case)
        leaves = [fd.shard_sequence(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
        out, lse = fd.ring_attention(*leaves, causal=case.causal, layout=layout, softmax_scale=case.scale,
                                     window_size=case.window, return_lse=True)
        grads = torch.autograd.grad(out, leaves, fd.shard_sequence(do, rank, world, layout))
        results.append((out.detach(), lse.detach(), *grads))
    return results


def _unshardable(rank, world):
    """Every rank gets the same shapes, so every rank raises, and none waits for another."""
    import flashport
    x = torch.randn(1, 3, 2, 16)   # zigzag needs an even shard (two chunks per rank)
    try:
        flashport.distributed.ring_attention(x, x, x, layout="zigzag")
    except ValueError as e:
        return str(e)
    return None


def _one_rank_raises(rank, world, hold_s, out_dir):
    """Rank 1 fails before its ring step and stays alive (a process stuck in its error handling); the others
    are inside ring_attention waiting for its K/V block.  They must fail by the group's timeout."""
    import flashport
    x = torch.randn(1, 8, 2, 16)
    if rank == 1:
        try:
            raise RuntimeError("injected failure on rank 1")
        except RuntimeError as e:
            torch.save({"error": f"{type(e).__name__}: {e}"}, os.path.join(out_dir, "rank1.pt"))
            time.sleep(hold_s)   # the parent kills it once the others are done
            raise
    t0 = time.monotonic()
    try:
        flashport.distributed.ring_attention(x, x, x, layout="zigzag")
    except Exception as e:   # gloo: "Timed out waiting ... for recv operation to complete"
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def main(rank, world, init_file, job, out_dir, timeout_s):
    torch.set_num_threads(1)
    import torch.distributed as dist
    result = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        kind, args = job
        if kind == "fail":
            args = (*args, out_dir)
        result["value"] = {"cases": _cases, "unshardable": _unshardable, "fail": _one_rank_raises}[kind](
            rank, world, *args)
    except BaseException as e:   # noqa: BLE001  (reported to the parent, which decides)
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    path = os.path.join(out_dir, f"rank{rank}.pt")
    if not os.path.exists(path):
        torch.save(result, path)
    if "error" in result:
        os._exit(1)   # a failed group's teardown may block on the peers: leave at once
    dist.destroy_process_group()

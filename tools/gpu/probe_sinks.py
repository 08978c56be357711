"""Where the window + sinks call's time goes, and what the 21st session's changes do to it (issue [15], PERFLOG rows
76, 77), on the programmable suite's shape (B=2, H=16, S=16384, D=128, bf16, window 2048 + 4 sinks):

- the whole call with each change switched off in turn (FLASHPORT_BWD_Q_CHUNKS=1: one dK/dV program per key tile;
  the merge's PyTorch backward instead of its kernel);
- its pieces alone: the window call with its lse, the sinks' call over 4 keys, the merge;
- cross-attention over a short context (Sq = 4096, Sk = 77, B = 2, H = 8, D = 64), Q chunks auto and 1;
- one training step under torch.profiler (kernels by CUDA time);
- then the first failing cases of the flex mods fuzz, named (the GPU tier's flex test died unnamed).

Writes JSON lines to --out; every timing is a median of triton.testing.do_bench, one process."""
from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager

import torch

import flashport
from flashport import merge, mods
from flashport.bench.timing import gpu_ms


@contextmanager
def setting(env: dict, torch_merge_bwd: bool = False):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    saved = merge._backward_for
    if torch_merge_bwd:
        merge._backward_for = lambda o: merge.merge_backward_torch
    try:
        yield
    finally:
        merge._backward_for = saved
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fwd_bwd_ms(fn, leaves, loss):
    """(forward ms, backward ms): the forward alone, then a training step less the forward."""
    f = gpu_ms(lambda: fn())
    step = gpu_ms(lambda: torch.autograd.grad(loss(fn()), leaves, allow_unused=True))
    return f, step - f


def served_by(fn, leaves, loss) -> dict:
    flashport.reset_stats()
    torch.autograd.grad(loss(fn()), leaves, allow_unused=True)
    return {n: (c["forward"], c["backward"]) for n, c in flashport.stats().items() if c["forward"] or c["backward"]}


def sinks(out, s=16384, w=2048, n=4):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, s, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    do = torch.randn(2, s, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    dl = torch.randn(2, 16, s, device="cuda", generator=g) * 0.1
    bm = flashport.create_block_mask(mods.sliding_window(w, sinks=n), None, None, s, s, device="cuda")
    leaves = (q, k, v)
    on_out = lambda o: (o.float() * do.float()).sum()                                        # noqa: E731
    on_both = lambda r: (r[0].float() * do.float()).sum() + (r[1] * dl).sum()               # noqa: E731
    whole = lambda: flashport.attention(q, k, v, block_mask=bm)                              # noqa: E731
    right = s - n - w - 1
    pieces = [
        ("whole call (this session's defaults)", whole, on_out, {}, False),
        ("whole call, one dK/dV program per key tile (row 77 off)", whole, on_out,
         {"FLASHPORT_BWD_Q_CHUNKS": "1"}, False),
        ("whole call, the merge's PyTorch backward (row 76 off)", whole, on_out, {}, True),
        ("whole call, both off (the 20th session's code)", whole, on_out, {"FLASHPORT_BWD_Q_CHUNKS": "1"}, True),
        ("window alone, no lse", lambda: flashport.attention(q, k, v, window_size=(w, 0)), on_out, {}, False),
        ("window with lse (grads into out and lse)",
         lambda: flashport.attention(q, k, v, window_size=(w, 0), return_lse=True), on_both, {}, False),
        ("sinks' call, 4 keys, Q chunks auto", lambda: flashport.attention(
            q, k[:, :n], v[:, :n], window_size=(-1, right), return_lse=True), on_both, {}, False),
        ("sinks' call, 4 keys, one program per key tile", lambda: flashport.attention(
            q, k[:, :n], v[:, :n], window_size=(-1, right), return_lse=True), on_both,
         {"FLASHPORT_BWD_Q_CHUNKS": "1"}, False),
    ]
    for name, fn, loss, env, torch_bwd in pieces:
        with setting(env, torch_bwd):
            f, b = fwd_bwd_ms(fn, leaves, loss)
            out.write(json.dumps(dict(probe="sinks", piece=name, fwd_ms=f, bwd_ms=b,
                                      served=str(served_by(fn, leaves, loss)))) + "\n")
        out.flush()
    kw = dict(return_lse=True)
    o1, l1 = (t.detach().requires_grad_() for t in flashport.attention(q, k, v, window_size=(w, 0), **kw))
    o2, l2 = (t.detach().requires_grad_() for t in flashport.attention(q, k[:, :n], v[:, :n],
                                                                       window_size=(-1, right), **kw))
    parts = (o1, o2, l1, l2)
    for name, torch_bwd in (("merge, its backward kernel", False), ("merge, the PyTorch backward", True)):
        with setting({}, torch_bwd):
            f, b = fwd_bwd_ms(lambda: flashport.merge_attention_states([o1, o2], [l1, l2]), parts, on_both)
        out.write(json.dumps(dict(probe="sinks", piece=name, fwd_ms=f, bwd_ms=b)) + "\n")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(on_out(whole()), leaves)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    out.write(json.dumps(dict(probe="sinks", piece="profile of one step", table=table)) + "\n")
    print(table)


def cross_attention(out):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 4096, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(2, 77, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    do = torch.randn_like(q)
    for chunks in ("auto", "1"):
        with setting({"FLASHPORT_BWD_Q_CHUNKS": chunks}):
            f, b = fwd_bwd_ms(lambda: flashport.attention(q, k, v), (q, k, v), lambda o: (o.float() * do).sum())
        out.write(json.dumps(dict(probe="cross-attention Sq 4096 Sk 77", q_chunks=chunks, fwd_ms=f, bwd_ms=b)) + "\n")


def flex_fuzz(out, seconds):
    from flashport.fuzz import mods as fm
    t0, fails, i = time.time(), 0, 0
    for i in range(40):
        if time.time() - t0 > seconds or fails >= 3:
            break
        case = fm.draw(20261206, i)
        r = fm.run(case, "flex", "cuda")
        if r["status"] == "FAIL":
            fails += 1
            out.write(json.dumps(dict(probe="flex fuzz", index=i, case=case, problems=r["problems"])) + "\n")
            print("FAIL", i, r["problems"])
        out.flush()
    out.write(json.dumps(dict(probe="flex fuzz", ran_until=i, seconds=time.time() - t0, fails=fails)) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--flex-seconds", type=float, default=60)
    a = ap.parse_args()
    with open(a.out, "w") as out:
        out.write(json.dumps(dict(card=torch.cuda.get_device_name())) + "\n")
        sinks(out)
        cross_attention(out)
        out.flush()
        flex_fuzz(out, a.flex_seconds)
    for line in open(a.out):
        print(line.rstrip()[:600])

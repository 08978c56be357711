"""Where the window + sinks call's time goes (issue [15], PERFLOG row 74): one training step of the programmable
suite's case under torch.profiler (kernels by CUDA time), and each of its pieces timed alone -- the window call
with its lse, the sink call over the first 4 keys (the kernels' backward and few_keys' dense one), the merge --
on the suite's shape (B=2, H=16, S=16384, D=128, bf16).  Then the first failing cases of the flex mods fuzz, named (the GPU tier's flex test died unnamed).
Writes JSON lines to --out."""
from __future__ import annotations

import argparse
import json
import time

import torch

import flashport
from flashport import few_keys, mods
from flashport.bench.timing import gpu_ms


def step_ms(fn, leaves, do):
    fwd = gpu_ms(lambda: fn())
    step = gpu_ms(lambda: torch.autograd.grad(fn(), leaves, do, allow_unused=True))
    return fwd, step - fwd


def sinks(out, s=16384, w=2048, n=4):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, s, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    do = torch.randn(2, s, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    dl = torch.randn(2, 16, s, device="cuda", generator=g) * 0.1
    bm = flashport.create_block_mask(mods.sliding_window(w, sinks=n), None, None, s, s, device="cuda")
    m = n

    def lse_leaf(fn):   # out and lse both carry a gradient, as in the merge
        def run():
            o, lse = fn()
            return (o.float() * do.float()).sum() + (lse * dl).sum()
        return run

    import os
    pieces = {
        "whole call, sinks' backward dense (few_keys)": (lambda: flashport.attention(q, k, v, block_mask=bm), do, "1"),
        "whole call, sinks' backward by the kernels": (lambda: flashport.attention(q, k, v, block_mask=bm), do, "0"),
        "window alone, no lse": (lambda: flashport.attention(q, k, v, window_size=(w, 0)), do, "1"),
    }
    for name, (fn, d, flag) in pieces.items():
        os.environ["FLASHPORT_FEW_KEYS_DENSE_BWD"] = flag
        f, b = step_ms(fn, (q, k, v), d)
        flashport.reset_stats()
        torch.autograd.grad(fn(), (q, k, v), d, allow_unused=True)
        served = {k_: v_ for k_, v_ in flashport.stats().items() if v_["forward"] or v_["backward"]}
        out.write(json.dumps(dict(probe="sinks", piece=name, fwd_ms=f, bwd_ms=b, served=str(served))) + "\n")
    kw = dict(return_lse=True)
    for name, fn in {
        "window with lse (grads into out and lse)": lambda: flashport.attention(q, k, v, window_size=(w, 0), **kw),
        "sink call (4 keys, grads into out and lse), the kernels' backward": lambda: flashport.attention(
            q, k[:, :m], v[:, :m], window_size=(-1, s - m - w - 1), **kw),
        "sink call (4 keys, grads into out and lse), dense backward": lambda: few_keys.attention(
            q, k[:, :m], v[:, :m], right=s - m - w - 1, softmax_scale=128 ** -0.5, softcap=0.0, deterministic=False),
    }.items():
        run = lse_leaf(fn)
        f = gpu_ms(lambda: fn())
        st = gpu_ms(lambda: torch.autograd.grad(run(), (q, k, v), allow_unused=True))
        out.write(json.dumps(dict(probe="sinks", piece=name, fwd_ms=f, bwd_ms=st - f)) + "\n")
    o1, l1 = (t.detach().requires_grad_() for t in flashport.attention(q, k, v, window_size=(w, 0), **kw))
    o2, l2 = (t.detach().requires_grad_() for t in flashport.attention(q, k[:, :m], v[:, :m],
                                                                       window_size=(-1, s - m - w - 1), **kw))
    f = gpu_ms(lambda: flashport.merge_attention_states([o1, o2], [l1, l2]))
    st = gpu_ms(lambda: torch.autograd.grad(flashport.merge_attention_states([o1, o2], [l1, l2])[0], (o1, o2, l1, l2), do))
    out.write(json.dumps(dict(probe="sinks", piece="merge", fwd_ms=f, bwd_ms=st - f)) + "\n")
    os.environ["FLASHPORT_FEW_KEYS_DENSE_BWD"] = "1"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(flashport.attention(q, k, v, block_mask=bm), (q, k, v), do)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    out.write(json.dumps(dict(probe="sinks", piece="profile of one step", table=table)) + "\n")
    print(table)


def flex_fuzz(out, seconds):
    from flashport.fuzz import mods as fm
    t0, fails = time.time(), 0
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
        out.flush()
        flex_fuzz(out, a.flex_seconds)
    for line in open(a.out):
        print(line.rstrip()[:600])

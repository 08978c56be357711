"""What the on-device content guard costs a decode step (issue [5]): eager host microseconds per call and
device time (CUDA graph replay), with flashport.contents.guard on and switched off, same process, H200.
Prints one JSON line per configuration; writes $OUT/guard_cost.json when OUT is set."""
import json
import os
import time

import torch
import triton.testing

import flashport
import flashport.api

real_guard = flashport.api.guard
rows = []


def host_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


for b, s, page in ((1, 32768, 0), (64, 4096, 0), (64, 4096, 16)):
    hq, hkv, d = 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    lens = torch.full((b,), s - 1, dtype=torch.int32, device="cuda")
    if page:
        n = s // page
        kc = torch.randn(b * n, page, hkv, d, device="cuda", dtype=torch.bfloat16)
        table = torch.arange(b * n, dtype=torch.int32, device="cuda").view(b, n)
    else:
        kc = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
        table = None
    vc = torch.randn_like(kc)

    def step():
        return flashport.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table)
    for guarded in (True, False):
        flashport.api.guard = real_guard if guarded else (lambda spec, inputs, cache_seqlens=None: inputs)
        us = host_us(step)
        g = torch.cuda.CUDAGraph()
        step()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            step()
        ms = triton.testing.do_bench(g.replay, warmup=25, rep=100)
        row = dict(batch=b, kv_len=s, page=page, guard=guarded, host_us=round(us, 1), graph_replay_us=round(ms * 1e3, 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
flashport.api.guard = real_guard
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "guard_cost.json"), "w") as f:
        json.dump({"card": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)

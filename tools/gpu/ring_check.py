"""flashport.distributed.ring_attention on NCCL against single-device attention, on the GPU.

Without torchrun: rank 0 of a world of one (MASTER_ADDR / MASTER_PORT set here), or under torchrun with
RANK / WORLD_SIZE / LOCAL_RANK from the environment (one GPU per rank).  For each case every rank builds the
same full sequence, runs ring_attention on its shard, forward and backward, and checks its shard of out and
of dq, dk, dv under the tolerance rule (float64 reference, same-dtype math path; 2x for out, 3x for
gradients); rank 0 prints one line per case and a timing of ring vs attention at a long length.

    python tools/gpu/ring_check.py                           # world of one
    torchrun --nproc-per-node 2 tools/gpu/ring_check.py      # two GPUs
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import flashport  # noqa: E402
from flashport.backend.reference import materialized_attention  # noqa: E402
from flashport.check import assert_within_rule, magnitude  # noqa: E402
from flashport.distributed import ring_attention, shard_sequence  # noqa: E402

CASES = [  # (S, Hq, Hkv, D, dtype, causal, window, layout)
    (4096, 8, 2, 128, torch.bfloat16, True, (-1, -1), "zigzag"),
    (4096, 8, 2, 128, torch.bfloat16, True, (-1, -1), "contiguous"),
    (4096, 8, 8, 128, torch.bfloat16, False, (-1, -1), "zigzag"),
    (4096, 8, 2, 64, torch.float16, True, (700, 0), "zigzag"),
    (2048, 4, 1, 128, torch.bfloat16, False, (333, 77), "contiguous"),
    (2048, 4, 2, 64, torch.float32, True, (-1, -1), "zigzag"),
]


def init():
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60),
                                device_id=dev)
    else:   # a smoke run of this script on a CPU (gloo)
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)   # the group works at all
    assert t.item() == world
    return rank, world, dev


def check(case, rank, world, dev):
    s, hq, hkv, d, dtype, causal, window, layout = case
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(1, s, h, d, device=dev, generator=g).to(dtype) for h in (hq, hkv, hkv, hq))
    shards = [shard_sequence(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*shards, causal=causal, window_size=window, layout=layout)
    grads = torch.autograd.grad(out, shards, shard_sequence(do, rank, world, layout))
    left, right = window[0], 0 if causal else window[1]
    scale = d ** -0.5
    results = {}
    for cd in (torch.float64, dtype):
        leaves = [t.detach().to(cd).requires_grad_() for t in (q, k, v)]
        ref, _ = materialized_attention(*leaves, scale=scale, left=left, right=right, compute_dtype=cd)
        rg = torch.autograd.grad(ref, leaves, do.to(cd))
        results[cd] = [shard_sequence(t, rank, world, layout) for t in (ref.detach(), *rg)]
        del ref, rg, leaves
    mag = magnitude(q, k, v, do)
    errs = []
    for n, (name, got) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *grads))):
        ref64, low = results[torch.float64][n], results[dtype][n]
        assert_within_rule(f"{name} {case}", got, ref64, low, dtype, 2 if n == 0 else 3, None if n == 0 else mag)
        err, base = ((x.double() - ref64).abs().max().item() for x in (got, low))
        errs.append(f"{name} {err:.2e} (math {base:.2e})")
    # and the single-device entry point on the same inputs
    single = flashport.attention(q, k, v, causal=causal, window_size=window)
    diff = (shard_sequence(single, rank, world, layout).float() - out.float()).abs().max().item()
    return "; ".join(errs) + f"; |ring - attention| {diff:.2e}"


def timing(rank, world, dev, s, h=8, d=128):
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(1, s, h, d, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3))
    rows = {}
    for name, fn in (("attention", lambda x, y, z: flashport.attention(x, y, z, causal=True)),
                     ("ring zigzag", lambda x, y, z: ring_attention(x, y, z, causal=True, layout="zigzag"))):
        xs = [shard_sequence(t, rank, world, "zigzag").requires_grad_() for t in (q, k, v)] \
            if name != "attention" else [t.detach().requires_grad_() for t in (q, k, v)]
        times = []
        for it in range(3):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            o = fn(*xs)
            sync()
            t1 = time.perf_counter()
            o.backward(torch.ones_like(o))
            sync()
            times.append((t1 - t0, time.perf_counter() - t1))
        rows[name] = min(times)
    return rows


def main():
    rank, world, dev = init()
    if rank == 0:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        print(f"{name}: world_size={world}, torch {torch.__version__}, "
              f"backend {dist.get_backend()}", flush=True)
    failures = 0
    for case in CASES:
        try:
            line = "ok   " + check(case, rank, world, dev)
        except AssertionError as e:
            failures += 1
            line = f"FAIL {e}"
        if rank == 0:
            s, hq, hkv, d, dtype, causal, window, layout = case
            print(f"S={s} H={hq}/{hkv} D={d} {str(dtype)[6:]} causal={causal} window={window} {layout}: {line}",
                  flush=True)
    s = 131072 if dev.type == "cuda" else 2048
    rows = timing(rank, world, dev, s)
    if rank == 0:
        for name, (f, b) in rows.items():
            print(f"S={s} H=8 D=128 bf16 causal, {name}: forward {f * 1e3:.1f} ms, backward {b * 1e3:.1f} ms "
                  f"(world {world})", flush=True)
        print(f"{len(CASES) - failures}/{len(CASES)} cases within the tolerance rule; backends used: "
              f"{sorted(n for n, s in flashport.stats().items() if s['calls'])}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

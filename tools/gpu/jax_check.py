"""flashport.jax on a CUDA machine: conformance of cudnn, blockwise and xla against the float64 reference
(the tolerance rule, forward + lse + gradients), then a timing table on standard-suite shapes beside the
torch frontend's auto backend, in the same process on the same card.  JSON to $OUT/jax_gpu.json.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python tools/gpu/jax_check.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # torch times on the same card afterwards

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import flashport.jax as fj  # noqa: E402
from flashport.check import format_table  # noqa: E402
from flashport.jax import conformance as C  # noqa: E402

BACKENDS = ("cudnn", "blockwise", "xla")


def conformance_cases():
    g = C.grid("gpu")
    g += [C.Case("cudnn-causal-gqa-d64-1024", b=2, sq=1024, sk=1024, hq=8, hkv=2, d=64, causal=True),
          C.Case("cudnn-d128-2048", sq=2048, sk=2048, hq=4, hkv=4, d=128),
          C.Case("cudnn-causal-window-d128-2048", sq=2048, sk=2048, hq=4, hkv=2, d=128, window=(256, 0)),
          C.Case("cudnn-causal-gqa-d128-4096", sq=4096, sk=4096, hq=2, hkv=1, d=128, causal=True)]
    return g


def median_time(fn, *args, reps=10, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_shapes(quick):
    s_list = (1024, 4096) if quick else (1024, 2048, 4096, 8192)
    for d in (64, 128):
        for s in s_list:
            for causal in (False, True):
                yield dict(b=16384 // s, s=s, h=16, d=d, causal=causal)


def bench_jax(name, shape):
    b, s, h, d, causal = shape["b"], shape["s"], shape["h"], shape["d"], shape["causal"]
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks)
    fwd = jax.jit(lambda q, k, v: fj.attention(q, k, v, causal=causal, backend=name))
    # dO is an argument, not a captured constant (XLA would constant-fold it at compile time)
    fb = jax.jit(jax.grad(lambda q, k, v, do: jnp.vdot(fj.attention(q, k, v, causal=causal, backend=name)
                                                        .astype(jnp.float32), do.astype(jnp.float32)), (0, 1, 2)))
    t_f = median_time(fwd, q, k, v)
    t_fb = median_time(fb, q, k, v, do)
    return t_f, t_fb


def bench_torch(shape):
    import torch
    import flashport
    b, s, h, d, causal = shape["b"], shape["s"], shape["h"], shape["d"], shape["causal"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        return statistics.median(ts)

    with torch.no_grad():
        t_f = timed(lambda: flashport.attention(q, k, v, causal=causal))
    t_fb = timed(lambda: torch.autograd.grad(flashport.attention(q, k, v, causal=causal), (q, k, v), do))
    return t_f, t_fb


def flops(shape):
    f = 4 * shape["b"] * shape["h"] * shape["s"] * shape["s"] * shape["d"]
    return f / 2 if shape["causal"] else f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/flashport_out")
    os.makedirs(out_dir, exist_ok=True)
    report = {"environment": fj.environment(), "backends": fj.describe(), "conformance": [], "bench": []}
    print(json.dumps(report["environment"]))
    for i in report["backends"]:
        print(f"  {i['name']:<17} available={i['available']} {'; '.join(i['reasons'])}")

    if not args.no_check:
        results = []
        for name in BACKENDS:
            for dtype in ("bfloat16", "float16"):
                for case in conformance_cases():
                    if name == "xla" and case.sq > 2048:
                        continue
                    r = C.check_case(name, case, dtype)
                    results.append(r)
                    print(f"{r.backend:<10} {r.case:<40} {r.status} {r.worst} {r.err:.2e} <= {r.bound:.2e} "
                          f"{r.seconds:.1f}s {r.note[:80]}", flush=True)
        print(format_table(results))
        report["conformance"] = [r.__dict__ for r in results]
        print("conformance:", {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")})

    rows = []
    for shape in () if args.no_bench else bench_shapes(args.quick):
        row = dict(shape)
        fl = flops(shape)
        for name in BACKENDS:
            if name == "xla" and shape["s"] > 4096:
                continue
            try:
                t_f, t_fb = bench_jax(name, shape)
                row[name] = {"fwd_ms": t_f * 1e3, "fwdbwd_ms": t_fb * 1e3, "fwd_tflops": fl / t_f / 1e12,
                             "bwd_tflops": 2.5 * fl / max(t_fb - t_f, 1e-9) / 1e12}
            except Exception as e:  # noqa: BLE001 - a refusal or an OOM is a row entry, not a crash
                row[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:160]}
        rows.append(row)
    if rows and not args.no_torch:
        try:
            import torch
            if torch.cuda.is_available():
                for row in rows:
                    t_f, t_fb = bench_torch(row)
                    fl = flops(row)
                    row["torch-auto"] = {"fwd_ms": t_f * 1e3, "fwdbwd_ms": t_fb * 1e3, "fwd_tflops": fl / t_f / 1e12,
                                         "bwd_tflops": 2.5 * fl / max(t_fb - t_f, 1e-9) / 1e12}
        except Exception as e:  # noqa: BLE001
            print("torch timing skipped:", e)
    report["bench"] = rows
    cols = [c for c in BACKENDS + ("torch-auto",) if any(c in r for r in rows)]
    print("\nTFLOP/s fwd / bwd (bf16, B*S = 16384, H = 16); FLOPs: fwd 4*B*H*S^2*D (halved causal), bwd 2.5x")
    print(f"{'D':>4} {'S':>5} {'causal':>6}  " + "  ".join(f"{c:>17}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            e = r.get(c)
            tf = "err" if e and "error" in e else (e and f"{e['fwd_tflops']:7.1f} /{e['bwd_tflops']:7.1f}")
            cells.append(tf or "-")
        print(f"{r['d']:>4} {r['s']:>5} {str(r['causal']):>6}  " + "  ".join(f"{x:>17}" for x in cells))
    for r in rows:
        for c in cols:
            if "error" in r.get(c, {}):
                print(f"  {c} D={r['d']} S={r['s']} causal={r['causal']}: {r[c]['error']}")
    with open(os.path.join(out_dir, "jax_gpu.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    fails = [r for r in report["conformance"] if r["status"] == "FAIL"]
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

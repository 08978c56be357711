#!/usr/bin/env python3
"""One GPU script for the `triton` backend: correctness, config tuning, and speed against PyTorch's
FlashAttention-2 and cuDNN SDPA kernels, measured in the same process on the same card.

  (a) correctness: forward and backward on a few shapes against `reference` (max error, and the
      tolerance rule's bound);
  (b) tuning (optional, --tune): times candidate configs per head dim (tuning.autotune) after
      compiling them in parallel worker processes, and writes the table triton_configs.json;
  (c) speed: the standard set (bf16, B*S = 16384, H*D = 2048, D in {64, 128, 256},
      S in {1024, 4096, 16384}, causal and not), fwd and bwd median times (triton.testing.do_bench)
      -> TFLOP/s (fwd 4*B*H*S*S*D, halved if causal; bwd 2.5 x fwd) and ratios to FA2 / cuDNN.

Writes gpu_triton_check.json (and triton_configs.json with --tune) to --out (default $OUT or
results/).  --budget stops the optional parts in time; what was measured is always written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flashport  # noqa: E402
from flashport.backend.reference import materialized_attention  # noqa: E402
from flashport.check import magnitude, rule_error  # noqa: E402

T0 = time.time()


def elapsed() -> float:
    return time.time() - T0


def log(*a):
    print(f"[{elapsed():6.1f}s]", *a, flush=True)


# ----------------------------------------------------------------------------- (a) correctness
CORRECTNESS = [  # (B, S, Hq, Hkv, D, causal)
    (2, 1024, 8, 8, 64, True),
    (1, 2048, 4, 2, 128, False),
    (1, 1024, 4, 4, 256, True),
    (2, 777, 6, 2, 80, True),
    (2, 600, 4, 4, 72, False),  # head stride 72: the ALIGN hint path
]


def correctness(dtype=torch.bfloat16):
    rows = []
    for b, s, hq, hkv, d, causal in CORRECTNESS:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g)
        do = torch.randn(b, s, hq, d, device="cuda", dtype=dtype, generator=g)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashport.attention(*leaves, causal=causal, backend="triton")
        grads = torch.autograd.grad(out, leaves, do)
        row = dict(shape=[b, s, hq, hkv, d], causal=causal)
        refs = {}
        for cd in (torch.float64, dtype):
            ls = [t.detach().to(cd).requires_grad_() for t in (q, k, v)]
            o, _ = materialized_attention(*ls, scale=d ** -0.5, right=0 if causal else -1, compute_dtype=cd)
            refs[cd] = (o, torch.autograd.grad(o, ls, do.to(cd)))
        ok = True
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = out if i == 0 else grads[i - 1]
            ref = refs[torch.float64][0] if i == 0 else refs[torch.float64][1][i - 1]
            low = refs[dtype][0] if i == 0 else refs[dtype][1][i - 1]
            err, bound = rule_error(got, ref, low, dtype, 2.0 if i == 0 else 3.0,
                                    None if i == 0 else magnitude(q, k, v, do))
            row[name] = dict(max_err=err, bound=bound)
            ok &= err <= bound
        row["pass"] = bool(ok)
        rows.append(row)
        log("correct", row["shape"], "causal" if causal else "full", "PASS" if ok else "FAIL",
            " ".join(f"{n}={row[n]['max_err']:.2e}/{row[n]['bound']:.2e}" for n in ("out", "dq", "dk", "dv")))
        del q, k, v, do, leaves, out, grads, refs
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- (b) tuning
# (B, S) per length class of tuning.length_key, H * D = 2048 as in the standard set
TUNE_LENGTHS = {"short": (16, 1024), "long": (4, 4096)}
TUNE_DIMS = (64, 128, 256)


def _compile_worker(job):
    """Compile one (kernel, config) in a worker process (fills Triton's on-disk cache)."""
    kernel, cfg, (b, s, h, d), causal = job
    try:
        from flashport.kernels import attn_bwd, attn_fwd
        from flashport.kernels.tuning import KernelConfig
        from flashport.spec import dense_spec
        cfg = KernelConfig(*cfg)
        q, k, v = (torch.randn(b, 256, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        spec, _ = dense_spec(q, k, v, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
        if kernel == "fwd":
            attn_fwd.forward(spec, q, k, v, config=cfg)
        else:
            out, _, lse2 = attn_fwd.forward(spec, q, k, v)
            attn_bwd.backward(spec, torch.randn_like(out), q, k, v, out, lse2, configs={kernel: cfg})
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported, the timing step skips it
        return f"{kernel} {cfg}: {type(e).__name__}: {str(e)[:200]}"


def tune(out_dir: Path, budget_s: float, causal_too: bool, kernels):
    import multiprocessing as mp

    from flashport.kernels import tuning
    jobs = []
    for d in TUNE_DIMS:
        for causal in (False, True) if causal_too else (False,):
            for kernel in kernels:
                for cfg in tuning.default_configs(kernel, d, torch.bfloat16, 2, 5):
                    jobs.append((kernel, tuple(cfg.__dict__.values()), (1, 256, 2048 // d, d), causal))
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    log(f"tune: compiling {len(jobs)} candidates in {workers} processes")
    with mp.get_context("spawn").Pool(workers) as pool:
        for err in pool.imap_unordered(_compile_worker, jobs):
            if err:
                log("  compile failed:", err)
    log("tune: timing")
    table_path = out_dir / "triton_configs.json"
    if tuning.CONFIG_PATH.exists() and not table_path.exists():
        table_path.write_text(tuning.CONFIG_PATH.read_text())
    shapes = [(b, s, 2048 // d, d, c) for d in TUNE_DIMS for (b, s) in TUNE_LENGTHS.values()
              for c in ((False, True) if causal_too else (False,))]
    cands = {kn: {d: tuning.default_configs(kn, d, torch.bfloat16, 2, 5) for d in TUNE_DIMS} for kn in kernels}
    best = {}
    for shape in shapes:
        if elapsed() > budget_s:
            log("tune: budget reached, stopping")
            break
        best.update(tuning.autotune([shape], kernels=kernels, configs=cands, path=table_path, log=lambda m: log(m)))
    # a full-mask winner stands in for causal / local keys that were not timed (replacing older entries)
    for key, (cfg, _) in list(best.items()):
        for mask in ("causal", "local"):
            alt = key.replace("|full", "|" + mask)
            if alt != key and alt not in best:
                tuning.TABLE[alt] = cfg
    table = json.loads(table_path.read_text()) if table_path.exists() else {"entries": {}}
    for key, cfg in tuning.TABLE.items():
        table["entries"][key] = cfg.__dict__
    table_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tuning._chosen.clear()
    return {k: dict(config=c.__dict__, ms=ms) for k, (c, ms) in best.items()}


# ----------------------------------------------------------------------------- (c) speed
def _sdpa(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kind]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                 v.transpose(1, 2), is_causal=causal)
        return o.transpose(1, 2)
    return run


def _triton(q, k, v, causal):
    return flashport.attention(q, k, v, causal=causal, backend="triton")


def bench_one(fn, b, s, h, d, causal, rep):
    import triton.testing
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, causal)
    fwd = triton.testing.do_bench(lambda: fn(*leaves, causal), warmup=10, rep=rep)
    bwd = triton.testing.do_bench(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), warmup=10,
                                  rep=rep)
    return fwd, bwd


def speed(budget_s: float, rep: int):
    impls = {"triton": _triton, "fa2": _sdpa("fa2"), "cudnn": _sdpa("cudnn")}
    rows = []
    for d in (64, 128, 256):
        for s in (1024, 4096, 16384):
            for causal in (False, True):
                if elapsed() > budget_s:
                    log("speed: budget reached, stopping")
                    return rows
                b, h = 16384 // s, 2048 // d
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                row = dict(d=d, s=s, b=b, h=h, causal=causal)
                for name, fn in impls.items():
                    try:
                        f, bw = bench_one(fn, b, s, h, d, causal, rep)
                        row[name] = dict(fwd_ms=f, bwd_ms=bw, fwd_tflops=flops / f * 1e-9,
                                         bwd_tflops=2.5 * flops / bw * 1e-9)
                    except Exception as e:  # noqa: BLE001 - e.g. cuDNN without this head dim
                        row[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    torch.cuda.empty_cache()
                for peer in ("fa2", "cudnn"):
                    if "fwd_ms" in row["triton"] and "fwd_ms" in row[peer]:
                        row[f"fwd_vs_{peer}"] = row[peer]["fwd_ms"] / row["triton"]["fwd_ms"]
                        row[f"bwd_vs_{peer}"] = row[peer]["bwd_ms"] / row["triton"]["bwd_ms"]
                rows.append(row)
                log(_fmt(row))
    return rows


def _fmt(row) -> str:
    def tf(name, key):
        r = row.get(name, {})
        return f"{r[key]:6.1f}" if key in r else "   n/a"
    ratio = lambda k: f"{row[k]:5.2f}" if k in row else "  n/a"  # noqa: E731
    return (f"D={row['d']:3d} S={row['s']:5d} {'causal' if row['causal'] else 'full  '} | fwd TF/s triton "
            f"{tf('triton', 'fwd_tflops')} fa2 {tf('fa2', 'fwd_tflops')} cudnn {tf('cudnn', 'fwd_tflops')} "
            f"x{ratio('fwd_vs_fa2')} x{ratio('fwd_vs_cudnn')} | bwd triton {tf('triton', 'bwd_tflops')} "
            f"fa2 {tf('fa2', 'bwd_tflops')} cudnn {tf('cudnn', 'bwd_tflops')} x{ratio('bwd_vs_fa2')} "
            f"x{ratio('bwd_vs_cudnn')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later parts stop when reached")
    ap.add_argument("--tune", action="store_true", help="time candidate configs and write triton_configs.json")
    ap.add_argument("--tune-causal", action="store_true", help="also tune causal keys (else full stands in)")
    ap.add_argument("--tune-kernels", nargs="*", default=["fwd", "bwd_dkdv", "bwd_dq"], help="kernels to tune")
    ap.add_argument("--tune-budget", type=float, default=None, help="seconds at which tuning stops")
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                  torch=torch.__version__, triton=__import__("triton").__version__)
    log(result)
    path = out_dir / "gpu_triton_check.json"

    def save():
        result["seconds"] = elapsed()
        path.write_text(json.dumps(result, indent=1) + "\n")

    if args.tune:  # first, so that the correctness check runs the tuned configs
        result["tuning"] = tune(out_dir, args.tune_budget or args.budget * 0.5, args.tune_causal,
                                tuple(args.tune_kernels))
        save()
    result["correctness"] = correctness()
    save()
    result["speed"] = speed(args.budget, args.rep)
    save()
    print("\n".join(_fmt(r) for r in result["speed"]))
    log("wrote", path)


if __name__ == "__main__":
    main()

"""One workload cell, taken apart: which plan each of backend=None, backend='triton' and SDPA-cuDNN runs, their GPU
milliseconds and host microseconds, forward and backward, a torch.profiler table of one backward (kernels and their
CUDA time, host ops and their CPU time), and a cProfile of the host side of backend=None's backward.  Made for
PERFLOG row 92 (the workloads suite's SDXL cross-attention: 4096 queries against 77 keys, whose backward read 0.15x
of cuDNN, backend=None's host time twice backend='triton''s on the same kernels).

    PYTHONPATH=. python tools/gpu/probe_cell.py --out $OUT/cell.json            # SDXL's cell (the defaults)
    PYTHONPATH=. python tools/gpu/probe_cell.py --b 1 --sq 8192 --sk 8192 --h 32 --hkv 8 --d 128 --causal
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flashport  # noqa: E402
from flashport import dispatch  # noqa: E402
from flashport.bench.timing import gpu_ms, host_us  # noqa: E402
from flashport.spec import dense_spec  # noqa: E402


def _plan_name(q, k, v, causal: bool, backend):
    spec = dense_spec(q, k, v, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]
    return dispatch.select(spec, backend).name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--sq", type=int, default=4096)
    ap.add_argument("--sk", type=int, default=77)
    ap.add_argument("--h", type=int, default=10)
    ap.add_argument("--hkv", type=int, default=None)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every impl again in later rounds, in reversed order each round (a first-measured "
                         "penalty shows as a difference between rounds, not between impls)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    hkv = a.hkv or a.h
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(a.b, a.sq, a.h, a.d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(a.b, a.sk, hkv, a.d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    do = torch.randn(a.b, a.sq, a.h, a.d, device="cuda", dtype=torch.bfloat16, generator=g)
    result = {"card": torch.cuda.get_device_name(), "shape": vars(a) | {"out": None}, "impls": {}}

    def sdpa():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=a.causal,
                                                                    enable_gqa=hkv != a.h).transpose(1, 2)

    impls = {"backend=None": lambda: flashport.attention(q, k, v, causal=a.causal),
             "backend=triton": lambda: flashport.attention(q, k, v, causal=a.causal, backend="triton"),
             "sdpa-cudnn": sdpa}
    for name, fwd in impls.items():
        out = fwd()
        bwd = lambda out=out: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
        bwd()
        row = {"fwd_ms": gpu_ms(fwd), "fwd_host_us": host_us(fwd), "bwd_ms": gpu_ms(bwd), "bwd_host_us": host_us(bwd)}
        if name != "sdpa-cudnn":
            row["plan"] = _plan_name(q, k, v, a.causal, None if name == "backend=None" else "triton")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                bwd()
            torch.cuda.synchronize()
        row["bwd_profile"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14)
        row["bwd_profile_cpu"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
        if name == "backend=None":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                bwd()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
            row["bwd_cprofile"] = s.getvalue()
        result["impls"][name] = row
        print(f"{name:15} plan={row.get('plan', '-'):14} fwd {row['fwd_ms']:.3f} ms (host {row['fwd_host_us']:.0f} us)"
              f"  bwd {row['bwd_ms']:.3f} ms (host {row['bwd_host_us']:.0f} us)", flush=True)
        print(row["bwd_profile"], flush=True)
    for rnd in range(1, a.rounds):   # the later rounds: timings only, order reversed each time
        for name in (list(impls)[::-1] if rnd % 2 else list(impls)):
            fwd = impls[name]
            out = fwd()
            bwd = lambda out=out: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
            row = {"fwd_ms": gpu_ms(fwd), "fwd_host_us": host_us(fwd), "bwd_ms": gpu_ms(bwd),
                   "bwd_host_us": host_us(bwd)}
            result.setdefault("rounds", []).append({"round": rnd, "impl": name} | row)
            print(f"round {rnd} {name:15} fwd {row['fwd_ms']:.3f} ms (host {row['fwd_host_us']:.0f} us)"
                  f"  bwd {row['bwd_ms']:.3f} ms (host {row['bwd_host_us']:.0f} us)", flush=True)
    if "bwd_cprofile" in result["impls"]["backend=None"]:
        print(result["impls"]["backend=None"]["bwd_cprofile"][:6000])
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""flashport.jax on a CUDA machine: conformance of cudnn, blockwise and xla against the float64 reference
(the tolerance rule, forward + lse + gradients, both half dtypes, on conformance.grid("gpu")), then TFLOP/s
on standard-suite shapes beside the torch frontend's backend=None, in the same process on the same card.
JSON to $OUT/jax_gpu.json.  The timing is flashport/jax/bench.py's, the code behind
`flashport bench --suite standard --frontend jax` (which also writes the harness's JSON + PNG); the conformance
is `flashport check --frontend jax`'s, with xla also run on the long cases here.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python tools/gpu/jax_check.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # torch times on the same card afterwards

import flashport.jax as fj  # noqa: E402
from flashport.bench.shapes import gpu_suite, standard  # noqa: E402
from flashport.check import format_table  # noqa: E402
from flashport.jax import bench as B  # noqa: E402
from flashport.jax import conformance as C  # noqa: E402

BACKENDS = ("cudnn", "blockwise", "xla")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the standard suite's smoke shapes only")
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
                for case in C.grid("gpu"):
                    r = C.check_case(name, case, dtype)
                    results.append(r)
                    print(f"{r.backend:<10} {r.case:<40} {r.status} {r.worst} {r.err:.2e} <= {r.bound:.2e} "
                          f"{r.seconds:.1f}s {r.note[:80]}", flush=True)
        print(format_table(results))
        report["conformance"] = [r.__dict__ for r in results]
        print("conformance:", {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")})

    if not args.no_bench:
        # D 64 / 128, S 1k-8k of the standard suite (quick: its smoke subset)
        shapes = gpu_suite("standard", True) if args.quick else standard(ds=(64, 128), ss=(1024, 2048, 4096, 8192))
        tdev = None if args.no_torch else B._torch_device(B.platform())
        report["bench"] = B.run(shapes, list(BACKENDS), tdev)
        print("\nTFLOP/s by FlashAttention's convention (fwd 4*B*H*S^2*D, halved causal; bwd 2.5x fwd), bf16, "
              "B*S = 16384, H*D = 2048")
        print(B.table(report["bench"]))
    with open(os.path.join(out_dir, "jax_gpu.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    fails = [r for r in report["conformance"] if r["status"] == "FAIL"]
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

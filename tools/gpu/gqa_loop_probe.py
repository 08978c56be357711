"""A/B probe of the Triton dK/dV kernel's GQA schedules (kernels/attn_bwd.py, FLASHPORT_GQA_GROUP_LOOP) on a GPU.

    PYTHONPATH=. python tools/gpu/gqa_loop_probe.py --out $OUT/gqa_loop.json    # H200: < 3 min

For each GQA workload cell (bf16; the Triton backward, not the Gluon one): the whole backward as the library runs it
(attn_bwd.backward: Delta, dK/dV, dQ, and for "partials" the group sum), with
  partials   one program per query head, float32 partial dK / dV summed per group afterwards (the default)
  loop       one program per kv head looping over its group (GROUP_LOOP): at the table's dK/dV config, and at
             the configs the sm_90a compile report gave without spills (tools/gpu/compile_report.py --gqa 4
             --sweep bwd_dkdv with FLASHPORT_GQA_GROUP_LOOP=1)
Each variant's dq / dk / dv are compared with the float32 autograd reference of the same inputs (max |diff| /
max |ref|; bf16 rounding gives ~1e-2) and with the default's; medians of triton.testing.do_bench.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (name, B, S, Hq, Hkv, D, causal, window)
CELLS = [("llama3-8b", 4, 4096, 32, 8, 128, True, None),
         ("mistral-swa", 1, 16384, 32, 8, 128, True, 4096),
         ("gemma2-d256", 2, 4096, 16, 8, 256, True, None),
         ("qwen-gqa7", 2, 4096, 28, 4, 128, True, None),
         ("d64-gqa4", 4, 4096, 32, 8, 64, True, None)]


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cells", default="")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test under TRITON_INTERPRET=1 (tiny shapes, fp16)")
    args = ap.parse_args(argv)
    dev, dt = ("cpu", torch.float16) if args.tiny else ("cuda", torch.bfloat16)
    cells = [(n, 1, 64, hq // 4 or 2, hkv // 4 or 1, 32, c, w and 24) for n, _, _, hq, hkv, _, c, w in CELLS] \
        if args.tiny else CELLS
    from flashport.kernels import attn_bwd, attn_fwd, tuning
    from flashport.spec import dense_spec
    rows = []
    for name, b, s, hq, hkv, d, causal, window in cells:
        if args.cells and name not in args.cells.split(","):
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, s, hq, d, device=dev, dtype=dt, generator=g)
        k = torch.randn(b, s, hkv, d, device=dev, dtype=dt, generator=g)
        v = torch.randn(b, s, hkv, d, device=dev, dtype=dt, generator=g)
        do = torch.randn(b, s, hq, d, device=dev, dtype=dt, generator=g)
        ws = (window - 1, 0) if window else (-1, -1)
        spec, _ = dense_spec(q.requires_grad_(), k, v, causal=causal, softmax_scale=None, window_size=ws, softcap=0.0,
                             alibi_slopes=None, dropout_p=0.0, deterministic=True, return_lse=False)
        q = q.detach()
        out, _, lse2 = attn_fwd.forward(spec, q, k, v)
        ref = None
        if s * s * hq * b <= 2 ** 31:   # float32 autograd reference (materialised scores) where it fits
            qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
            mask = torch.ones(s, s, device=dev, dtype=torch.bool).tril()
            if window:
                mask &= ~torch.ones(s, s, device=dev, dtype=torch.bool).tril(-window)
            kr, vr = (t.repeat_interleave(hq // hkv, 2) for t in (kf, vf))
            sc = torch.einsum("bqhd,bkhd->bhqk", qf, kr) * d ** -0.5
            o = torch.einsum("bhqk,bkhd->bqhd", sc.masked_fill(~mask, float("-inf")).softmax(-1), vr)
            ref = torch.autograd.grad(o, (qf, kf, vf), do.float())
            del sc, o, kr, vr
        base_cfg = tuning.candidates("bwd_dkdv", spec, q.device)[0]
        if args.tiny:
            variants = [("partials", "0", None), ("loop", "1", None)]
        else:
            variants = [("partials", "0", None), ("loop", "1", None),
                    ("loop s2", "1", replace(base_cfg, num_stages=2)),
                    ("loop 32x64 w8 s2", "1", tuning.KernelConfig(32, 64, 8, 2)),
                    ("loop 16x128 w8 s1", "1", tuning.KernelConfig(16, 128, 8, 1)),
                    ("loop 64x32 w8 s3", "1", tuning.KernelConfig(64, 32, 8, 3))]
        base = None
        for vname, flag, cfg in variants:
            os.environ["FLASHPORT_GQA_GROUP_LOOP"] = flag
            configs = {"bwd_dkdv": cfg} if cfg else None
            row = {"cell": name, "B": b, "S": s, "Hq": hq, "Hkv": hkv, "D": d, "causal": causal, "window": window,
                   "variant": vname, "dkdv_config": asdict(cfg or base_cfg)}
            try:
                run = lambda: attn_bwd.backward(spec, do, q, k, v, out, lse2, configs=configs)  # noqa: E731
                grads = run()
                ms = triton.testing.do_bench(run, warmup=5, rep=60, return_mode="median") if dev == "cuda" else 1.0
                flops = 2.5 * 4 * b * hq * s * s * d * (0.5 if causal and not window else 1.0)
                if window:
                    flops = 2.5 * 4 * b * hq * s * min(window, s) * d
                row.update(ms=ms, tflops=flops / ms / 1e9)
                if ref is not None:
                    row["err_vs_fp32"] = [rel(x, r) for x, r in zip(grads, ref)]
                if base is None:
                    base, base_ms = grads, ms
                else:
                    row["diff_vs_partials"] = [rel(x, r) for x, r in zip(grads, base)]
                    row["speedup_vs_partials"] = base_ms / ms
            except Exception as e:  # noqa: BLE001 - a config that fails is recorded, the probe goes on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        os.environ.pop("FLASHPORT_GQA_GROUP_LOOP", None)
    card = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    args.out.write_text(json.dumps({"card": card, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

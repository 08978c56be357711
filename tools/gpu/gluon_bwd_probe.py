"""Probe for the Gluon Hopper attention backward (flashport/kernels/attn_bwd_hopper.py): compile report on a
machine without a GPU, correctness and speed on an H100/H200.

    python tools/gpu/gluon_bwd_probe.py --compile-only [--out r.json]  # no GPU: sm_90a registers/spills/SASS
    PYTHONPATH=. python tools/gpu/gluon_bwd_probe.py --out $OUT/gluon_bwd.json   # H200: check + time (< 5 min)

Every variant runs at each head dim it declares (attn_bwd_hopper.Tiles.head_dims); --library-default
keeps the library's variant per head dim (attn_bwd_hopper.DEFAULT), --head-dims a subset of head dims.

GPU mode, in order (a failing kernel is recorded and the probe goes on):
 1. correctness, every variant of attn_bwd_hopper.VARIANTS at each of its head dims, small shapes (causal and
    not, MHA and GQA, bf16 and fp16): dq / dk / dv against float32 autograd on the same inputs.  Pass iff the
    error is at most 3x the error of the same math done by torch in the input dtype (the conformance rule for
    gradients) plus 1e-3 x the gradient's magnitude (rounding noise), as tests/conformance.py.
 2. timing, bf16, D=128 and D=64: the whole backward as the library runs it (attn_bwd.backward: Delta
    preprocess + this kernel + dQ cast; "flashport_hopper"), the Triton kernels (FLASHPORT_HOPPER_BWD=0;
    "flashport_triton"), each variant's kernel alone (+ its dQ epilogue, Delta precomputed), SDPA cuDNN and
    SDPA flash backward (autograd.grad on a recorded forward).  TFLOP/s with FlashAttention's convention:
    backward FLOPs = 2.5 x 4 B H S^2 D, halved when causal.  Each timing shape also compares the Hopper
    gradients with the Triton ones (max |diff| / max |ref|, expected ~1e-2 at bf16).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "gpu"))

SMEM_LIMIT = 232448    # sm_90's opt-in shared memory per block (227 KiB)


def _spec(q, k, causal, deterministic=False, scale=None):
    from flashport.spec import dense_spec
    spec, _ = dense_spec(q, k, k, causal=causal, softmax_scale=scale, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=deterministic, return_lse=False)
    return spec


# ---------------------------------------------------------------------------------------------- compile-only
def _ptxas_warnings(kernel) -> list:
    """Re-run ptxas on the kernel's PTX to surface its performance warnings (wgmma serialization etc.)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
                           capture_output=True, text=True)
    return [ln.strip() for ln in (r.stdout + r.stderr).splitlines()
            if "arning" in ln or "Performance" in ln or ("spill" in ln and " 0 bytes spill stores" not in ln)]


def _loop_spills(kernel) -> list:
    """[(instructions, LDL, STL)] of each innermost SASS loop that issues HGMMA (the per-Q-tile loops: one
    per consumer warpgroup and loop): spill traffic there is paid on every Q tile, elsewhere once."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, txt in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any(t.startswith("HGMMA") for t in body):
                loops.append((int(m.group(1), 16), addr, body))
    inner = [lp for lp in loops if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    return [(len(b), sum("LDL" in t for t in b), sum("STL" in t for t in b)) for _, _, b in inner]


def compile_only(pairs) -> list:
    """pairs: [(variant, head dim)]."""
    from compile_report import _HopperTarget, report
    from triton.runtime import driver

    from flashport.kernels import attn_bwd_hopper
    driver.set_active(_HopperTarget())
    rows = []
    # (dtype, GQA group, causal, length): 256 = whole tiles; 200 / 300 = ragged (the RAGGED compilation)
    cases = [(torch.bfloat16, 1, False, 256), (torch.bfloat16, 1, True, 256), (torch.bfloat16, 2, False, 256),
             (torch.bfloat16, 2, True, 256), (torch.float16, 1, True, 256), (torch.bfloat16, 2, False, 200),
             (torch.bfloat16, 1, True, 300)]
    for name, d in pairs:
        for dtype, gqa, causal, n in cases:
            q = torch.zeros(1, n, 2 * gqa, d, dtype=dtype)
            k = torch.zeros(1, n, 2, d, dtype=dtype)
            lse = torch.zeros(1, 2 * gqa, n)
            row = {"variant": name, "d": d, "dtype": str(dtype).split(".")[-1], "gqa": gqa, "causal": causal,
                   "ragged": n % attn_bwd_hopper.BLOCK_N != 0}
            try:
                t0 = time.time()
                ck = attn_bwd_hopper.backward(_spec(q, k, causal), q, q, k, k, q, lse, lse, variant=name,
                                              warmup=True)
                r = report(ck)
                row.update(r, compile_s=round(time.time() - t0, 1), ptxas_warnings=_ptxas_warnings(ck),
                           loop_spills=_loop_spills(ck))
            except Exception as e:  # noqa: BLE001 - one variant the compiler rejects must not hide the others
                row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            rows.append(row)
            if "error" in row:
                print(f"{name:7} D={d} {row['dtype']:8} gqa={gqa} causal={causal:d} FAILED {row['error'][:600]}",
                      flush=True)
                continue
            s = row["sass"]
            ok = row["stack_bytes"] == 0 and s["LDL"] + s["STL"] == 0 and row["shared_bytes"] <= SMEM_LIMIT
            print(f"{name:7} D={d} {row['dtype']:8} gqa={gqa} causal={causal:d} S={n} regs={row['registers']} "
                  f"max_reg={row.get('max_register_used')} stack={row['stack_bytes']} LDL/STL={s['LDL']}/{s['STL']} "
                  f"smem={row['shared_bytes']} HGMMA={s['HGMMA']} REDG={s['REDG']} ATOMG={s['ATOMG']} "
                  f"{'clean' if ok else 'NOT CLEAN (spills or smem)'}; per-Q-tile loops (instrs, LDL, STL): "
                  f"{row['loop_spills']}", flush=True)
            for w in row["ptxas_warnings"]:
                print(f"{'':9}ptxas: {w[:200]}")
    return rows


# ---------------------------------------------------------------------------------------------- GPU mode
def _reference(q, k, v, do, causal, scale, dtype):
    """Materialised attention in `dtype` with autograd -> (out, lse, dq, dk, dv); k / v of [B, S, Hkv, D]."""
    g = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.detach().to(dtype).transpose(1, 2).requires_grad_() for t in (q, k, v))
    ke, ve = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = (qf @ ke.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s.float(), -1)
    out = (torch.softmax(s, -1) @ ve)
    dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), do.to(dtype).transpose(1, 2))
    return (out.transpose(1, 2).detach(), lse.detach(), dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2))


def _rel_diffs(grads, ref) -> dict:
    """max |g - r| / max |r| for dq, dk, dv."""
    return {n: ((a.float() - r.float()).abs().max() / r.float().abs().max()).item()
            for n, a, r in zip(("dq", "dk", "dv"), grads, ref)}


def check(pairs, dev) -> list:
    """Every (variant, head dim) pair on every shape (the variants differ in their synchronisation, which every
    shape exercises)."""
    from flashport.kernels import attn_bwd_hopper
    rows = []
    shapes = [(2, 256, 4, 4, False, torch.bfloat16), (2, 512, 4, 2, True, torch.bfloat16),
              (2, 512, 4, 2, False, torch.bfloat16), (2, 256, 4, 4, True, torch.bfloat16),
              (1, 384, 8, 2, True, torch.float16), (2, 512, 4, 4, False, torch.float16),
              (2, 200, 4, 2, False, torch.bfloat16), (3, 300, 4, 4, True, torch.float16)]   # ragged lengths
    for (b, s, hq, hkv, causal, dtype), d in ((shape, d) for d in sorted({d for _, d in pairs}) for shape in shapes):
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, d, device=dev, dtype=dtype)
        k, v = (torch.randn(b, s, hkv, d, device=dev, dtype=dtype) for _ in range(2))
        do = torch.randn(b, s, hq, d, device=dev, dtype=dtype)
        scale = 1 / math.sqrt(d)
        out32, lse32, *g32 = _reference(q, k, v, do, causal, scale, torch.float32)
        _, _, *glow = _reference(q, k, v, do, causal, scale, dtype)
        out = out32.to(dtype).contiguous()
        lse2 = (lse32 / math.log(2)).contiguous()
        delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
        spec = _spec(q, k, causal)
        for name in (n for n, dn in pairs if dn == d):
            row = {"variant": name, "B": b, "S": s, "Hq": hq, "Hkv": hkv, "D": d, "causal": causal,
                   "dtype": str(dtype).split(".")[-1]}
            try:
                got = attn_bwd_hopper.backward(spec, do, q, k, v, out, lse2, delta, variant=name)
                if got is None:
                    raise RuntimeError(f"compile failed: {attn_bwd_hopper.broken}")
                torch.cuda.synchronize()
                ok = True
                for n, x, ref, low in zip(("dq", "dk", "dv"), got, g32, glow):
                    err = (x.float() - ref).abs().max().item()
                    err_low = (low.float() - ref).abs().max().item()
                    bound = 3 * err_low + 1e-3 * ref.abs().max().item()
                    finite = bool(torch.isfinite(x).all())
                    row[n] = {"err": err, "torch_lowprec_err": err_low, "bound": bound, "finite": finite}
                    ok = ok and finite and err <= bound
                row["pass"] = ok
            except Exception as e:  # noqa: BLE001 - record and go on
                row["pass"] = False
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            rows.append(row)
            errs = " ".join(f"{n}={row[n]['err']:.2e}(bound {row[n]['bound']:.2e})" for n in ("dq", "dk", "dv")
                            if n in row)
            print(f"check {name:7} B={b} S={s} H={hq}/{hkv} D={d} causal={causal:d} {row['dtype']:8} "
                  f"{'PASS' if row['pass'] else 'FAIL'} {errs} {row.get('error', '')}", flush=True)
    return rows


def bench(pairs, dev, rep, deadline) -> list:
    rows = []
    shapes = {128: [(4, 4096, 16, 16, False), (4, 4096, 16, 16, True), (1, 16384, 16, 16, False),
                    (1, 16384, 16, 16, True), (1, 8192, 32, 8, True)],
              64: [(16, 1024, 32, 32, False), (4, 4096, 32, 32, False), (4, 4096, 32, 32, True),
                   (1, 16384, 32, 32, False),    # the standard set's heads at D=64
                   (8, 1500, 20, 20, False)]}    # Whisper's encoder: a ragged length (RAGGED)
    for d in sorted({d for _, d in pairs}, reverse=True):
        for b, s, hq, hkv, causal in shapes[d]:
            rows += _bench_shape(b, s, hq, hkv, d, causal, [n for n, dn in pairs if dn == d], dev, rep, deadline)
    return rows


def _bench_shape(b, s, hq, hkv, d, causal, variants, dev, rep, deadline) -> list:
    """One shape: the library's backward, the Triton kernels, each variant's kernel, SDPA cuDNN / flash."""
    from triton.testing import do_bench

    from flashport.kernels import attn_bwd, attn_bwd_hopper, attn_fwd
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    torch.manual_seed(0)
    dtype = torch.bfloat16
    q = torch.randn(b, s, hq, d, device=dev, dtype=dtype)
    k, v = (torch.randn(b, s, hkv, d, device=dev, dtype=dtype) for _ in range(2))
    do = torch.randn(b, s, hq, d, device=dev, dtype=dtype)
    spec = _spec(q, k, causal)
    flops = 2.5 * 4 * b * hq * s * s * d / (2 if causal else 1)
    out, _, lse2 = attn_fwd.forward(spec, q, k, v)
    delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    head = f"B={b} S={s} H={hq}/{hkv} D={d} causal={causal:d}"
    results = {}
    why = attn_bwd_hopper.reasons(spec, q, k, v, do)
    if why:   # flashport_hopper would then time the Triton kernels: say so
        print(f"NOTE  {head}: the Hopper backward declines this call: {why}", flush=True)

    def hopper_full():
        return attn_bwd.backward(spec, do, q, k, v, out, lse2)

    def triton_full():
        with mock.patch.dict(os.environ, {"FLASHPORT_HOPPER_BWD": "0"}):
            return attn_bwd.backward(spec, do, q, k, v, out, lse2)

    cases = [("flashport_hopper", hopper_full), ("flashport_triton", triton_full)]
    cases += [(f"kernel_{n}", (lambda n=n: attn_bwd_hopper.backward(spec, do, q, k, v, out, lse2, delta,
                                                                     variant=n))) for n in variants]
    for label, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa_bwd(backend=backend):
            qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                     enable_gqa=hq != hkv)
            gt = do.transpose(1, 2)
            return lambda: torch.autograd.grad(o, (qt, kt, vt), gt, retain_graph=True)
        cases.append((label, sdpa_bwd))
    for name, fn in cases:
        row = {"impl": name, "B": b, "S": s, "Hq": hq, "Hkv": hkv, "D": d, "causal": causal}
        if name == "flashport_hopper":
            row["declined"] = why
        if name.startswith("kernel_") and time.time() > deadline:
            row["error"] = "skipped: past the probe's time budget (--budget)"
            rows.append(row)
            continue
        try:
            call = fn() if name.startswith("sdpa") else fn
            res = call()
            if name in ("flashport_hopper", "flashport_triton"):
                results[name] = res
            elif name.startswith("kernel_") and "flashport_triton" in results:
                # each variant's gradients at this size too (many Q tiles per program: every barrier phase)
                row["rel_diff_vs_triton"] = _rel_diffs(res, results["flashport_triton"])
            ms = do_bench(call, warmup=10, rep=rep, return_mode="median")
            row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
            del res
        except Exception as e:  # noqa: BLE001 - record and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        tf = f"{row['tflops']:7.1f}" if "tflops" in row else "      -"
        rd = " vs triton " + " ".join(f"{n}={d:.1e}" for n, d in row["rel_diff_vs_triton"].items()) \
            if "rel_diff_vs_triton" in row else ""
        print(f"time  {name:18} {head} ms={row.get('ms', float('nan')):8.3f} TFLOP/s={tf}{rd} "
              f"{row.get('error', '')}", flush=True)
    if len(results) == 2:
        diffs = _rel_diffs(results["flashport_hopper"], results["flashport_triton"])
        rows.append({"impl": "hopper_vs_triton_rel_diff", "B": b, "S": s, "Hq": hq, "Hkv": hkv, "D": d,
                     "causal": causal, **diffs})
        print(f"diff  hopper vs triton {head} " + " ".join(f"{n}={d:.2e}" for n, d in diffs.items()), flush=True)
    by = {r["impl"]: r.get("tflops") for r in rows}
    if by.get("flashport_hopper") and by.get("sdpa_cudnn"):
        print(f"ratio flashport_hopper / sdpa_cudnn {head}: {by['flashport_hopper'] / by['sdpa_cudnn']:.3f} "
              f"(bar 0.85); triton / cudnn: {(by.get('flashport_triton') or 0) / by['sdpa_cudnn']:.3f}", flush=True)
    del q, k, v, do, out, lse2, delta, results
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    from flashport.kernels import attn_bwd_hopper
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a on CPU and report SASS stats")
    ap.add_argument("--variants", nargs="*", default=None,
                    help=f"subset of {list(attn_bwd_hopper.VARIANTS)} (default: all; the library's per head dim: "
                         f"{attn_bwd_hopper.DEFAULT})")
    ap.add_argument("--library-default", action="store_true", help="only the library's variant per head dim")
    ap.add_argument("--head-dims", nargs="*", type=int, default=None, help="subset of the head dims (default: all)")
    ap.add_argument("--budget", type=float, default=200, help="seconds after which per-variant timings are "
                    "skipped (the library path, Triton and SDPA rows always run)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) per timing")
    ap.add_argument("--out", type=Path, help="write the JSON result here")
    args = ap.parse_args(argv)
    result = {"triton": triton.__version__, "torch": torch.__version__, "default_variant": attn_bwd_hopper.DEFAULT}
    # (variant, head dim) pairs, the library's default first at each head dim
    pairs = [(v, d) for d, v in attn_bwd_hopper.DEFAULT.items()]
    if not args.library_default:
        pairs += [(v, d) for v, t in attn_bwd_hopper.VARIANTS.items() for d in t.head_dims]
    pairs = [(v, d) for v, d in dict.fromkeys(pairs) if (args.variants is None or v in args.variants)
             and (args.head_dims is None or d in args.head_dims)]
    if args.compile_only:
        result["compile"] = compile_only(pairs)
    else:
        dev = torch.device("cuda")
        result["device"] = torch.cuda.get_device_name()
        t0 = time.time()
        if not args.skip_check:
            result["check"] = check(pairs, dev)
        result["bench"] = bench(pairs, dev, args.rep, t0 + args.budget)
        result["wall_s"] = time.time() - t0
        passed = [r["pass"] for r in result.get("check", [])]
        print(f"checks passed: {sum(passed)}/{len(passed)}; wall {result['wall_s']:.0f}s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Same-run A/B of the Hopper forward: where should kernels/attn_fwd_hopper.py serve?

In ONE process on an sm_90 GPU, for the standard set's cells (bf16, B*S = 16384, H*D = 2048, i.e.
B = 16384 // S and H = 2048 // D, causal and not; flashport/bench/shapes.standard) it times
  gluon   the Gluon kernel called directly (attn_fwd_hopper.forward: the length floor bypassed),
  triton  flashport's Triton forward forced (FLASHPORT_HOPPER_FWD=0 around the call),
  cudnn   SDPA pinned to cuDNN (torch.nn.attention.sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
  flex    FlexAttention (--flex; it compiles per shape, so it is opt-in),
  gluon-n{BLOCK_N}s{STAGES}r{REGS}[ek]   extra tile-table candidates (--variant D:BLOCK_N:STAGES:REGS[:EARLY_K]),
each kernel replayed from a CUDA graph with L2 flushed per replay (flashport/bench/timing.gpu_graph_ms:
no Python or launcher time; eager do_bench with --timer bench).  Per cell it also checks the Gluon
output and lse against the Triton kernel's (max abs diff) and the output against cuDNN's.  A variant
that fails is recorded with its error and the run goes on; the JSON is rewritten after every cell.

    PYTHONPATH=. python tools/gpu/hopper_fwd_ab.py --out $OUT/hopper_fwd_ab.json --suggest      # H200, < 3 min
    python tools/gpu/hopper_fwd_ab.py --from results/hopper_fwd_ab_h200.json --suggest          # no GPU: re-read

--suggest prints, per (D, causal), the smallest S from which Gluon beats Triton in that cell and every
longer one: the MIN_KEYS / MIN_KEYS_CAUSAL tables of attn_fwd_hopper.  TFLOP/s = 4*B*H*S^2*D / time,
halved for causal (shapes.flops).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashport.bench import peers, shapes  # noqa: E402
from flashport.bench.timing import gpu_graph_ms, gpu_ms  # noqa: E402

SEQS = (512, 1024, 2048, 4096, 8192, 16384)
DIMS = (64, 128, 256)
BASE_IMPLS = ("gluon", "triton", "cudnn")
SWITCH = "FLASHPORT_HOPPER_FWD"
# Agreement a Gluon variant must show with the Triton kernel on the cell's random inputs (bf16 outputs of
# two exact kernels differ by rounding, ~1e-3; lse is float32 either way); a variant off by more counts
# as failed for --suggest whatever its speed.
ATOL_OUT, ATOL_LSE = 2e-2, 1e-3


@contextlib.contextmanager
def _tiles(d: int, tiles):
    """attn_fwd_hopper.TILES[d] = tiles while held (forward reads the table per call)."""
    from flashport.kernels import attn_fwd_hopper
    old = attn_fwd_hopper.TILES[d]
    attn_fwd_hopper.TILES[d] = tiles or old
    try:
        yield
    finally:
        attn_fwd_hopper.TILES[d] = old


def parse_variant(text: str):
    """'D:BLOCK_N:STAGES:REGS[:EARLY_K]' (EARLY_K 0 or 1, default 0) -> (D, Tiles); a head dim that runs as two
    column parts keeps the table's split."""
    from flashport.kernels.attn_fwd_hopper import TILES, Tiles
    try:
        d, n, st, regs, *early = (int(x) for x in text.split(":"))
        if len(early) > 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"--variant wants D:BLOCK_N:STAGES:REGS[:EARLY_K], got {text!r}") from None
    return d, Tiles(n, st, regs, bool(early and early[0]), TILES[d].split if d in TILES else 0)


def variant_name(tiles) -> str:
    return f"gluon-n{tiles.block_n}s{tiles.stages}r{tiles.consumer_regs}{'ek' if tiles.early_k else ''}"


def make_fn(impl: str, shape, spec, q, k, v, tiles=None):
    """fn() -> (out [B, S, H, D], lse [B, H, S] or None) for one implementation."""
    from flashport.kernels import attn_fwd, attn_fwd_hopper
    if impl == "gluon" or impl.startswith("gluon-"):
        def gluon():
            with _tiles(shape.d, tiles):
                r = attn_fwd_hopper.forward(spec, q, k, v)
            if r is None:
                raise RuntimeError("failed to compile: " + attn_fwd_hopper.broken.get(
                    attn_fwd_hopper.variant_key(spec), "?"))
            return r[0], r[1]
        return gluon
    if impl == "triton":
        def triton():
            with mock.patch.dict(os.environ, {SWITCH: "0"}):
                out, lse, _ = attn_fwd.forward(spec, q, k, v)
            return out, lse
        return triton
    peer = peers.dense_fn({"cudnn": "sdpa-cudnn", "flex": "flex"}[impl], shape, q, k, v)
    return lambda: (peer(), None)


def _context(impl: str):
    return peers.context({"cudnn": "sdpa-cudnn"}.get(impl, impl))


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def run_cell(shape, impls: dict, timer: str) -> dict:
    """Check and time every implementation on one shape -> the cell's record."""
    from flashport.kernels import attn_fwd_hopper
    from flashport.spec import dense_spec
    q, k, v = peers.make_inputs(shape, "cuda", requires_grad=False)
    spec, _ = dense_spec(q, k, v, causal=shape.causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    cell = {"d": shape.d, "s": shape.sq, "b": shape.b, "h": shape.hq, "causal": shape.causal,
            "gflop": shapes.flops(shape, "fwd") / 1e9, "impls": {}, "check": {},
            "gate": attn_fwd_hopper.reasons(spec, q, k, v) or "serves",
            "kernel_needs": attn_fwd_hopper.reasons(spec, q, k, v, length_floor=False) or "ok"}
    results = {}
    for impl, tiles in impls.items():
        rec = cell["impls"][impl] = {}
        if impl.startswith("gluon") and cell["kernel_needs"] != "ok":
            rec["error"] = "declined: " + "; ".join(cell["kernel_needs"])
            continue
        try:
            with _context(impl):
                fn = make_fn(impl, shape, spec, q, k, v, tiles)
                out, lse = fn()                      # first call: compiles; its result is the check
                torch.cuda.synchronize()
                results[impl] = (out.float(), lse)
                if timer == "graph":
                    ms, fallback = gpu_graph_ms(fn)
                    rec["timer"] = fallback or "graph"
                else:
                    ms, rec["timer"] = gpu_ms(fn), "do_bench"
            rec["ms"] = ms
            rec["tflops"] = cell["gflop"] / ms if ms > 0 else None   # GFLOP per ms = TFLOP/s
        except Exception as e:  # noqa: BLE001 - a failed variant is recorded, the run goes on
            rec["error"] = _err(e)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
    ref = results.get("triton")
    for impl, (out, lse) in results.items():
        if not impl.startswith("gluon"):
            continue
        if ref is not None:
            d_out = cell["check"][f"{impl}_vs_triton_out"] = (out - ref[0]).abs().max().item()
            d_lse = cell["check"][f"{impl}_vs_triton_lse"] = (lse - ref[1]).abs().max().item()
            if not (d_out <= ATOL_OUT and d_lse <= ATOL_LSE):      # NaN fails too
                cell["impls"][impl]["mismatch"] = f"max |out - triton| {d_out:.3g}, |lse - triton| {d_lse:.3g}"
        if "cudnn" in results:
            cell["check"][f"{impl}_vs_cudnn_out"] = (out - results["cudnn"][0]).abs().max().item()
    del q, k, v, results
    torch.cuda.empty_cache()
    return cell


def suggest(cells: list[dict], impl: str = "gluon", base: str = "triton", margin: float = 0.0) -> dict:
    """{(d, causal): smallest S from which `impl` beats `base` (ms * (1 + margin) < base ms) in that cell
    and every longer one, or None (it loses the longest cell, or a cell failed or disagreed with base)}."""
    out = {}
    for key in sorted({(c["d"], c["causal"]) for c in cells}):
        floor = None
        for c in sorted((c for c in cells if (c["d"], c["causal"]) == key), key=lambda c: -c["s"]):
            a, b = c["impls"].get(impl, {}).get("ms"), c["impls"].get(base, {}).get("ms")
            if a is None or b is None or a * (1 + margin) >= b or "mismatch" in c["impls"][impl]:
                break
            floor = c["s"]
        out[key] = floor
    return out


def print_table(cells: list[dict], impls) -> None:
    """TFLOP/s per implementation, then time ratios (> 1: the first is faster) against the Triton kernel
    and cuDNN, the Gluon-vs-Triton max |out| difference and whether the shipped gate serves the cell."""
    ratios = [(i, "triton") for i in impls if i.startswith("gluon")] + [("gluon", "cudnn"), ("triton", "cudnn")]
    names = [f"{a.replace('gluon', 'gl').replace('triton', 'tri')}/{b[:3]}" for a, b in ratios]
    wide = {i: max(6, len(i)) for i in list(impls) + names}

    def ratio(c, a, b):
        x, y = c["impls"].get(a, {}).get("ms"), c["impls"].get(b, {}).get("ms")
        return f"{y / x:.2f}" if x and y else "-"
    print("TFLOP/s (kernels replayed from CUDA graphs unless the JSON's timer says otherwise), time ratios")
    print(f"{'D':>3} {'S':>5} {'B':>2} {'H':>2} {'mask':6} " + " ".join(f"{i:>{wide[i]}}" for i in impls) + " "
          + " ".join(f"{n:>{wide[n]}}" for n in names) + f" {'|dO| gl-tri':>11} {'gate':>4}")
    for c in cells:
        row = f"{c['d']:>3} {c['s']:>5} {c['b']:>2} {c['h']:>2} {'causal' if c['causal'] else 'full':6} "
        row += " ".join(f"{c['impls'][i]['tflops']:>{wide[i]}.0f}" if c["impls"].get(i, {}).get("tflops")
                        else f"{'ERR' if i in c['impls'] else '-':>{wide[i]}}" for i in impls)
        row += " " + " ".join(f"{ratio(c, a, b):>{wide[n]}}" for (a, b), n in zip(ratios, names))
        diff = c["check"].get("gluon_vs_triton_out")
        row += f" {diff:>11.2e}" if diff is not None else f" {'-':>11}"
        print(row + f" {'yes' if c['gate'] == 'serves' else 'no':>4}")
    for c in cells:
        for i, r in c["impls"].items():
            for problem in ("error", "mismatch"):
                if problem in r:
                    print(f"  D={c['d']} S={c['s']} {'causal' if c['causal'] else 'full'} {i} {problem.upper()}: "
                          f"{r[problem]}")


def print_suggestion(cells: list[dict], margin: float) -> None:
    from flashport.kernels import attn_fwd_hopper as h
    floors = suggest(cells, margin=margin)
    print(f"\nsuggested floors (Gluon faster than Triton{f' by > {margin:.0%}' if margin else ''} from this S up; "
          "None: not served at that D) vs shipped:")
    for causal, name, shipped in ((False, "MIN_KEYS", h.MIN_KEYS), (True, "MIN_KEYS_CAUSAL", h.MIN_KEYS_CAUSAL)):
        got = {d: floors[(d, c)] for d, c in floors if c == causal}
        print(f"  {name} = {got}   # shipped {shipped}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="JSON to write (rewritten after every cell)")
    ap.add_argument("--d", type=int, nargs="+", default=list(DIMS))
    ap.add_argument("--s", type=int, nargs="+", default=list(SEQS))
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention (compiles per shape: slower)")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    metavar="D:BLOCK_N:STAGES:REGS[:EARLY_K]",
                    help="also time the Gluon kernel with this tile-table entry at head dim D (repeatable)")
    ap.add_argument("--timer", choices=("graph", "bench"), default="graph")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop starting new cells after this long")
    ap.add_argument("--suggest", action="store_true", help="print the length floors the run supports")
    ap.add_argument("--margin", type=float, default=0.0, help="--suggest: Gluon must be faster by this fraction")
    ap.add_argument("--from", dest="src", type=Path, help="re-read a previous run's JSON instead of measuring")
    args = ap.parse_args(argv)

    if args.src:
        doc = json.loads(args.src.read_text())
        print_table(doc["cells"], doc["impls"])
        if args.suggest:
            print_suggestion(doc["cells"], args.margin)
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --from a previous run's JSON)", file=sys.stderr)
        return 2

    import triton
    t0 = time.perf_counter()
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    cells_todo = shapes.standard(ds=tuple(args.d), ss=tuple(args.s), causals=causals)
    doc = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "torch": torch.__version__, "triton": triton.__version__, "timer": args.timer, "cells": [],
           "skipped": []}
    try:
        from flashport.kernels import attn_fwd_hopper as h
        doc.update(tiles={d: list(t) for d, t in h.TILES.items()}, min_keys=h.MIN_KEYS,
                   min_keys_causal=h.MIN_KEYS_CAUSAL)
    except Exception as e:  # noqa: BLE001 - recorded; the gluon cells will say why they fail
        doc["import_error"] = _err(e)
    base = dict.fromkeys(BASE_IMPLS + (("flex",) if args.flex else ()))
    extra = {variant_name(t): (d, t) for d, t in args.variant}
    doc["impls"] = list(base) + list(extra)
    for shape in cells_todo:
        if time.perf_counter() - t0 > args.budget_s:
            doc["skipped"].append(shape.label())
            continue
        impls = dict(base, **{n: t for n, (d, t) in extra.items() if d == shape.d})
        try:
            cell = run_cell(shape, impls, args.timer)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory making the inputs
            cell = {"d": shape.d, "s": shape.sq, "b": shape.b, "h": shape.hq, "causal": shape.causal, "impls": {},
                    "check": {}, "gate": "?", "error": _err(e)}
        doc["cells"].append(cell)
        done = " ".join(f"{i}={r['tflops']:.0f}" if r.get("tflops") else f"{i}=ERR" for i, r in cell["impls"].items())
        print(f"[{time.perf_counter() - t0:6.1f}s] {shape.label()}: {done}", flush=True)
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print()
    print_table(doc["cells"], doc["impls"])
    if doc["skipped"]:
        print(f"skipped (--budget-s {args.budget_s:.0f} spent): {', '.join(doc['skipped'])}")
    if args.suggest:
        print_suggestion(doc["cells"], args.margin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compile flashport's attention kernels for Hopper (sm_90a) on a machine without a GPU and report
what the compiler made of them: registers, spills (local memory), shared memory, and the SASS
instructions that matter (HGMMA = Hopper tensor-core MMA; HMMA = the older, slower path;
LDL/STL = spill traffic; REDG/ATOMG = global atomics).

    python tools/gpu/compile_report.py                      # default configs, D in {64, 128, 256}
    python tools/gpu/compile_report.py --d 128 --json out.json
    python tools/gpu/compile_report.py --d --hopper-fwd     # only the Gluon Hopper forward, D in {64, 128, 256}
    python tools/gpu/compile_report.py --d 64 --mods         # with compiled mods and a block mask (issue [15])
    python tools/gpu/compile_report.py --d --merge          # only the merge's forward and backward kernels
    python tools/gpu/compile_report.py --d --hopper-bwd     # only the Gluon Hopper backward: no mask, causal, window

How: Triton compiles ahead of time through `JITFunction.warmup`; a stand-in driver names the target
(GPUTarget("cuda", 90, 32)), and kernel launches are turned into warmups, so the real host launchers
(kernels/attn_fwd.forward, attn_bwd.backward) run unchanged on small CPU tensors and every kernel they
would launch is compiled instead; --hopper-fwd adds the Gluon forward (kernels/attn_fwd_hopper.py) for
each head dim of its tile table, causal and not.  With setmaxnreg (warp specialization) the REG count is
only the launch allocation: "used" is the highest register the SASS touches, which must stay within the
consumers' setmaxnreg count.  cuobjdump (bundled with Triton) reads the cubins.  Nothing runs.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SASS_OPS = ("HGMMA", "HMMA", "LDL", "STL", "REDG", "ATOMG", "MUFU", "LDGSTS", "UTMALDG", "BAR")


class _HopperTarget:
    """The parts of Triton's driver interface that compilation asks for."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


_compiled: list = []


def _warmup_only(self, grid):
    def launch(*args, **kwargs):
        _compiled.append((self.fn.__name__, kwargs, self.run(*args, grid=grid, warmup=True, **kwargs)))
    return launch


def report(kernel) -> dict:
    """Resource usage and SASS instruction counts of one CompiledKernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        res = subprocess.run([str(CUOBJDUMP), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], capture_output=True, text=True).stdout
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    instructions = sass_instructions(sass)
    ops = Counter(op for op, _ in instructions)
    counts = {op: sum(n for name, n in ops.items() if name == op or name.startswith(op + ".")) for op in SASS_OPS}
    gmma = sorted({name for name in ops if name.startswith("HGMMA")})
    # Registers a warp really touches: with setmaxnreg (warp-specialized kernels) REG is only the launch
    # allocation, and the consumer partitions may grow past it up to their setmaxnreg count.
    live = max((int(n) for n in re.findall(r"\bR(\d+)\b", sass)), default=-1) + 1
    return {"registers": int(usage.get("REG", 0)), "stack_bytes": int(usage.get("STACK", 0)),
            "local_bytes": int(usage.get("LOCAL", 0)), "shared_bytes": kernel.metadata.shared,
            "max_register_used": live,
            "sass": counts, "hgmma_shapes": gmma, "sass_ops": dict(sorted(ops.items())),
            "ex2_between_waits": ex2_between_waits(instructions)}


def sass_instructions(sass: str) -> list:
    """(opcode, operands) of each instruction of a cuobjdump -sass listing, in program order (predicates dropped)."""
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;\n]*);", sass)


def ex2_between_waits(instructions: list) -> list:
    """MUFU.EX2 between each partial wgmma wait (WARPGROUP.DEPBAR.LE gsb0, 0x1 or more: S_j retired, P V still
    running) and the full wait that follows it (0x0): the softmax work the Gluon forward overlaps with its P V
    matmul (PERFLOG row 87).  One count per such pair, in program order."""
    counts, open_ = [], None
    for op, rest in instructions:
        if op.startswith("WARPGROUP.DEPBAR"):
            if rest.strip().endswith("0x0"):
                if open_ is not None:
                    counts.append(open_)
                open_ = None
            else:
                open_ = 0
        elif op == "MUFU.EX2" and open_ is not None:
            open_ += 1
    return counts


def compile_case(d: int, causal: bool, dtype=torch.bfloat16, gqa: int = 1, configs: dict | None = None) -> list:
    """Compile the forward and backward kernels for one head dim; returns report rows."""
    from flashport.kernels import attn_bwd, attn_fwd, tuning
    from flashport.spec import dense_spec

    b, s, hkv = 1, 256, 2
    q = torch.randn(b, s, hkv * gqa, d, dtype=dtype)
    k, v = (torch.randn(b, s, hkv, d, dtype=dtype) for _ in range(2))
    spec, _ = dense_spec(q, k, v, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    bucket = tuning.head_bucket(spec)
    cfg = {kn: (configs or {}).get(kn) or _table_or_default(kn, bucket, spec) for kn in tuning.KERNELS}
    _compiled.clear()
    out = torch.empty(b, s, hkv * gqa, d, dtype=dtype)
    attn_fwd.forward(spec, q, k, v, config=cfg["fwd"])
    attn_bwd.backward(spec, torch.randn_like(out), q, k, v, out, torch.zeros(b, hkv * gqa, s), configs=cfg)
    names = {"_attn_fwd": "fwd", "_bwd_dkdv": "bwd_dkdv", "_bwd_dq": "bwd_dq", "_bwd_preprocess": "preprocess"}
    rows = []
    for name, _, ck in _compiled:
        kn = names.get(name, name)
        c = cfg.get(kn)
        rows.append({"kernel": kn, "d": d, "causal": causal, "gqa": gqa, "dtype": str(dtype).split(".")[-1],
                     "config": None if c is None else asdict(c), **report(ck)})
    return rows


def compile_mods_case(d: int, block_mask: bool = True, dtype=torch.bfloat16) -> list:
    """compile_case for a programmable call: a learnable relative-position score_mod (3 captured tensors, the table's
    gradient summed per diagonal: common.add_reduced) and the block mask of
    a causal document mask_mod (its empty tiles skipped; block_mask False: the mask_mod alone), compiled by
    kernels/mod_codegen.py; rows carry "mods": "block_mask" or "mask_mod"."""
    from flashport import create_block_mask, mods
    from flashport.backend.triton import visible_mask
    from flashport.kernels import attn_bwd, attn_fwd, tuning
    from flashport.kernels.mod_codegen import compile_mods
    from flashport.spec import dense_spec

    b, s, h = 1, 256, 2
    q, k, v = (torch.randn(b, s, h, d, dtype=dtype) for _ in range(3))
    docs = mods.document(torch.arange(s) // 100)    # causal documents
    bm = create_block_mask(docs, None, None, s, s, block_size=128) if block_mask else None
    spec, inputs = dense_spec(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False,
                              score_mod=mods.relative_position(torch.randn(h, 9, requires_grad=True)), block_mask=bm,
                              mask_mod=None if block_mask else docs)
    compiled = compile_mods(inputs.prog.score_mod, visible_mask(inputs.prog), "cpu",
                            grads_for=inputs.prog.differentiable)
    if isinstance(compiled, str):
        raise RuntimeError(compiled)
    cfg = {kn: _table_or_default(kn, tuning.head_bucket(spec), spec) for kn in tuning.KERNELS}
    _compiled.clear()
    out = torch.empty(b, s, h, d, dtype=dtype)
    attn_fwd.forward(spec, q, k, v, config=cfg["fwd"], mods=compiled, block_mask=bm)
    attn_bwd.backward(spec, torch.randn_like(out), q, k, v, out, torch.zeros(b, h, s), configs=cfg, mods=compiled,
                      block_mask=bm)
    names = {"_attn_fwd": "fwd", "_bwd_dkdv": "bwd_dkdv", "_bwd_dq": "bwd_dq", "_bwd_preprocess": "preprocess"}
    return [{"kernel": names.get(n, n), "d": d, "causal": False, "gqa": 1, "dtype": str(dtype).split(".")[-1],
             "mods": "block_mask" if block_mask else "mask_mod", "config": {"block_m": kw.get("BLOCK_M"), "block_n": kw.get("BLOCK_N"),
                                      "num_warps": kw.get("num_warps"), "num_stages": kw.get("num_stages")},
             **report(ck)} for n, kw, ck in _compiled]


def compile_hopper_fwd(gqa: int = 2, ds=None, dtypes=(torch.bfloat16,)) -> list:
    """Compile the Gluon Hopper forward (kernels/attn_fwd_hopper.py) for each head dim it serves (default:
    all of attn_fwd_hopper.TILES), no mask, causal, a window and causal with ALiBi, per dtype.  A variant the compiler rejects is reported
    with its error (the row's "error"), not fatal."""
    from flashport.kernels import attn_fwd_hopper
    from flashport.spec import dense_spec
    rows = []
    for d in ds or sorted(attn_fwd_hopper.TILES):
        tiles = attn_fwd_hopper.TILES[d]
        for dtype in dtypes:
            variants = ((False, (-1, -1)), (True, (-1, -1)), ("window", (100, 0)), ("alibi", (-1, -1)))
            for causal, window in variants[:4 if d in attn_fwd_hopper.ALIBI_HEAD_DIMS else 3]:
                q = torch.zeros(1, 256, 2 * gqa, d, dtype=dtype)
                k = torch.zeros(1, 256, 2, d, dtype=dtype)
                slopes = torch.ones(2 * gqa) if causal == "alibi" else None     # ALiBi on the causal variant
                spec, _ = dense_spec(q, k, k, causal=causal in (True, "alibi"), softmax_scale=None, window_size=window,
                                     softcap=0.0, alibi_slopes=slopes, dropout_p=0.0, deterministic=False,
                                     return_lse=False)
                row = {"kernel": "fwd_hopper", "d": d, "causal": causal, "gqa": gqa, "dtype": str(dtype).split(".")[-1],
                       "config": {"block_m": attn_fwd_hopper.TILE, "block_n": tiles.block_n, "num_warps": 12,
                                  "num_stages": tiles.stages, "consumer_regs": tiles.consumer_regs,
                                  "early_k": tiles.early_k}}
                try:
                    rows.append({**row, **report(attn_fwd_hopper.forward(spec, q, k, k, warmup=True, alibi=slopes))})
                except Exception as e:  # noqa: BLE001 - a variant the compiler rejects is reported, not fatal
                    rows.append({**row, "error": f"{type(e).__name__}: {e}"[:500]})
    return rows


def compile_hopper_bwd(gqa: int = 2, ds=None, dtypes=(torch.bfloat16,), variant: str | None = None) -> list:
    """Compile the Gluon Hopper backward (kernels/attn_bwd_hopper.py) for each head dim it serves (default: its
    DEFAULT table), with no mask, causal, a sliding window (left 64, right 0) and causal with ALiBi, per dtype;
    variant: a VARIANTS name instead of DEFAULT's (for the head dims it lists)."""
    from flashport.kernels import attn_bwd_hopper
    from flashport.spec import dense_spec
    rows = []
    for d in ds or sorted(attn_bwd_hopper.DEFAULT):
        name = variant or attn_bwd_hopper.DEFAULT[d]
        tiles = attn_bwd_hopper.VARIANTS[name]
        if d not in tiles.head_dims:
            continue
        for dtype in dtypes:
            for mask, kw in (("none", {}), ("causal", dict(causal=True)), ("window", dict(window_size=(64, 0))),
                             ("alibi", dict(causal=True, alibi_slopes=torch.ones(2 * gqa)))):
                q = torch.zeros(1, 256, 2 * gqa, d, dtype=dtype)
                k = torch.zeros(1, 256, 2, d, dtype=dtype)
                spec, _ = dense_spec(q, k, k, **{**dict(causal=False, softmax_scale=None, window_size=(-1, -1),
                                                        softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                                                        deterministic=False, return_lse=False), **kw})
                row = {"kernel": "bwd_hopper", "d": d, "causal": mask, "gqa": gqa, "dtype": str(dtype).split(".")[-1],
                       "config": {"block_m": tiles.block_m, "block_n": attn_bwd_hopper.BLOCK_N,
                                  "num_warps": 12, "num_stages": tiles.stages}}
                lse2 = torch.zeros(1, 2 * gqa, 256)
                try:
                    rows.append({**row, **report(attn_bwd_hopper.backward(spec, q, q, k, k, None, lse2, lse2,
                                                                          variant=name, warmup=True,
                                                                          alibi=kw.get("alibi_slopes")))})
                except Exception as e:  # noqa: BLE001 - a variant the compiler rejects is reported, not fatal
                    rows.append({**row, "error": f"{type(e).__name__}: {e}"[:500]})
    return rows


def sweep_grid(kernel: str, d: int) -> list:
    """Tile configs worth compiling for one kernel and head dim (shared memory estimate within sm_90's limit)."""
    from flashport.kernels import tuning
    from flashport.kernels.common import block_dim
    bd = block_dim(d)
    grid = [tuning.KernelConfig(m, n, w, st) for m in (16, 32, 64, 128) for n in (32, 64, 128)
            for w in (4, 8) for st in (1, 2, 3)]
    return [c for c in grid if tuning.smem_estimate(kernel, c, bd, bd, 2) <= tuning.SMEM_OPTIN[(9, 0)]]


def compile_merge_case(dv: int = 128, dtype=torch.bfloat16) -> list:
    """The merge's forward and backward kernels (kernels/merge.py): 2 parts (the window + sinks rewrite) and 9 read
    two at a time (the two-pass path)."""
    from flashport.kernels.merge import merge_backward_triton, merge_states_triton
    rows = []
    for parts, tile in ((2, None), (9, 2 * dv)):
        outs = [torch.randn(1, 4, 8, dv, dtype=dtype) for _ in range(parts)]
        lses = [torch.randn(1, 8, 4) for _ in range(parts)]
        _compiled.clear()
        out, lse = merge_states_triton(outs, lses)
        kw = {} if tile is None else {"tile_elems": tile}
        merge_backward_triton(outs, lses, lse, out, torch.zeros_like(lse), **kw)
        rows += [dict(kernel=name.removeprefix("_").removesuffix("_kernel"), d=dv, config={}, dtype=str(dtype),
                      mods=f"{parts} parts", **report(k)) for name, _, k in _compiled]
    return rows


def _table_or_default(kernel, bucket, spec):
    from flashport.kernels import tuning
    tuned = [tuning.TABLE[k] for k in tuning.spec_keys("NVIDIA H200", kernel, spec) if k in tuning.TABLE]
    return (tuned or tuning.default_configs(kernel, bucket, spec.dtype))[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--gqa", type=int, default=1)
    ap.add_argument("--sweep", metavar="KERNEL", help="compile every tile config of a grid for this kernel "
                    "(fwd, bwd_dkdv, bwd_dq) instead of the table's choice")
    ap.add_argument("--hopper-fwd", action="store_true", help="also compile the Gluon Hopper forward (every head "
                    "dim it serves, or only those of --d that it serves; bf16 and fp16, causal and not)")
    ap.add_argument("--hopper-dtype", choices=("bf16", "fp16", "both"), default="both",
                    help="--hopper-fwd: which dtypes to compile")
    ap.add_argument("--mods", action="store_true", help="also compile a programmable call's kernels (compiled "
                    "score_mod, mask_mod and a block mask) for each --d")
    ap.add_argument("--merge", action="store_true", help="also compile the merge's forward and backward kernels")
    ap.add_argument("--hopper-bwd", action="store_true", help="also compile the Gluon Hopper backward (its head "
                    "dims among --d, or all; no mask, causal and a window)")
    ap.add_argument("--hopper-bwd-variant", metavar="NAME", help="--hopper-bwd: this VARIANTS entry of "
                    "kernels/attn_bwd_hopper.py instead of its DEFAULT (the head dims it lists)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    driver.set_active(_HopperTarget())
    JITFunction.__getitem__ = _warmup_only
    rows = []
    for d in args.d:
        if args.sweep:
            for cfg in sweep_grid(args.sweep, d):
                try:
                    rows += [r for r in compile_case(d, args.causal, gqa=args.gqa, configs={args.sweep: cfg})
                             if r["kernel"] == args.sweep]
                except Exception as e:  # noqa: BLE001 - a config the compiler rejects is reported, not fatal
                    print(f"{args.sweep} D={d} {cfg}: {type(e).__name__}: {str(e)[:120]}")
        else:
            rows += compile_case(d, args.causal, gqa=args.gqa)
    if args.mods:
        for d in args.d:
            rows += compile_mods_case(d, block_mask=False) + compile_mods_case(d, block_mask=True)
    if args.merge:
        rows += compile_merge_case()
    if args.hopper_fwd:
        from flashport.kernels.attn_fwd_hopper import TILES
        ds = [d for d in args.d if d in TILES] or None    # none of --d served (`--d` with no value): all
        dtypes = {"bf16": (torch.bfloat16,), "fp16": (torch.float16,), "both": (torch.bfloat16, torch.float16)}
        rows += compile_hopper_fwd(max(args.gqa, 1), ds, dtypes[args.hopper_dtype])
    if args.hopper_bwd:
        from flashport.kernels.attn_bwd_hopper import DEFAULT
        ds = [d for d in args.d if d in DEFAULT] or None
        dtypes = {"bf16": (torch.bfloat16,), "fp16": (torch.float16,), "both": (torch.bfloat16, torch.float16)}
        rows += compile_hopper_bwd(max(args.gqa, 1), ds, dtypes[args.hopper_dtype], args.hopper_bwd_variant)
    print(f"{'kernel':11} {'D':>4} {'config':28} {'regs':>4} {'used':>4} {'spill':>5} {'smem':>6} {'HGMMA':>5} "
          f"{'HMMA':>4} {'LDL/STL':>7} {'RED/ATOM':>8}")
    for r in rows:
        c = r["config"] or {}
        cs = f"{c.get('block_m')}x{c.get('block_n')} w{c.get('num_warps')} s{c.get('num_stages')}" if c else "-"
        if r["kernel"] == "fwd_hopper":
            cs += f"{' ek' if c['early_k'] else ''} {'bf16' if r['dtype'] == 'bfloat16' else 'fp16'}"
            cs += {True: " causal", "window": " window", "alibi": " causal alibi"}.get(r["causal"], "")
        if r["kernel"] == "bwd_hopper":
            cs += f" {'bf16' if r['dtype'] == 'bfloat16' else 'fp16'} {r['causal']}"
        if r.get("mods"):
            cs += f" {r['mods']}"
        if "error" in r:
            print(f"{r['kernel']:11} {r['d']:>4} {cs:28} FAILED {r['error'][:200]}")
            continue
        s = r["sass"]
        print(f"{r['kernel']:11} {r['d']:>4} {cs:28} {r['registers']:>4} {r['max_register_used']:>4} "
              f"{r['stack_bytes']:>5} {r['shared_bytes']:>6} {s['HGMMA']:>5} {s['HMMA']:>4} {s['LDL'] + s['STL']:>7} "
              f"{s['REDG'] + s['ATOMG']:>8}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measurement-only probe: can a hand-scheduled Hopper attention forward written in Gluon beat our Triton one?

The record of the experiment behind docs/PERFLOG.md row 15: it keeps the whole variant space (overlap off /
on / with a block boundary, BLOCK_N, stages).  The winner, gluon_n128_s3_ov, lives on with causal masking,
GQA and lse2 in flashport/kernels/attn_fwd_hopper.py, so the two share their kernel skeleton on purpose.

    PYTHONPATH=. python3 tools/gpu/gluon_fwd_probe.py --out $OUT/gluon_fwd.json   # H200: check + time
    python3 tools/gpu/gluon_fwd_probe.py --compile-only                          # no GPU: sm_90a compile report

The kernel (non-causal, bf16, D=128, q/k/v/o [B, S, H, D] contiguous, S % 128 == 0) follows FlashAttention-3:
  * warp specialization: the default partition (4 warps) is the producer, it issues TMA loads of the Q tile once
    and of K_j / V_j into a STAGES-deep shared-memory ring; two consumer warpgroups (4 warps, 240 registers
    each) own 64 query rows apiece of the CTA's 128-row Q tile.
  * barriers: q_ready; k_ready[s] / v_ready[s] (TMA transaction counts, so QK_j can start before V_j lands);
    kv_empty[s] (count 2: one arrive per consumer warpgroup once its PV of that stage has retired).
  * OVERLAP=0: per tile S = Q K_j^T, wait, softmax, acc *= alpha, acc += P V_j, wait  (what Triton emits).
    OVERLAP=1 (FA3 intra-warpgroup overlap): issue S_j = Q K_j^T, rescale acc, issue acc += P_{j-1} V_{j-1}, wait
    for S_j only (num_outstanding=1, the PV stays in flight), softmax of S_j on the CUDA cores, wait for the PV,
    pack P_j.  Only retired tensors cross the loop edge.  OVERLAP=2 adds a basic-block boundary before the PV wait
    because ptxas otherwise hoists that wait right after the row max (see _overlap_step; check with --compile-only).
Online softmax in the log2 domain: m_i tracks rowmax(S) * qk_scale with qk_scale = softmax_scale * log2(e),
p = exp2(S * qk_scale - m_i); lse = (m_i + log2(l_i)) * ln(2).
Equivalent PyTorch: torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), ...).transpose(1, 2).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flashport.kernels.attn_fwd_hopper import _descriptor  # noqa: E402

LOG2E = 1.4426950408889634
HEAD_DIM = 128
BLOCK_M = 64           # query rows per consumer warpgroup; the CTA tile is 2 * BLOCK_M
NUM_CONSUMERS = 2
CONSUMER_REGS = 240    # setmaxnreg for the consumer warpgroups (FA3 uses 240 for D=128)
# (name, BLOCK_N, STAGES, OVERLAP); BLOCK_N=128 x 3 stages = 224 KiB smem, just under sm_90's 227 KiB opt-in
# OVERLAP: 0 = none, 1 = FA3 overlap as written, 2 = FA3 overlap + block boundary before the PV wait (_overlap_step)
VARIANTS = [("gluon_n128_s2", 128, 2, 0), ("gluon_n128_s2_ov", 128, 2, 1), ("gluon_n128_s2_ovbb", 128, 2, 2),
            ("gluon_n64_s3", 64, 3, 0), ("gluon_n64_s3_ovbb", 64, 3, 2),
            ("gluon_n128_s3", 128, 3, 0), ("gluon_n128_s3_ov", 128, 3, 1), ("gluon_n128_s3_ovbb", 128, 3, 2)]


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
              seqlen, num_heads, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA issue: Q once, then K_j / V_j into stage j % STAGES once both consumers released it."""
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // num_heads
    col = (pid_bh % num_heads) * q_desc.block_type.shape[1]
    row_kv = b * seqlen
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row_kv + pid_m * q_desc.block_type.shape[0], col], q_ready, q_smem)
    for j in range(seqlen // BLOCK_N):
        s = j % STAGES
        # first lap: parity 1 of a fresh barrier counts as completed, so the ring starts empty
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row_kv + j * BLOCK_N, col], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row_kv + j * BLOCK_N, col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _softmax_step(s_ij, m_i, l_i, qk_scale):
    """One online-softmax update in the log2 domain; returns (p fp32, alpha, m_new, l_new)."""
    m_new = gl.maximum(m_i, gl.max(s_ij, axis=1) * qk_scale)
    p = gl.exp2(s_ij * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _overlap_step(j, p_prev, acc, alpha, m_i, l_i, q_wg, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, qk_scale,
                  STAGES: gl.constexpr, MODE: gl.constexpr):
    """FA3 intra-warpgroup overlap, tile j: S_j = Q K_j^T and acc += P_{j-1} V_{j-1} in flight together, the softmax
    of S_j runs while the PV is still on the tensor cores.  Returns (acc, P_j packed, alpha_j, m_i, l_i).

    ptxas ends a wgmma pipeline stage (WARPGROUP.DEPBAR) before any instruction that writes a register a pending
    wgmma reads (C7513 otherwise), and its list scheduler issues a ready DEPBAR in the first latency bubble: with
    MODE=1 the PV wait lands right after the row max (first SHFL), so only the max overlaps the PV.  MODE=2 puts a
    basic-block boundary (a try_wait spin loop on the V barrier phase that has already completed) between the
    softmax and the PV wait; ptxas does not hoist the DEPBAR across it, so the exp2s / row sum run under the PV.
    The bf16 packing of P_j stays after the wait: it overwrites the registers P_{j-1} V_{j-1} reads."""
    o_layout: gl.constexpr = acc.type.layout
    s = j % STAGES
    sp = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q_wg, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    # acc (scale m_{j-2}) -> scale m_{j-1} while S_j runs; acc is not in flight here
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p_prev, v_smem.index(sp), acc, is_async=True)
    # retire S_j only: P_{j-1} V_{j-1} keeps the tensor cores busy during the softmax below
    s_ij = warpgroup_mma_wait(1, deps=[s_tok])
    p, alpha, m_i, l_i = _softmax_step(s_ij, m_i, l_i, qk_scale)
    p_layout: gl.constexpr = p_prev.type.layout
    if MODE >= 2:
        # basic-block boundary (a try_wait spin loop on a phase that has already completed) before the PV wait:
        # ptxas does not hoist the WARPGROUP.DEPBAR across it
        mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
    acc = warpgroup_mma_wait(0, deps=[o_tok])
    p_op = gl.convert_layout(p.to(p_prev.dtype), p_layout)
    mbarrier.arrive(kv_empty.index(sp), count=1)
    return acc, p_op, alpha, m_i, l_i


@gluon.jit
def _consumer(q_wg, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, o_desc, lse_ptr, seqlen, num_heads,
              qk_scale, WG, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, OVERLAP: gl.constexpr):
    """One warpgroup: q_wg = rows [WG*BLOCK_M, (WG+1)*BLOCK_M) of the CTA's Q tile; acc [BLOCK_M, HEAD_DIM] fp32."""
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    n_tiles = seqlen // BLOCK_N
    mbarrier.wait(q_ready, 0)

    if OVERLAP > 0:
        # prologue: S_0 and its softmax; there is no PV yet
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_wg, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_ij = warpgroup_mma_wait(0, deps=[s_tok])
        p, alpha, m_i, l_i = _softmax_step(s_ij, m_i, l_i, qk_scale)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            acc, p_op, alpha, m_i, l_i = _overlap_step(
                j, p_op, acc, alpha, m_i, l_i, q_wg, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, qk_scale,
                STAGES, OVERLAP)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        sl = (n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(sl), ((n_tiles - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(sl), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(kv_empty.index(sl), count=1)
    else:
        for j in range(n_tiles):
            s = j % STAGES
            ph = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(s), ph)
            s_tok = warpgroup_mma(q_wg, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_ij = warpgroup_mma_wait(0, deps=[s_tok])
            p, alpha, m_i, l_i = _softmax_step(s_ij, m_i, l_i, qk_scale)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_ready.index(s), ph)
            o_tok = warpgroup_mma(p_op, v_smem.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(kv_empty.index(s), count=1)

    # epilogue: O = acc / l_i, staged through this warpgroup's (now dead) slice of the Q tile, TMA store
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    row0 = pid_m * (2 * BLOCK_M) + WG * BLOCK_M
    acc = acc * (1.0 / gl.convert_layout(l_i, row_o))[:, None]
    q_wg.store(acc.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b * seqlen + row0, h * HEAD_DIM], q_wg)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    offs = row0 + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(lse_ptr + pid_bh.to(gl.int64) * seqlen + offs, lse)
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_gluon(q_desc, k_desc, v_desc, o_desc, lse_ptr, seqlen, num_heads, qk_scale,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr, OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrive per consumer warpgroup
    # argument tuples are written inline: a tuple bound to a local first turns its constexprs into tensors
    gl.warp_specialize([
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                     seqlen, num_heads, BLOCK_N, STAGES)),
        (_consumer, (q_smem.slice(0, BLOCK_M), k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, o_desc, lse_ptr,
                     seqlen, num_heads, qk_scale, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP)),
        (_consumer, (q_smem.slice(BLOCK_M, BLOCK_M), k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, o_desc,
                     lse_ptr, seqlen, num_heads, qk_scale, 1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def _descs(q, k, v, o, block_n):
    """TMA descriptors (the library's: one head's [rows, D] tile of the 2D view [B*S, H*D])."""
    tiles = ((q, 2 * BLOCK_M), (k, block_n), (v, block_n), (o, BLOCK_M))
    return tuple(_descriptor(t, rows).real() for t, rows in tiles)


def gluon_forward(q, k, v, block_n=128, stages=2, overlap=0, softmax_scale=None, warmup=False):
    """q, k, v [B, S, H, 128] bf16 contiguous -> (o [B, S, H, 128] bf16, lse [B, H, S] fp32)."""
    b, s, h, d = q.shape
    if d != HEAD_DIM or q.dtype != torch.bfloat16 or s % (2 * BLOCK_M) or s % block_n:
        raise ValueError(f"q: need [B, S, H, {HEAD_DIM}] bf16 with S % {max(2 * BLOCK_M, block_n)} == 0")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    o = torch.empty_like(q)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    grid = (s // (2 * BLOCK_M), b * h)
    args = (*_descs(q, k, v, o, block_n), lse, s, h, scale * LOG2E)
    kw = dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, OVERLAP=overlap,
              CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
    if warmup:
        return _attn_fwd_gluon.warmup(*args, grid=grid, **kw)
    _attn_fwd_gluon[grid](*args, **kw)
    return o, lse


# ---------------------------------------------------------------------------------------------------- compile-only
SASS_OPS = ("HGMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "UTMALDG", "UTMASTG", "SYNCS", "MUFU.EX2", "BAR",
            "LDL", "STL", "USETMAXREG")


def _report(kernel) -> dict:
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        res = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        # re-run ptxas ourselves to surface its performance warnings (e.g. C7510/C7514: wgmma serialized)
        warn = subprocess.run([str(tools / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "x.o")],
                              capture_output=True, text=True)
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    ops = Counter(m.group(1) for line in sass.splitlines()
                  if (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", line)))
    counts = {op: sum(n for name, n in ops.items() if name == op or name.startswith(op + ".")) for op in SASS_OPS}
    # overlap check: MUFU.EX2 issued between a "DEPBAR.LE gsb0, 0x1" (S_j retired, PV still pending) and the next
    # DEPBAR, i.e. exp2s that really run under the PV wgmma (64 per warpgroup loop body for BLOCK_N=128 if ideal)
    ex2_under_pv, counting = [], False
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR" in line:
            counting = "0x1" in line
            if counting:
                ex2_under_pv.append(0)
        elif counting and "MUFU.EX2" in line:
            ex2_under_pv[-1] += 1
    warnings = [ln.strip() for ln in (warn.stdout + warn.stderr).splitlines()
                if "arning" in ln or "Performance Loss" in ln or "spill" in ln and " 0 bytes spill stores" not in ln]
    return {"registers": int(usage.get("REG", 0)), "stack_bytes": int(usage.get("STACK", 0)),
            "local_bytes": int(usage.get("LOCAL", 0)), "shared_bytes": kernel.metadata.shared, "sass": counts,
            "ex2_under_pending_pv": ex2_under_pv, "ptxas_warnings": warnings}


def compile_only(names) -> list:
    from triton.runtime import driver
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compile_report import _HopperTarget   # the stand-in driver that names sm_90a
    driver.set_active(_HopperTarget())
    b, s, h = 1, 512, 2
    q, k, v = (torch.zeros(b, s, h, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3))
    rows = []
    for name, bn, st, ov in VARIANTS:
        if names and name not in names:
            continue
        try:
            ck = gluon_forward(q, k, v, block_n=bn, stages=st, overlap=ov, warmup=True)
            rows.append({"variant": name, **_report(ck)})
        except Exception as e:  # noqa: BLE001 - one variant the compiler rejects must not hide the others
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:18} FAILED {r['error']}")
            continue
        sc = " ".join(f"{k}={v}" for k, v in r["sass"].items())
        print(f"{r['variant']:18} regs={r['registers']} stack={r['stack_bytes']} smem={r['shared_bytes']} {sc} "
              f"ex2_under_pending_pv={r['ex2_under_pending_pv']}")
        for w in r["ptxas_warnings"]:
            print(f"{'':18} ptxas: {w[:200]}")
    return rows


# ---------------------------------------------------------------------------------------------------- GPU mode
def _tflops(b, h, s, d, ms):
    return 4 * b * h * s * s * d / (ms * 1e-3) / 1e12


def gpu_bench(shapes, names, tol=2e-2) -> dict:
    import flashport
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "tolerance": tol, "rows": []}
    for (b, h, s) in shapes:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
        with torch.no_grad():
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        cases = [(n, (lambda bn=bn, st=st, ov=ov: gluon_forward(q, k, v, bn, st, ov)[0]))
                 for n, bn, st, ov in VARIANTS if not names or n in names]
        configs = {n: {"block_n": bn, "stages": st, "overlap": ov} for n, bn, st, ov in VARIANTS}
        cases.append(("flashport_triton", lambda: flashport.attention(q, k, v, backend="triton")))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        cases.append(("sdpa_cudnn", cudnn))
        for name, fn in cases:
            row = {"variant": name, "B": b, "H": h, "S": s, "D": HEAD_DIM, **configs.get(name, {})}
            try:
                with torch.no_grad():
                    err = (fn().float() - ref).abs().max().item()
                row["max_abs_diff"] = err
                row["correct"] = bool(err <= tol)
                if row["correct"]:
                    with torch.no_grad():
                        ms = do_bench(fn, warmup=25, rep=250, return_mode="median")
                    row.update(ms=ms, tflops=_tflops(b, h, s, HEAD_DIM, ms))
            except Exception as e:  # noqa: BLE001 - report the failure, keep measuring the rest
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            out["rows"].append(row)
            tf = f"{row['tflops']:7.1f}" if "tflops" in row else "      -"
            print(f"{name:18} B={b} H={h} S={s:6d} diff={row.get('max_abs_diff', float('nan')):.2e} "
                  f"ok={row.get('correct')} TFLOP/s={tf} {row.get('error', '')}", flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a on CPU and report SASS stats")
    ap.add_argument("--variants", nargs="*", default=None, help=f"subset of {[v[0] for v in VARIANTS]}")
    ap.add_argument("--out", type=Path, help="write the JSON result here")
    args = ap.parse_args(argv)
    if args.compile_only:
        result = {"compile": compile_only(args.variants)}
    else:
        result = gpu_bench([(4, 16, 4096), (1, 16, 16384)], args.variants)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

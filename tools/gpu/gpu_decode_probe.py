"""Decode probe for one GPU run: where the KV-cache kernel loses bandwidth at small batch.

    PYTHONPATH=. python3 tools/gpu/gpu_decode_probe.py --out $OUT/decode_probe.json

For the decode suite's shapes (batch x kv length in 1x32768, 16x8192, 64x4096, 128x2048; 32 q /
8 kv heads, D=128, bf16) and each cache layout (dense, page 16, page 256):

* flashport (public API) and SDPA cuDNN / FA2 (dense only), each timed eagerly (do_bench) and
  replayed from a CUDA graph (flashport.bench.timing.gpu_graph_ms), with GB/s and % of copy, by the
  same code as `flashport bench --suite decode` (flashport.bench.gpu.decode_timings);
* the launch plan the heuristics chose (num_splits, BLOCK_M/N, stages, warps, per-tile page lookup)
  and what splitkv.choose_num_splits would pick for other WAVES values;
* for 1x32768 and 16x8192 only: graph-replay timings of forced num_splits, BLOCK_N, num_stages,
  num_warps, programmatic dependent launch of the merge (decode.PDL) and of the per-key page lookup,
  with the merge's own time beside each split variant, so WAVES / MIN_TILES_PER_SPLIT / the configs
  can be retuned from one run (sweep() lists the variants).

Every variant's output is compared with an fp32 materialised reference (max |diff| printed), so a
wrong-but-fast variant shows.  The JSON is rewritten after every shape: a run cut short keeps what
it measured.  Sweeps stop when --budget-s is spent (recorded as skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl


def reference(q, k, v):
    """fp32 materialised attention for one query per sequence: q [B, 1, Hq, D], dense k/v
    [B, S, Hkv, D] -> [B, 1, Hq, D] (batch chunks keep the fp32 copies small)."""
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    outs = []
    for i in range(0, b, 16):
        qq = q[i:i + 16, 0].float().view(-1, hkv, hq // hkv, d)
        s = torch.einsum("bhgd,bshd->bhgs", qq, k[i:i + 16].float()) * d ** -0.5
        o = torch.einsum("bhgs,bshd->bhgd", s.softmax(-1), v[i:i + 16].float())
        outs.append(o.reshape(-1, 1, hq, d))
    return torch.cat(outs)


@triton.jit
def _read(X, N, OUT, BLOCK: tl.constexpr):
    """Stream X once (grid-stride over BLOCK-element chunks); one partial sum per program."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, N, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc))


def read_ceiling(device, nbytes: int, clean_flush: bool) -> dict:
    """Fastest graph-replayed read of `nbytes` (one streaming Triton kernel, bf16, 16-byte loads)
    over a few grid sizes and pipeline depths: the floor under any decode kernel that reads that
    many bytes once, timed exactly like the decode contenders."""
    from flashport.bench.timing import gpu_graph_ms

    x = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    best = None
    for waves in (1, 2, 4, 8):
        for stages in (2, 3, 4):
            out = torch.empty(sms * waves, device=device)
            fn = lambda: _read[(sms * waves,)](x, x.numel(), out, BLOCK=4096, num_warps=8, num_stages=stages)  # noqa: E731
            ms, _ = gpu_graph_ms(fn, rep_ms=20, clean_flush=clean_flush)
            if best is None or ms < best["graph_ms"]:
                best = dict(graph_ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9, programs=sms * waves, num_stages=stages)
    del x
    return best


def sweep(shape, cfg) -> list[dict]:
    """Forced launch parameters to time for one shape (graph replay): split counts, tiles / stages /
    warps at the split counts that matter, programmatic dependent launch of the merge, per-key pages."""
    if shape.b == 1:
        out = [dict(num_splits=s, pdl=p) for s in (16, 24, 32, 48, 64) for p in (False, True)]
        out += [dict(num_splits=s, block_n=128, num_stages=2) for s in (16, 32, 64)]
    else:
        out = [dict(num_splits=s) for s in (1, 2, 3, 4, 8)] + [dict(pdl=False), dict(block_n=128)]
    if shape.page:
        out += [dict(num_stages=4), dict(num_stages=5)]
        if shape.page % cfg.BLOCK_N == 0:
            out.append(dict(tile_page_lookup=False))
    return out


def merge_ms(parts: int, q) -> float:
    """Graph-replay time of the split merge alone for `parts` float32 partials of q's shape."""
    from flashport.bench.timing import gpu_graph_ms
    from flashport.kernels.merge import merge_partials
    b, sq, hq, d = q.shape
    o_parts = torch.randn(parts, b, sq, hq, d, device=q.device)
    lse_parts = torch.randn(parts, b, hq, sq, device=q.device)
    out, lse = torch.empty_like(q), torch.empty(b, hq, sq, device=q.device)
    return gpu_graph_ms(lambda: merge_partials(o_parts, lse_parts, out, lse), rep_ms=10)[0]


def compiled_kernels(jit_fn) -> list[dict]:
    """Shared memory / registers / spills of every compiled variant of a Triton kernel (best effort:
    the cache layout is Triton-version specific)."""
    rows = []
    try:
        for caches in jit_fn.device_caches.values():
            for key, k in caches[0].items():
                k._init_handles()
                rows.append(dict(shared=k.metadata.shared, regs=getattr(k, "n_regs", None),
                                 spills=getattr(k, "n_spills", None), warps=k.metadata.num_warps,
                                 stages=k.metadata.num_stages, key=str(key)[-160:]))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(error=f"{type(e).__name__}: {e}"[:200]))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/decode_probe.json")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop the sweeps after this many seconds")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_decode_probe: needs CUDA")

    from flashport.bench import gpu, peers, timing
    from flashport.bench.report import environment
    from flashport.bench.shapes import decode as decode_shapes
    from flashport.bench.shapes import kv_bytes
    from flashport.kernels import decode, splitkv
    from flashport.kvcache import gather_pages
    from flashport.spec import kvcache_spec

    t0 = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    ceil = {"copy_gbps": round(timing.copy_gbps(device), 1)}
    sms = splitkv.sm_count(device)
    doc = {"command": " ".join(sys.argv), "environment": environment(device), "ceilings": ceil,
           "tuning": dict(WAVES=splitkv.WAVES, WAVES_DENSE=splitkv.WAVES_DENSE,
                         MIN_TILES_PER_SPLIT=splitkv.MIN_TILES_PER_SPLIT, sms=sms),
           "shapes": []}
    print(f"copy {ceil['copy_gbps']} GB/s, {sms} SMs, WAVES={splitkv.WAVES}, "
          f"MIN_TILES_PER_SPLIT={splitkv.MIN_TILES_PER_SPLIT}", flush=True)

    def save():
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    def line(label, name, r):
        g = "-" if r.get("graph_ms") is None else (f"{r['graph_ms'] * 1e3:7.1f} us {r['graph_gbps']:6.0f} GB/s "
                                                   f"{r['graph_frac_of_copy']:4.0%}")
        e = "" if r.get("ms") is None else f"eager {r['ms'] * 1e3:7.1f} us {r['frac_of_copy']:4.0%} | "
        print(f"{label:<34} {name:<26} {e}graph {g} | max|diff| {r.get('max_abs_diff', float('nan')):.2e}"
              + (f"  [{r['graph_fallback'][:60]}]" if r.get("graph_fallback") else ""), flush=True)

    for shape in decode_shapes():
        label = shape.label()
        q, kc, vc, lens, table = peers.make_cache(shape, device)
        dense_k, dense_v = (kc, vc) if table is None else (gather_pages(kc, table), gather_pages(vc, table))
        ref = reference(q, dense_k, dense_v)
        del dense_k, dense_v
        spec, inputs, _ = kvcache_spec(q, kc, vc, None, None, cache_seqlens=lens, block_table=table, causal=False,
                                       softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                       return_lse=False)
        plan = decode.plan_for(spec, device)
        cfg = plan.cfg
        row = {"label": label, "shape": shape.as_dict(), "contenders": {}, "variants": [],
               "plan": dict(num_splits=plan.num_splits, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                            num_stages=cfg.num_stages, num_warps=cfg.num_warps,
                            tile_page_lookup=plan.constexprs["TILE_IN_PAGE"], m_blocks=plan.m_blocks),
               "splits_for_waves": {w: splitkv.choose_num_splits(shape.b * shape.hkv * plan.m_blocks,
                                                                 -(-shape.sk // cfg.BLOCK_N), sms, waves=w)
                                    for w in (2, 3, 4, 6, 8)}}
        doc["shapes"].append(row)
        print(f"\n{label}: plan {row['plan']}  splits for WAVES {row['splits_for_waves']}", flush=True)

        for impl in ("flashport-triton", "sdpa-cudnn", "sdpa-fa2"):
            if impl != "flashport-triton" and table is not None:
                continue
            try:
                with peers.context(impl):
                    fn = peers.decode_fn(impl, shape, q, kc, vc, lens, table)
                    out = peers.run_once(fn)
                    r = dict(max_abs_diff=(out.float() - ref).abs().max().item(), **gpu.decode_timings(fn, shape, ceil))
            except Exception as e:  # noqa: BLE001 - recorded, the probe goes on
                r = dict(error=f"{type(e).__name__}: {e}"[:300])
            row["contenders"][impl] = r
            if "error" in r:
                print(f"{label:<34} {impl:<26} {r['error'][:100]}", flush=True)
            else:
                line(label, impl, r)
        save()

        if shape.b == 1 and not shape.page:  # how close to the device's read floor is anyone here?
            row["read_ceiling"] = {}
            for clean in (False, True):
                mode = "clean_flush" if clean else "write_flush"
                try:
                    rc = read_ceiling(device, kv_bytes(shape), clean)
                    rc["contenders_graph_ms"] = {}
                    for impl in ("flashport-triton", "sdpa-cudnn"):
                        with peers.context(impl):
                            fn = peers.decode_fn(impl, shape, q, kc, vc, lens, table)
                            rc["contenders_graph_ms"][impl] = timing.gpu_graph_ms(fn, rep_ms=25, clean_flush=clean)[0]
                except Exception as e:  # noqa: BLE001
                    rc = dict(error=f"{type(e).__name__}: {e}"[:300])
                row["read_ceiling"][mode] = rc
                print(f"{label:<34} read ceiling ({mode}): {rc}", flush=True)
            save()

        if shape.b not in (1, 16):
            continue
        for var in sweep(shape, cfg):
            name = " ".join(f"{k}={v}" for k, v in var.items())
            if time.perf_counter() - t0 > args.budget_s:
                row["variants"].append(dict(var, skipped="time budget"))
                continue
            kw = {k: v for k, v in var.items() if k not in ("tile_page_lookup", "pdl")}
            saved = decode.TILE_PAGE_LOOKUP, decode.PDL
            decode.TILE_PAGE_LOOKUP = var.get("tile_page_lookup", saved[0])
            decode.PDL = var.get("pdl", saved[1])
            try:
                fn = lambda: decode.kvcache_attention(spec, inputs, **kw)[0]  # noqa: E731
                diff = (fn().float() - ref).abs().max().item()
                ms, fallback = timing.gpu_graph_ms(fn, rep_ms=25)
                vp = decode.plan_for(spec, device, **kw)
                gbps = kv_bytes(shape) / (ms * 1e-3) / 1e9
                r = dict(var, graph_ms=ms, graph_gbps=gbps, graph_frac_of_copy=gbps / ceil["copy_gbps"],
                         max_abs_diff=diff, splits=vp.num_splits, BLOCK_N=vp.cfg.BLOCK_N,
                         num_stages=vp.cfg.num_stages, num_warps=vp.cfg.num_warps,
                         tile_page_lookup=vp.constexprs["TILE_IN_PAGE"], pdl=vp.pdl)
                if vp.num_splits > 1:  # the merge alone, on buffers of this call's shape
                    r["merge_graph_ms"] = merge_ms(vp.num_splits, q)
                if fallback:
                    r["graph_fallback"] = fallback
            except Exception as e:  # noqa: BLE001
                r = dict(var, error=f"{type(e).__name__}: {e}"[:300])
            finally:
                decode.TILE_PAGE_LOOKUP, decode.PDL = saved
            row["variants"].append(r)
            if "error" in r:
                print(f"{label:<34} {name:<26} {r['error'][:100]}", flush=True)
            else:
                line(label, f"{name} (splits {r['splits']})", r)
                if "merge_graph_ms" in r:
                    print(f"{'':<34} {'merge alone':<26} graph {r['merge_graph_ms'] * 1e3:7.1f} us", flush=True)
        save()
        del q, kc, vc, lens, table, ref, inputs
        torch.cuda.empty_cache()

    doc["compiled"] = {"split_kernel": compiled_kernels(decode._kvcache_split_kernel)}
    save()
    print(f"\nwrote {args.out} in {doc['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

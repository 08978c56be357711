"""KV-cache calls on the GPU, two questions in one run.

1. Chunked prefill and speculative verification through attention_with_kvcache: the prefill kernel
(kernels/attn_fwd.kvcache_forward, >= backend/triton.PREFILL_MIN_Q queries) against the decode kernel on the same
call, SDPA-FA2 / cuDNN with a bottom-right causal bias (dense caches only) and FA4 (page_table with seqused_k), in
one process, each output checked against a float32 PyTorch computation of the same call.  Cells: GQA 32/8,
D=128, bf16, B entries of Sq new queries after Sk - Sq cached keys, dense / page 16 / page 256 caches; Sq from 16
(verification) to 4096 (a long chunk).
2. Decode with ragged lengths (issue [8]: 64 sequences of 1-16k tokens, 64/8 heads, pages of 16) and uniform ones
(64 x 4096): the decode kernel's forced split counts against its heuristic, CUDA-graph replay, % of the device copy
rate measured in the same process (K+V bytes of the valid lengths).

    PYTHONPATH=. python3 tools/gpu/kvcache_probe.py [--out kvcache.json] [--quick] [--skip-chunked]

Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flashport  # noqa: E402
from flashport.backend import triton as triton_backend  # noqa: E402
from flashport.bench.timing import gpu_ms  # noqa: E402

CELLS = [  # (B, Sq, Sk, page)
    (32, 16, 4096, 16), (32, 16, 4096, 0), (8, 64, 4096, 16), (8, 256, 8192, 16), (4, 1024, 8192, 0),
    (4, 1024, 8192, 16), (4, 1024, 8192, 256), (1, 4096, 16384, 16), (2, 2048, 32768, 0),
]
HQ, HKV, D, DT = 32, 8, 128, torch.bfloat16


def _paged(k, v, page, g):
    b, sk = k.shape[:2]
    nblk = sk // page
    perm = torch.randperm(b * nblk, device=k.device, generator=g)
    table = perm.view(b, nblk).to(torch.int32)
    kc, vc = (torch.empty_like(t.reshape(b * nblk, page, *t.shape[2:])) for t in (k, v))
    kc[perm], vc[perm] = (t.reshape(b * nblk, page, *t.shape[2:]) for t in (k, v))
    return kc, vc, table


def _reference(q, k, v):
    """float32 math of the bottom-right causal call, one batch entry at a time (no Sq x Sk buffer for all B)."""
    from torch.nn.attention.bias import causal_lower_right
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    g = q.shape[2] // k.shape[2]
    bias = causal_lower_right(q.shape[1], k.shape[1])
    for b in range(q.shape[0]):
        qb, kb, vb = (t[b].float().transpose(0, 1) for t in (q, k, v))
        kb, vb = kb.repeat_interleave(g, 0), vb.repeat_interleave(g, 0)
        out[b] = F.scaled_dot_product_attention(qb[None], kb[None], vb[None], attn_mask=bias)[0].transpose(0, 1)
    return out


def cell(b, sq, sk, page, dev, fa4):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, sq, HQ, D, device=dev, dtype=DT, generator=g)
    k = torch.randn(b, sk, HKV, D, device=dev, dtype=DT, generator=g)
    v = torch.randn(b, sk, HKV, D, device=dev, dtype=DT, generator=g)
    lens = torch.full((b,), sk, dtype=torch.int32, device=dev)
    kc, vc, table = (k, v, None) if not page else _paged(k, v, page, g)
    ref = _reference(q, k, v)
    flops = 4 * D * b * HQ * (sq * (sk - sq) + sq * (sq + 1) // 2)
    fns = {}

    def ours(min_q):
        def run():
            saved = triton_backend.PREFILL_MIN_Q
            triton_backend.PREFILL_MIN_Q = min_q
            try:
                return flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                        causal=True, backend="triton")
            finally:
                triton_backend.PREFILL_MIN_Q = saved
        return run

    fns["prefill-kernel"] = ours(1)
    fns["decode-kernel"] = ours(1 << 30)
    fns["auto"] = lambda: flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                           causal=True)
    if not page:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(sq, sk)
        for name, be in (("sdpa-fa2", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def sd(be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          attn_mask=bias, enable_gqa=True).transpose(1, 2)
            fns[name] = sd
    if fa4 is not None:
        if page:
            fns["fa4"] = lambda: fa4.flash_attn_varlen_func(q, kc, vc, seqused_k=lens, page_table=table,
                                                            causal=True)[0]
        else:
            fns["fa4"] = lambda: fa4.flash_attn_func(q, k, v, causal=True)[0]
    row = {"b": b, "sq": sq, "sk": sk, "page": page, "impls": {}}
    for name, fn in fns.items():
        try:
            out = fn()
            err = (out.float() - ref).abs().max().item()
            ms = gpu_ms(fn)
            row["impls"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_err": err}
        except Exception as e:   # a peer that refuses the call
            row["impls"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    best_peer = min((r["ms"] for n, r in row["impls"].items() if n.startswith(("sdpa", "fa4")) and "ms" in r),
                    default=None)
    for r in row["impls"].values():
        if "ms" in r and best_peer:
            r["vs_best_peer"] = best_peer / r["ms"]
    return row


def ragged_sweep(dev, shapes=None, splits_list=(None, 1, 2, 4, 8, 16, 32, 64)) -> list:
    """Graph-replayed decode at forced split counts, ragged and uniform lengths -> rows."""
    from flashport.bench.shapes import Shape, decode_lens
    from flashport.bench.timing import copy_gbps, gpu_graph_ms
    from flashport.kernels import decode
    from flashport.spec import kvcache_spec
    copy = copy_gbps(dev)
    rows = []
    for shape in shapes or (Shape("ragged-decode", 64, 1, 16384, 64, 8, 128, kind="decode", page=16, ragged=True),
                            Shape("uniform-decode", 64, 1, 4096, 32, 8, 128, kind="decode", page=16)):
        g = torch.Generator(device=dev).manual_seed(0)
        lens = decode_lens(shape).to(dev)
        nblk = shape.sk // shape.page
        q = torch.randn(shape.b, 1, shape.hq, shape.d, device=dev, dtype=DT, generator=g)
        kc = torch.randn(shape.b * nblk, shape.page, shape.hkv, shape.d, device=dev, dtype=DT, generator=g)
        vc = torch.randn(kc.shape, device=dev, dtype=DT, generator=g)
        table = torch.randperm(shape.b * nblk, device=dev, generator=g).view(shape.b, nblk).to(torch.int32)
        spec, inputs, _ = kvcache_spec(q, kc, vc, None, None, cache_seqlens=lens, block_table=table, causal=False,
                                       softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                       return_lse=False)
        nbytes = int(lens.sum()) * shape.hkv * shape.d * 2 * 2
        base = decode.kvcache_attention(spec, inputs)[0].float()
        heuristic = decode.plan_for(spec, dev).num_splits
        for splits in splits_list:
            fn = (lambda s=splits: decode.kvcache_attention(spec, inputs, num_splits=s)[0])
            err = (fn().float() - base).abs().max().item()
            ms, _ = gpu_graph_ms(fn)
            row = {"label": shape.label(), "splits": splits or heuristic, "heuristic": splits is None, "graph_ms": ms,
                   "gbps": nbytes / ms / 1e6, "frac_of_copy": nbytes / ms / 1e6 / copy, "max_diff_vs_heuristic": err}
            rows.append(row)
            print(f"{row['label']} splits={row['splits']}{' (heuristic)' if splits is None else ''}: {ms * 1e3:.1f} us "
                  f"{row['frac_of_copy']:.0%} of copy ({copy:.0f} GB/s) diff {err:.1e}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-chunked", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    try:
        from flash_attn import cute as fa4
    except Exception:
        fa4 = None
    rows = []
    ragged = ragged_sweep(dev)
    for b, sq, sk, page in [] if args.skip_chunked else CELLS[:3] if args.quick else CELLS:
        row = cell(b, sq, sk, page, dev, fa4)
        rows.append(row)
        print(f"B={b} Sq={sq} Sk={sk} page={page}:", "  ".join(
            f"{n} {r['tflops']:.0f}TF ({r.get('vs_best_peer', 0):.2f}x) err {r['max_err']:.1e}" if "ms" in r
            else f"{n} [{r['error'][:60]}]" for n, r in row["impls"].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"card": torch.cuda.get_device_name(), "chunked": rows, "ragged_decode": ragged},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

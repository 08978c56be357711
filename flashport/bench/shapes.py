"""Benchmark shapes and suites (what is measured; how is in timing/peers/gpu/cpu).

Standard set (DESIGN.md): bf16, B*S = 16384, H*D = 2048, D in {64, 128, 256},
S in {512 ... 16384}, causal and not, forward and backward.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Shape:
    """One attention problem.  Dense: q [b, sq, hq, d], k/v [b, sk, hkv, d].  Decode (kind="decode"):
    sq = 1 query per sequence over a KV cache of sk tokens, dense (page = 0) or paged (page > 0)."""

    name: str
    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    causal: bool = False
    modes: tuple = ("fwd", "bwd")
    kind: str = "dense"
    page: int = 0
    dtype: str = "bfloat16"
    dv: int = 0          # value head dim; 0: the same as d
    window: int = -1     # a sliding window of this many keys to the left (with causal: Mistral / Gemma-2's)
    docs: tuple = ()     # kind="varlen": the packed documents' lengths (b = 1, sq = sk = their sum)
    ragged: bool = False  # kind="decode": cache lengths drawn in [1, sk] (decode_lens), not all sk

    @property
    def head_dim_v(self) -> int:
        return self.dv or self.d

    @property
    def window_size(self) -> tuple[int, int]:
        """flashport's window_size for this shape: (-1, -1) for none."""
        if self.window < 0:
            return (-1, -1)
        return (self.window, 0 if self.causal else self.window)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        if self.kind == "decode":
            return f"{self.name} b{self.b} kv{self.sk} h{self.hq}/{self.hkv} d{self.d}" + \
                (f" page{self.page}" if self.page else " dense") + (" ragged" if self.ragged else "")
        heads = f"h{self.hq}" if self.hq == self.hkv else f"h{self.hq}/{self.hkv}"
        if self.kind == "varlen":
            return f"{self.name} docs{len(self.docs)} t{self.sq} {heads} d{self.d}" + (" causal" if self.causal else "")
        if self.kind == "chunked":
            return f"{self.name} b{self.b} q{self.sq} kv{self.sk} {heads} d{self.d}" + \
                (f" page{self.page}" if self.page else "") + (" causal" if self.causal else "")
        heads = f"h{self.hq}" if self.hq == self.hkv else f"h{self.hq}/{self.hkv}"
        return (f"{self.name} b{self.b} s{self.sq} {heads} d{self.d}" + (f" dv{self.dv}" if self.dv else "")
                + (" causal" if self.causal else "") + (f" window{self.window}" if self.window >= 0 else ""))


def flops(shape: Shape, mode: str) -> float:
    """FlashAttention's convention: fwd 2*(D+Dv)*B*H*Sq*Sk (4*B*H*Sq*Sk*D), halved for causal; a window
    counts its visible pairs; bwd 2.5x fwd."""
    from ..monitor import visible_pairs
    per_pair = 2.0 * (shape.d + shape.head_dim_v) * shape.b * shape.hq
    if shape.kind == "varlen":
        f = per_pair * sum(visible_pairs(n, n, *(shape.window_size if shape.window >= 0 else
                                                 ((-1, 0) if shape.causal else (-1, -1)))) for n in shape.docs)
    elif shape.kind == "chunked":   # bottom-right aligned: the chunk's rows see the whole cache before them
        f = per_pair * visible_pairs(shape.sq, shape.sk, -1, 0 if shape.causal else -1)
    elif shape.window >= 0:
        f = per_pair * visible_pairs(shape.sq, shape.sk, *shape.window_size)
    else:
        f = per_pair * shape.sq * shape.sk / (2 if shape.causal else 1)
    return f * (2.5 if mode == "bwd" else 1.0)


def decode_lens(shape: Shape) -> torch.Tensor:
    """int32 [B] cache lengths of a decode shape: all Sk, or (ragged) drawn in [1, Sk] from a fixed seed."""
    if not shape.ragged:
        return torch.full((shape.b,), shape.sk, dtype=torch.int32)
    g = torch.Generator().manual_seed(shape.b * 7919 + shape.sk)
    return torch.randint(1, shape.sk + 1, (shape.b,), generator=g, dtype=torch.int32)


def cu_seqlens(shape: Shape, device) -> torch.Tensor:
    """int32 [n + 1] cumulative lengths of a varlen shape's packed documents (attention_varlen's cu_seqlens)."""
    return torch.tensor((0,) + shape.docs, device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def kv_bytes(shape: Shape) -> int:
    """Bytes of K and V a decode step must read: (sum of the cache lengths) * Hkv * D * 2 tensors * element size."""
    return int(decode_lens(shape).sum()) * shape.hkv * shape.d * 2 * torch.finfo(shape.torch_dtype).bits // 8


def _docs(n: int, total: int, seed: int, shortest: int = 17) -> tuple:
    """n document lengths summing to `total`, each at least `shortest`, drawn from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g) ** 2 + 1e-3
    lens = (shortest + (w / w.sum() * (total - n * shortest)).floor()).to(torch.int64)
    lens[0] += total - int(lens.sum())
    return tuple(int(x) for x in lens)


def standard(ds=(64, 128, 256), ss=(512, 1024, 2048, 4096, 8192, 16384), causals=(False, True)) -> list[Shape]:
    return [Shape("standard", 16384 // s, s, s, 2048 // d, 2048 // d, d, causal=c)
            for d in ds for c in causals for s in ss]


def models() -> list[Shape]:
    return [
        Shape("llama3-8b-prefill", 1, 8192, 8192, 32, 8, 128, causal=True, modes=("fwd",)),
        Shape("llama3-8b-train", 2, 8192, 8192, 32, 8, 128, causal=True),
        Shape("vit-h14", 16, 1024, 1024, 16, 16, 80),
        Shape("vit-h14", 4, 4096, 4096, 16, 16, 80),
        Shape("whisper-enc", 8, 1500, 1500, 20, 20, 64),
        Shape("dit", 4, 4096, 4096, 16, 16, 72),
        Shape("long-doc", 1, 131072, 131072, 16, 16, 128, causal=True),
    ]


def workloads() -> list[Shape]:
    """Shapes of the kinds real models train and serve with (issue [8]): GQA training, sliding windows,
    head dims that are not powers of two, MLA's D=192 / Dv=128, D=256, cross-attention over a short context.
    Varlen packing, chunked prefill and ragged paged decode as their own kinds ("varlen", "chunked":
    attention_with_kvcache with Sq > 1, "decode" with ragged lengths)."""
    return [
        Shape("llama3-8b-train", 4, 4096, 4096, 32, 8, 128, causal=True),
        Shape("mistral-7b-swa", 1, 16384, 16384, 32, 8, 128, causal=True, window=4096),
        Shape("gemma2-9b-swa", 2, 8192, 8192, 16, 8, 256, causal=True, window=4096),
        Shape("gemma2-9b", 2, 8192, 8192, 16, 8, 256, causal=True),
        Shape("phi3-mini", 4, 4096, 4096, 32, 32, 96, causal=True),
        Shape("vit-h14", 8, 2048, 2048, 16, 16, 80),
        Shape("dit-xl", 8, 4096, 4096, 16, 16, 72),
        Shape("deepseek-v3-mla-prefill", 1, 4096, 4096, 128, 128, 192, dv=128, causal=True),
        Shape("fa3-hdim256", 4, 4096, 4096, 8, 8, 256),
        # SDXL's text cross-attention at its 64 x 64 level: 4096 image tokens against the prompt's 77 (B = 2: CFG)
        Shape("sdxl-cross-attn", 2, 4096, 77, 10, 10, 64),
        Shape("packed-docs", 1, 16384, 16384, 32, 8, 128, causal=True, kind="varlen",
              docs=(3000, 2900, 2500, 2200, 2100, 1800, 1200, 667, 17)),
        Shape("packed-docs", 1, 32768, 32768, 32, 8, 128, causal=True, kind="varlen", docs=_docs(40, 32768, 1)),
        Shape("packed-docs", 1, 32768, 32768, 16, 16, 128, causal=True, kind="varlen", docs=_docs(16, 32768, 2)),
        Shape("chunked-prefill", 4, 1024, 8192, 32, 8, 128, causal=True, modes=("fwd",), kind="chunked"),
        Shape("chunked-prefill", 4, 1024, 8192, 32, 8, 128, causal=True, modes=("fwd",), kind="chunked", page=16),
        Shape("spec-verify", 32, 16, 4096, 32, 8, 128, causal=True, modes=("fwd",), kind="chunked", page=16),
        Shape("ragged-decode", 64, 1, 16384, 64, 8, 128, modes=("fwd",), kind="decode", page=16, ragged=True),
    ]


def long(ss=(32768, 65536, 131072)) -> list[Shape]:
    return [Shape("long", 1, s, s, 16, 16, 128, causal=True) for s in ss]


def decode(pages=(0, 16, 256)) -> list[Shape]:
    return [Shape("decode", b, 1, kv, 32, 8, 128, modes=("fwd",), kind="decode", page=p)
            for b, kv in ((1, 32768), (16, 8192), (64, 4096), (128, 2048)) for p in pages]


def gpu_suite(name: str, quick: bool = False) -> list[Shape]:
    """--quick keeps one or two small shapes per suite (a smoke run of the whole harness)."""
    if name == "standard":
        return standard(ds=(64, 128), ss=(1024, 4096), causals=(False, True)) if quick else standard()
    if name == "models":
        return [s for s in models() if s.sq <= 4096][:3] if quick else models()
    if name == "workloads":
        return [s for s in workloads() if s.sq <= 4096][:3] if quick else workloads()
    if name == "long":
        return long(ss=(32768,)) if quick else long()
    if name == "decode":
        return [s for s in decode() if s.b == 16] if quick else decode()
    raise ValueError(f"suite must be one of standard, models, workloads, long, decode; got {name!r}")


# ----------------------------------------------------------------------------- CPU main job
@dataclass(frozen=True)
class CpuConfig:
    """One cell of the CPU job: fp32, B=1; `impl` is "flashport" (backend=None), "blockwise" (flashport's tiled
    PyTorch path, named), "sdpa-cpu" (torch's F.scaled_dot_product_attention, its CPU flash kernel) or "naive"
    (materialised softmax(q kᵀ) v); mode "fwd" or "fwd+bwd"; causal / window as in flashport.attention."""
    s: int
    impl: str
    b: int = 1
    h: int = 1
    d: int = 64
    fp64_check_max_s: int = 4096   # error against float64 exact math for S up to this
    threads: int = 0               # torch intra-op threads in the worker; 0 = torch's default (all cores)
    mode: str = "fwd"
    causal: bool = False
    window: tuple = (-1, -1)
    docs: int = 0                  # > 0: that many equal packed documents under a causal document mask_mod

    def label(self) -> str:
        mask = "causal" if self.causal else (f"window{self.window[0]}_{self.window[1]}"
                                             if tuple(self.window) != (-1, -1) else "dense")
        return f"{self.mode} s{self.s} h{self.h} d{self.d} " + (f"docs{self.docs}" if self.docs else mask)

    def naive_peak_bytes(self) -> int:
        """Scores and their softmax are both alive at once: 2 x B*H*S*S float32 (and their gradients backward)."""
        return (4 if self.mode == "fwd+bwd" else 2) * self.b * self.h * self.s * self.s * 4

    def io_bytes(self) -> int:
        return 4 * self.b * self.s * self.h * self.d * 4   # q, k, v, out

    def flops(self) -> float:
        """FlashAttention's convention: 4·B·H·S²·D forward, halved for causal; backward 2.5x forward; a window
        counts its visible pairs."""
        f = 4.0 * self.b * self.h * self.s * self.s * self.d
        if self.docs:
            f /= 2 * self.docs      # causal inside each of `docs` equal documents
        elif self.causal:
            f /= 2
        elif tuple(self.window) != (-1, -1):
            left, right = self.window
            f *= min(1.0, ((left if left >= 0 else self.s) + (right if right >= 0 else self.s) + 1) / self.s)
        return f * (3.5 if self.mode == "fwd+bwd" else 1.0)


CPU_IMPLS = ("flashport", "sdpa-cpu", "blockwise", "naive")
CPU_WINDOW = (256, 0)   # the feature rows: a causal sliding window, which SDPA cannot serve,
CPU_DOCS = 8            # and packed documents through a mask_mod (SDPA would need an S x S mask)


def cpu_sizes(quick: bool = False, max_s: Optional[int] = None) -> list[int]:
    sizes = [256, 512] if quick else [1024, 4096, 16384]
    return [s for s in sizes if max_s is None or s <= max_s]


def cpu_rows(sizes: list[int], quick: bool = False) -> list[dict]:
    """The job's rows: forward non-causal at each size, and at one middle size (4096; 256 quick) forward causal,
    forward+backward causal, forward with a sliding window and forward over packed documents (a mask_mod)."""
    mid = 256 if quick else (4096 if 4096 in sizes or not sizes else sizes[len(sizes) // 2])
    # quick: a narrower window, so that at S=256 it still bounds the keys (a window reaching every key is causal)
    window = (32, 0) if quick else CPU_WINDOW
    extra = [dict(s=mid, causal=True), dict(s=mid, causal=True, mode="fwd+bwd"), dict(s=mid, window=window),
             dict(s=mid, docs=CPU_DOCS)]
    if quick:
        return [dict(s=sizes[0])] + extra[1:]
    # the feature rows right after the middle size, so a time budget cut lands on the largest sizes
    small = [dict(s=s) for s in sizes if s <= mid]
    return small + extra + [dict(s=s) for s in sizes if s > mid]

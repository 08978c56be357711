"""The recipe pools of the fuzzer (flashport/fuzz/cases.py says why recipes exist): per seed and size, a
pool of Recipes per entry point, each pinning what reaches a Triton / Gluon compile key, with the size
profiles (bounds, head dims, pages, pool sizes) they are drawn from.  Attributes are spread over a pool
stratified (`_spread`): every value of each list appears, in a random combination."""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Optional


# ----------------------------------------------------------------------------- size profiles
@dataclass(frozen=True)
class Profile:
    work: int                  # bound on B * Hq * Sq * Sk (varlen: Hq * sum(len_q * len_k))
    dropout_work: int          # tighter bound with dropout (the reference materialises the keep-mask)
    max_len: int
    max_b: int
    max_hq: int
    ratios: tuple              # Hq / Hkv
    dims: tuple                # (d, dv) pairs spread over the attention / varlen recipes
    kv_dims: tuple             # (d, dv) pairs of the kvcache and merge recipes
    pages: tuple               # paged-cache block sizes (0: a dense cache)
    kv_sq: tuple               # query lengths of the kvcache recipes (decode, speculative, chunked prefill)
    max_seqs: int
    pool: dict                 # recipes per entry point
    hopper: bool               # recipes for the Gluon kernels and their gates


SMALL = Profile(
    work=2 ** 15, dropout_work=2 ** 15, max_len=40, max_b=3, max_hq=8, ratios=(1, 2, 4),
    dims=((16, 16), (32, 32), (40, 40), (64, 64), (32, 16), (16, 40), (32, 32), (64, 64)),
    kv_dims=((16, 16), (32, 32), (40, 40), (64, 64), (32, 16)),
    pages=(0, 0, 1, 3, 4, 8, 16, 32), kv_sq=(1, 1, 1, 2, 3, 5, 8, 17, 128, 131), max_seqs=4,
    pool={"attention": 48, "varlen": 16, "kvcache": 24, "merge": 8}, hopper=False)

FULL = Profile(
    work=2 ** 25, dropout_work=2 ** 23, max_len=8192, max_b=4, max_hq=16, ratios=(1, 2, 4, 8),
    dims=((16, 16), (32, 32), (40, 40), (64, 64), (64, 64), (72, 72), (80, 80), (96, 96), (128, 128), (128, 128),
          (192, 192), (256, 256), (256, 256), (64, 128), (128, 64), (40, 24)),
    kv_dims=((64, 64), (128, 128), (128, 128), (40, 40), (80, 80), (256, 256), (32, 32), (128, 64)),
    pages=(0, 0, 0, 1, 7, 16, 64, 128, 256), kv_sq=(1, 1, 1, 1, 2, 4, 5, 8, 16, 37, 64, 128, 200, 1024), max_seqs=6,
    pool={"attention": 44, "varlen": 12, "kvcache": 24, "merge": 8}, hopper=True)

PROFILES = {"small": SMALL, "full": FULL}

_SPECIAL_FULL = (1, 3, 17, 113, 127, 128, 129, 255, 256, 257, 383, 384, 385, 511, 512, 513, 1000, 1023, 1024,
                 1025, 1500, 2047, 2048, 4095, 4096, 8191, 8192)
_SPECIAL_SMALL = (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 40)
# Lengths on both sides of the Hopper gates: the forward's 128-row tiles from 512 keys, the backward's
# 128-key tiles from 128 (and the Triton kernels' 1024 "short" / "long" boundary).
_GATE_M16 = (128, 256, 384, 512, 640, 1024, 1152)
_GATE_N16 = (127, 129, 255, 383, 385, 511, 513, 639, 641, 1023, 1025)
_MASKS = ("none", "causal", "both", "left", "right", "causal", "both", "none")
# (softcap, alibi, dropout_p) per recipe; the dropout threshold is an integer kernel argument, so p is
# part of the recipe (0.25 and 0.5 give thresholds divisible by 16, 0.1 and 0.8 do not)
_FEATURES = ((0.0, None, 0.0), (0.0, None, 0.0), (0.0, None, 0.0), (5.0, None, 0.0), (0.0, "head", 0.0),
             (0.0, "batch_head", 0.0), (0.0, None, 0.25), (0.0, None, 0.8), (2.0, "head", 0.0),
             (0.0, None, 0.0), (30.0, None, 0.1), (0.0, "batch_head", 0.5))
_LAYOUTS = ("contiguous", "contiguous", "contiguous", "contiguous", "padded8", "padded16", "transposed")
_PADS = {"contiguous": 0, "padded8": 8, "padded16": 16, "transposed": 0}


@dataclass(frozen=True)
class Recipe:
    """What one pool entry pins (everything that reaches a Triton / Gluon compile key)."""
    entry: str
    regime: str = "general"     # general | gluon_fwd | gluon_bwd | gate | decode | merge
    dtype: str = "float32"
    d: int = 64
    dv: int = 64
    hq: int = 1
    hkv: int = 1
    mask: str = "none"          # none | causal | both (left and right bounds) | left | right (right bound > 0)
    softcap: float = 0.0
    alibi: Optional[str] = None
    dropout_p: float = 0.0
    scale: str = "default"      # default | custom (> 0) | negative | zero
    layout: str = "contiguous"  # contiguous | padded8 | padded16 | transposed
    qclass: str = "n16"         # one (Sq = 1) | m16 (Sq % 16 == 0) | n16 (Sq odd > 1); varlen: total_q
    kv_sq: int = 1              # kvcache: Sq
    page: int = 0               # kvcache: page size (0 = dense)
    parts: int = 2              # merge: parts with keys
    empty_parts: int = 0        # merge: parts without keys
    split: str = "chunks"       # merge
    b: int = 0                  # kvcache, merge: the batch (0: drawn per case)
    cap_lo: int = 0             # kvcache: capacities in [cap_lo, 2 cap_lo) (the split count's octave)


def _wchoice(rng: random.Random, items):
    """items: ((value, weight), ...)."""
    total = sum(w for _, w in items)
    x = rng.random() * total
    for value, w in items:
        x -= w
        if x < 0:
            return value
    return items[-1][0]


def _log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(math.exp(rng.uniform(math.log(lo), math.log(hi + 0.999)))))))


def _spread(rng: random.Random, values, n: int) -> list:
    """n values cycling through `values` (each appears n // len times or one more), in random order."""
    vals = list(values)
    rng.shuffle(vals)
    out = (vals * (n // len(vals) + 1))[:n]
    rng.shuffle(out)
    return out


def _even_heads(d: int, dv: int, layout: str) -> bool:
    """Rows of d (+ pad) elements that are not a multiple of 16 make the sequence / batch strides' class
    depend on the head count's parity: such recipes keep even head counts (one class)."""
    pad = _PADS[layout]
    return (d + pad) % 16 != 0 or (dv + pad) % 16 != 0


def _heads_for(rng: random.Random, prof: Profile, ratio: int, even: bool) -> tuple[int, int]:
    choices = [h for h in ((2, 4) if even else (1, 1, 2, 3, 4)) if h * ratio <= prof.max_hq] or [1]
    hkv = rng.choice(choices)
    return hkv * ratio, hkv


def _general_recipes(rng: random.Random, prof: Profile, entry: str, n: int, dtypes) -> list:
    dims = _spread(rng, prof.dims, n)
    dts = _spread(rng, [d for d in ("bfloat16", "float16", "float32", "bfloat16", "float16") if d in dtypes], n)
    masks = _spread(rng, _MASKS, n)
    feats = _spread(rng, _FEATURES, n)
    layouts = _spread(rng, _LAYOUTS, n)
    ratios = _spread(rng, prof.ratios, n)
    qclasses = _spread(rng, ("n16", "m16", "n16", "m16", "n16", "one") if entry == "attention" else ("n16", "m16"), n)
    out = []
    for i in range(n):
        (d, dv), layout = dims[i], layouts[i]
        if layout == "transposed" and (d % 16 or dv % 16):
            layout = "contiguous"   # a transposed [B, S, H, D] with D % 16 != 0 has a stride per parity of B
        softcap, alibi, p = feats[i]
        u = rng.random()
        scale = "custom" if u < 0.2 else "negative" if u < 0.25 else "zero" if u < 0.28 else "default"
        hq, hkv = _heads_for(rng, prof, ratios[i], _even_heads(d, dv, layout))
        out.append(Recipe(entry=entry, dtype=dts[i], d=d, dv=dv, hq=hq, hkv=hkv, mask=masks[i], softcap=softcap,
                          alibi=alibi, dropout_p=p, scale=scale, layout=layout, qclass=qclasses[i]))
    return out


def _hopper_recipes(rng: random.Random, prof: Profile, dtypes) -> list:
    """Plain 16-bit contiguous calls of the shapes the Gluon kernels serve, and of their gates."""
    sixteen = [d for d in ("bfloat16", "float16") if d in dtypes]
    if not sixteen:
        return []
    out = []
    # (regime, head dim, mask): each Gluon kernel at its head dims, with and without the causal mask; both kernels'
    # two-part head dims (80, 96) and windows (Sq == Sk), which run on the Gluon kernels where
    # FLASHPORT_HOPPER_{FWD,BWD}_SPLIT / FLASHPORT_HOPPER_{FWD,BWD}_WINDOW are on and on the Triton ones otherwise
    plan = (("gluon_fwd", 128, "none"), ("gluon_fwd", 128, "causal"), ("gluon_fwd", 256, "none"),
            ("gluon_fwd", 256, "causal"), ("gluon_bwd", 64, "none"), ("gluon_bwd", 64, "causal"),
            ("gluon_bwd", 128, "none"), ("gluon_bwd", 128, "causal"),
            ("gate", 128, rng.choice(("none", "causal"))), ("gate", 64, rng.choice(("none", "causal"))),
            ("gluon_fwd", 96, rng.choice(("none", "causal"))), ("gluon_fwd", 80, rng.choice(("none", "causal"))),
            ("gluon_fwd", rng.choice((96, 128, 256)), rng.choice(("left", "both"))),
            ("gluon_bwd", rng.choice((64, 128)), rng.choice(("left", "right", "both"))),
            ("gluon_bwd", rng.choice((80, 96)), rng.choice(("none", "causal"))))
    dts = _spread(rng, sixteen, len(plan))
    for i, (regime, d, mask) in enumerate(plan):
        hq, hkv = _heads_for(rng, prof, rng.choice(prof.ratios), False)
        qclass = "m16" if regime == "gluon_fwd" else rng.choice(("n16", "m16"))
        out.append(Recipe(entry="attention", regime=regime, dtype=dts[i], d=d, dv=d, hq=hq, hkv=hkv, mask=mask,
                          qclass=qclass, scale="custom" if rng.random() < 0.25 else "default"))
    # ALiBi on the Gluon forward (FLASHPORT_HOPPER_FWD_ALIBI)
    hq, hkv = _heads_for(rng, prof, rng.choice(prof.ratios), False)
    d = rng.choice((96, 128))
    out.append(Recipe(entry="attention", regime="gluon_fwd", dtype=rng.choice(sixteen), d=d, dv=d, hq=hq, hkv=hkv,
                      mask=rng.choice(("none", "causal")), alibi=rng.choice(("head", "batch_head")), qclass="m16"))
    # and on the Gluon backward (FLASHPORT_HOPPER_BWD_ALIBI)
    hq, hkv = _heads_for(rng, prof, rng.choice(prof.ratios), False)
    d = rng.choice((64, 128))
    out.append(Recipe(entry="attention", regime="gluon_bwd", dtype=rng.choice(sixteen), d=d, dv=d, hq=hq, hkv=hkv,
                      mask=rng.choice(("none", "causal")), alibi=rng.choice(("head", "batch_head")),
                      qclass=rng.choice(("n16", "m16"))))
    return out


def _kv_recipes(rng: random.Random, prof: Profile, n: int, dtypes) -> list:
    """The decode kernel specialises its window bounds and split count (integers), and the split merge its
    BLOCK_P (a power of two >= the split count): a recipe pins the batch, the window's value class and
    an octave of capacities (so the split count stays within about a factor of two)."""
    dims = _spread(rng, prof.kv_dims, n)
    dts = _spread(rng, [d for d in ("bfloat16", "float16", "float32", "bfloat16", "float16") if d in dtypes], n)
    pages = _spread(rng, prof.pages, n)
    sqs = _spread(rng, prof.kv_sq, n)
    masks = _spread(rng, ("none", "causal", "causal", "both", "left", "right", "zero", "one_zero", "causal_left",
                          "none"), n)
    feats = _spread(rng, ((0.0, None), (0.0, None), (0.0, None), (5.0, None), (0.0, "head"), (0.0, "batch_head")), n)
    ratios = _spread(rng, prof.ratios, n)
    layouts = _spread(rng, ("contiguous", "contiguous", "contiguous", "padded8", "padded16"), n)
    out = []
    for i in range(n):
        d, dv = dims[i]
        hq, hkv = _heads_for(rng, prof, ratios[i], _even_heads(d, dv, layouts[i]))
        b = rng.randint(1, prof.max_b + 1)
        cap_lo = _log_uniform_int(rng, 1, prof.max_len // 2)
        while cap_lo > 1 and b * hq * sqs[i] * 2 * max(cap_lo, pages[i] * 3) > prof.work:
            cap_lo //= 2
        out.append(Recipe(entry="kvcache", regime="decode", dtype=dts[i], d=d, dv=dv, hq=hq, hkv=hkv, mask=masks[i],
                          softcap=feats[i][0], alibi=feats[i][1], layout=layouts[i], kv_sq=sqs[i], page=pages[i],
                          scale="custom" if rng.random() < 0.2 else "default", b=b, cap_lo=cap_lo))
    return out


def _merge_recipes(rng: random.Random, prof: Profile, n: int, dtypes) -> list:
    dims = _spread(rng, prof.kv_dims, n)
    dts = _spread(rng, [d for d in ("bfloat16", "float16", "float32") if d in dtypes], n)
    out = []
    for i in range(n):
        d, dv = dims[i]
        hq, hkv = _heads_for(rng, prof, rng.choice(prof.ratios), _even_heads(d, dv, "contiguous"))
        split = "chunks" if i % 3 != 2 else "subsets"
        out.append(Recipe(entry="merge", regime="merge", dtype=dts[i], d=d, dv=dv, hq=hq, hkv=hkv,
                          mask="causal" if split == "chunks" and i % 2 == 0 else "none",
                          softcap=5.0 if i % 4 == 3 else 0.0, qclass=("n16", "m16")[i % 2],
                          parts=rng.randint(1, 4), empty_parts=rng.choice((0, 1, 2)), split=split,
                          scale="custom" if rng.random() < 0.2 else "default", b=rng.randint(1, prof.max_b)))
    return out


@functools.lru_cache(maxsize=64)
def recipe_pool(seed: int, size: str, dtypes: tuple) -> dict:
    """{entry point: [Recipe]} of the run seeded by `seed` (a pure function of the arguments)."""
    prof = PROFILES[size]
    rng = random.Random(f"flashport-fuzz-pool/{seed}/{size}/{','.join(dtypes)}")
    pool = prof.pool
    hopper = _hopper_recipes(rng, prof, dtypes) if prof.hopper else []
    return {"attention": _general_recipes(rng, prof, "attention", pool["attention"] - len(hopper), dtypes) + hopper,
            "varlen": _general_recipes(rng, prof, "varlen", pool["varlen"], dtypes),
            "kvcache": _kv_recipes(rng, prof, pool["kvcache"], dtypes),
            "merge": _merge_recipes(rng, prof, pool["merge"], dtypes),
            "hopper": hopper}

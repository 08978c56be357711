"""The fuzzer's cases: a JSON-able description of one call of the contract, drawn from its own RNG.

`draw_case(seed, index, size, dtypes, entries)` is a pure function of its arguments: a `random.Random`
seeded by the string "flashport-fuzz/<seed>/<index>" (hashed by SHA-512: the same on every machine and
in every process); the tensors are drawn later from `FuzzCase.data_seed` (flashport/fuzz/execute.py).

Recipes.  A GPU run is dominated by Triton's JIT: every new specialisation of a kernel compiles, and a
specialisation is keyed by the constexprs (dtype, head dims, mask flags, softcap / ALiBi / dropout,
varlen, tile config, alignment) *and* by every integer argument's class (== 1, a multiple of 16, other):
the strides of lse / Delta (Sq, total_q), the GQA group, the ALiBi batch stride, the dropout threshold,
the KV cache's block-table stride, ...  Drawn freely, 5000 cases made ~7500 specialisations.  So each
seed has a pool of recipes (`recipe_pool`): a recipe pins everything that reaches a compile key, and a
case draws a recipe, then the rest freely within it (batch, Sk, the query length within its class
"one" / "m16" (multiples of 16, 128-multiples included) / "n16" (odd), window sizes within the mask
family, logit magnitude, scale value, grads / lse / determinism, varlen and cache lengths, pages in use,
...).  Recipe attributes are spread over the pool stratified (every head dim, dtype, mask family,
feature and layout of the size's lists appears), and another seed draws another pool.  B * Hq * Sq * Sk
stays under the size's `work` bound so the float64 reference stays cheap.

Weighted so each kernel variant gets its share: the Gluon (Hopper) forward and backward have their own
recipes (plain 16-bit calls at the head dims and lengths their gates accept), "gate" recipes draw
lengths on both sides of each gate, and the Triton configs (a function of head-dim bucket, dtype, mask
kind and length class) are reached by spreading those over the pool.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, fields
from typing import Optional

from .recipes import (_GATE_M16, _GATE_N16, _SPECIAL_FULL, _SPECIAL_SMALL, FULL, PROFILES, SMALL, Profile,  # noqa: F401
                      Recipe, _log_uniform_int, _wchoice, recipe_pool)

ENTRIES = ("attention", "varlen", "kvcache", "merge")
# Drawn only when named: "hopper" is attention calls from the Gluon kernels' recipes alone (their head dims, windows,
# ALiBi, two-part head dims and gates), so a GPU minute gives hundreds of hits on the Hopper paths, not dozens.
FOCUS_ENTRIES = ("hopper",)
DTYPE_NAMES = ("bfloat16", "float16", "float32")

# Gates of the Hopper kernels, copied here so that drawing a case never imports Triton (a case must be
# the same on a machine without it).  tests/gpu/test_fuzz_gpu.py checks them against the modules:
# attn_fwd_hopper.TILE / MIN_KEYS / MIN_KEYS_CAUSAL / TILES, attn_bwd_hopper.BLOCK_N / DEFAULT.
HOPPER_FWD_TILE = 128
HOPPER_FWD_MIN_KEYS = {64: 16384, 80: 512, 96: 512, 128: 512, 256: 512}   # D=64 starts past the length bound
HOPPER_BWD_BLOCK_N = 128
HOPPER_BWD_DIMS = (64, 80, 96, 128)


@dataclass
class FuzzCase:
    """One call.  Shapes per entry point:
    attention: q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv].
    varlen: `seqs` are (len_q, len_k) per sequence; `tail` NaN rows follow cu_seqlens[-1] in q and k/v;
        max_seqlen_* are the longest lengths + `max_extra`.
    kvcache: `seqs` are cache lengths before the append of `new` tokens (() with whole_cache: cache_seqlens
        None); `sk` is the capacity; `page` > 0 makes the cache paged (block size `page`, plus
        `spare_blocks` unused NaN blocks in the pool).
    merge: attention over `sk` keys cut into `parts` (sizes; 0 = a part with no keys: NaN output, lse
        -inf), "chunks" contiguous (causal through per-part windows) or "subsets" (random disjoint).
    logit: std of the scores softmax_scale * q.k (q and k scaled to give it).  layout: "contiguous",
    "padded" (row stride padded, NaN in the gap) or "transposed" (heads outer in memory)."""

    seed: int = 0
    index: int = 0
    entry: str = "attention"
    regime: str = "general"
    dtype: str = "float32"
    b: int = 1
    sq: int = 1
    sk: int = 1
    hq: int = 1
    hkv: int = 1
    d: int = 16
    dv: int = 16
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None
    dropout_p: float = 0.0
    scale: Optional[float] = None
    logit: float = 1.0
    layout: str = "contiguous"
    return_lse: bool = True
    grads: bool = False
    dlse: bool = False
    deterministic: bool = False
    seqs: tuple = ()
    tail: int = 0
    max_extra: int = 0
    new: int = 0
    page: int = 0
    spare_blocks: int = 0
    whole_cache: bool = False
    parts: tuple = ()
    split: str = "chunks"
    recipe: int = -1
    data_seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "FuzzCase":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "window" in kw:
            kw["window"] = tuple(kw["window"])
        if "seqs" in kw:
            kw["seqs"] = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in kw["seqs"])
        if "parts" in kw:
            kw["parts"] = tuple(kw["parts"])
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> "FuzzCase":
        return cls.from_dict(json.loads(text))

    def describe(self) -> str:
        """A short human label: entry, dtype, shape and features."""
        p = [self.entry, self.dtype.replace("float", "f").replace("bf", "bf")]
        if self.entry == "varlen":
            p.append("seqs" + "/".join(f"{a}x{b}" for a, b in self.seqs) + (f"+{self.tail}" if self.tail else ""))
        elif self.entry == "kvcache":
            p.append(f"b{self.b} sq{self.sq} cap{self.sk} new{self.new}" + (f" page{self.page}" if self.page else ""))
        else:
            p.append(f"b{self.b} sq{self.sq} sk{self.sk}")
        p.append(f"h{self.hq}/{self.hkv} d{self.d}" + (f"/{self.dv}" if self.dv != self.d else ""))
        if self.causal:
            p.append("causal")
        if tuple(self.window) != (-1, -1):
            p.append(f"win{tuple(self.window)}")
        if self.softcap:
            p.append(f"cap{self.softcap:g}")
        if self.alibi:
            p.append(f"alibi-{self.alibi}")
        if self.dropout_p:
            p.append(f"drop{self.dropout_p:g}")
        if self.scale is not None:
            p.append(f"scale{self.scale:.3g}")
        if self.layout != "contiguous":
            p.append(self.layout)
        if self.entry == "merge":
            p.append(f"parts{list(self.parts)}-{self.split}")
        p.append(f"logit{self.logit:.2g}")
        if self.grads:
            p.append("grads" + ("+dlse" if self.dlse else "") + ("+det" if self.deterministic else ""))
        if self.return_lse:
            p.append("lse")
        return " ".join(p)


# ----------------------------------------------------------------------------- per-case draws
def draw_length(rng: random.Random, prof: Profile, lo: int = 1) -> int:
    """A sequence length in [lo, prof.max_len]: odd sizes, multiples of 128 and their neighbours,
    the gates' lengths, and log-uniform."""
    if prof is SMALL:
        x = rng.choice(_SPECIAL_SMALL) if rng.random() < 0.4 else rng.randint(1, prof.max_len)
    else:
        u = rng.random()
        if u < 0.22:
            x = rng.randint(1, 64)
        elif u < 0.42:
            x = 128 * _log_uniform_int(rng, 1, prof.max_len // 128)
        elif u < 0.55:
            x = 128 * rng.randint(1, 16) + rng.choice((-1, 1))
        elif u < 0.75:
            x = rng.choice(_SPECIAL_FULL)
        else:
            x = _log_uniform_int(rng, 1, prof.max_len)
    return max(lo, min(prof.max_len, x))


def _in_class(x: int, qclass: str, hi: int) -> int:
    """x moved into its recipe's length class (one: 1; m16: a multiple of 16; n16: odd and > 1)."""
    if qclass == "one":
        return 1
    if qclass == "m16":
        return max(16, min(hi - hi % 16, x - x % 16))
    x = x | 1
    if x > hi:
        x -= 2
    return max(3, x)


def _query_length(rng: random.Random, prof: Profile, qclass: str) -> int:
    if qclass == "m16" and prof is FULL and rng.random() < 0.5:
        return 128 * _log_uniform_int(rng, 1, prof.max_len // 128)
    return _in_class(draw_length(rng, prof), qclass, prof.max_len)


def _window(rng: random.Random, c: FuzzCase, family: str, span: int, odd: bool = False) -> None:
    """causal / window_size within the recipe's mask family; bounds stay below span = Sq + Sk (a bound
    that reaches every key is folded to -1, which would change the kernel's flags).  odd: bounds other
    than 0 and -1 are odd and > 1 (the decode kernel specialises them: 1 and multiples of 16 are classes
    of their own), and "zero" / "one_zero" / "causal_left" are families of their own."""
    top = max(1, span - 1)

    def w(lo: int = 0) -> int:
        x = rng.choice((0, 1, 2, 3, 5, 8, 16, 31, 64, 127, 128, 200)) if rng.random() < 0.5 else rng.randint(0, top)
        x = max(lo, min(top, x))
        if odd:
            x = x | 1
            x = x if x > 1 else 3
            x = x if x <= top else max(1, top - 1 + top % 2)
        return x

    c.causal, c.window = False, (-1, -1)
    kind = family
    if family == "both" and not odd:
        kind = rng.choice(("both", "both", "zero", "one_zero", "causal_left"))
    if kind == "causal":
        c.causal = rng.random() < 0.7
        c.window = (-1, -1) if c.causal else (-1, 0)
    elif kind == "left":
        c.window = (w(), -1)
    elif kind == "right":
        c.window = (-1, w(1))
    elif kind == "zero":
        c.window, c.causal = (0, 0), rng.random() < 0.3
    elif kind == "one_zero":
        c.window, c.causal = (1, 0), rng.random() < 0.3
    elif kind == "causal_left":
        c.window, c.causal = (w(), 0 if odd else rng.choice((-1, 0))), True
    elif kind == "both":
        c.window = (w(), w())


def _scale(rng: random.Random, c: FuzzCase, kind: str) -> None:
    if kind == "custom":
        c.scale = round(c.d ** -0.5 * math.exp(rng.uniform(math.log(0.25), math.log(4.0))), 6)
    elif kind == "negative":
        c.scale = -round(c.d ** -0.5 * rng.uniform(0.5, 2.0), 6)
    elif kind == "zero":
        c.scale = 0.0


def _grad_options(rng: random.Random, c: FuzzCase, p_grads: float = 0.7) -> None:
    c.return_lse = rng.random() < 0.6
    c.grads = rng.random() < p_grads
    c.dlse = c.grads and c.return_lse and rng.random() < 0.3
    c.deterministic = c.grads and rng.random() < 0.25


def _apply(c: FuzzCase, r: Recipe, rng: random.Random) -> None:
    c.regime, c.dtype, c.d, c.dv, c.hq, c.hkv = r.regime, r.dtype, r.d, r.dv, r.hq, r.hkv
    c.alibi, c.dropout_p = r.alibi, r.dropout_p
    c.layout = r.layout
    if r.softcap:
        c.softcap = rng.choice((0.5, 1.0, 2.0, 5.0, 10.0, 30.0))
    _scale(rng, c, r.scale)
    c.logit = round(math.exp(rng.uniform(math.log(0.1), math.log(5.0))), 4)


def _fit_batch(rng: random.Random, c: FuzzCase, work: int, prof: Profile) -> None:
    """A batch size, and Sk (then Sq, within its class) shrunk while B * Hq * Sq * Sk > work."""
    c.b = rng.randint(1, prof.max_b)
    while c.b > 1 and c.b * c.hq * c.sq * c.sk > work:
        c.b -= 1
    while c.hq * c.sq * c.sk > work:
        if c.sk > 1 and (c.sk >= c.sq or c.sq <= 16):
            c.sk = max(1, c.sk // 2)
        else:
            c.sq = _in_class(c.sq // 2, "m16" if c.sq % 16 == 0 else "n16" if c.sq > 1 else "one", prof.max_len)


def _attention(rng, c: FuzzCase, r: Recipe, prof: Profile) -> None:
    if r.regime == "general":
        c.sq = _query_length(rng, prof, r.qclass)
        c.sk = c.sq if rng.random() < 0.4 else draw_length(rng, prof)
        if prof is SMALL and rng.random() < 0.03:    # no keys: zeros, lse -inf, zero grads
            c.sk = 0
        _grad_options(rng, c)
        _fit_batch(rng, c, prof.dropout_work if c.dropout_p else prof.work, prof)
        _window(rng, c, r.mask, c.sq + c.sk)
        return
    causal = r.mask == "causal"
    band = r.mask in ("left", "right", "both")   # the Gluon kernels' windows: Sq == Sk, drawn after the sizes
    square = causal or band
    if r.regime == "gluon_fwd":
        floor = HOPPER_FWD_MIN_KEYS[c.d] // HOPPER_FWD_TILE
        c.sq = HOPPER_FWD_TILE * _log_uniform_int(rng, floor, 32)
        c.sk = c.sq if square or rng.random() < 0.4 else HOPPER_FWD_TILE * _log_uniform_int(rng, floor, 64)
        _grad_options(rng, c, p_grads=0.5)
    elif r.regime == "gluon_bwd":
        lo = HOPPER_BWD_BLOCK_N
        c.sq = _in_class(rng.choice((lo * rng.randint(1, 16), rng.randint(lo, 2100))), r.qclass, prof.max_len)
        c.sk = c.sq if square or rng.random() < 0.4 else rng.choice((lo * rng.randint(1, 24), rng.randint(lo, 3000)))
        _grad_options(rng, c, p_grads=1.0)
        c.deterministic = False
    else:
        c.sq = rng.choice(_GATE_M16 if r.qclass == "m16" else _GATE_N16)
        c.sk = c.sq if causal or rng.random() < 0.5 else rng.choice(_GATE_M16 + _GATE_N16)
        _grad_options(rng, c, p_grads=0.6)
    c.causal = causal
    c.b = rng.randint(1, prof.max_b)
    while c.b > 1 and c.b * c.hq * c.sq * c.sk > prof.work:
        c.b -= 1
    # (the recipes' heads keep the largest Gluon shapes, 4096 x 8192 at B = Hq = 1, inside the bound;
    # otherwise the keys shrink by whole tiles)
    while c.hq * c.sq * c.sk > prof.work and c.sk > HOPPER_FWD_TILE:
        c.sk = c.sq if square else max(HOPPER_FWD_TILE, (c.sk // 2) - (c.sk // 2) % HOPPER_FWD_TILE)
        if square:
            c.sq = c.sk = max(HOPPER_FWD_TILE, (c.sq // 2) - (c.sq // 2) % 16)
    if band:
        _window(rng, c, r.mask, c.sq + c.sk)


def _varlen(rng, c: FuzzCase, r: Recipe, prof: Profile) -> None:
    n = rng.randint(1, prof.max_seqs)
    short = FULL.max_len // 4 if prof is FULL else prof.max_len
    seqs = []
    for _ in range(n):
        u = rng.random()
        lq = 0 if u < 0.1 else 1 if u < 0.2 else min(short, draw_length(rng, prof))
        lk = lq if rng.random() < 0.5 else (rng.choice((0, 1)) if rng.random() < 0.15 else
                                            min(short, draw_length(rng, prof)))
        seqs.append([lq, lk])
    work = prof.dropout_work if c.dropout_p else prof.work
    while c.hq * sum(a * b for a, b in seqs) > work:       # halve the longest sequence until it fits
        i = max(range(n), key=lambda j: seqs[j][0] * seqs[j][1])
        seqs[i] = [max(1, seqs[i][0] // 2), max(1, seqs[i][1] // 2)]
    # with dropout the exposed keep-mask is drawn densely, [B, Hq, max len_q, max len_k]: bound that too
    while c.dropout_p and n * c.hq * max(a for a, _ in seqs) * max(b for _, b in seqs) > work:
        for j in (max(range(n), key=lambda j: seqs[j][0]), max(range(n), key=lambda j: seqs[j][1])):
            seqs[j] = [max(1, seqs[j][0] // 2) if seqs[j][0] > 1 else seqs[j][0],
                       max(1, seqs[j][1] // 2) if seqs[j][1] > 1 else seqs[j][1]]
    c.seqs = tuple(tuple(s) for s in seqs)
    c.b = n
    c.sq, c.sk = max(s[0] for s in seqs), max(s[1] for s in seqs)
    # rows past cu_seqlens_q[-1]: the tail also puts total_q (lse's head stride) in the recipe's class
    nq = sum(s[0] for s in seqs)
    tail = rng.choice((0, 0, 1, 3, 17))
    if r.qclass == "m16":
        tail += (-(nq + tail)) % 16
    elif (nq + tail) % 2 == 0:
        tail += 1
    if nq + tail == 1:
        tail += 2
    c.tail = tail
    c.max_extra = 0 if rng.random() < 0.8 else rng.randint(1, 50)
    _window(rng, c, r.mask, min(c.sq + c.max_extra, nq + tail) + min(c.sk + c.max_extra, sum(s[1] for s in seqs)
                                                                    + tail))
    _grad_options(rng, c)


def _kvcache(rng, c: FuzzCase, r: Recipe, prof: Profile) -> None:
    c.sq, c.page, c.b = r.kv_sq, r.page, r.b
    c.new = 0 if rng.random() < 0.35 else c.sq if rng.random() < 0.7 else rng.randint(1, c.sq)
    cap = max(c.new, rng.randint(r.cap_lo, 2 * r.cap_lo - 1) if r.cap_lo > 1 else 1)
    if c.page:       # block-table rows of >= 2 pages, not a multiple of 16 (its stride's class)
        nblk = max(2, -(-cap // c.page))
        if nblk % 16 == 0:
            nblk += 1
        cap = nblk * c.page
        c.spare_blocks = rng.randint(1, 3)
    c.sk = cap
    c.whole_cache = c.new == 0 and rng.random() < 0.12
    if not c.whole_cache:
        lens = []
        for _ in range(c.b):
            v = rng.random()
            lens.append(0 if v < 0.1 else c.sk - c.new if v < 0.25 else rng.randint(0, c.sk - c.new))
        c.seqs = tuple(lens)
    _window(rng, c, r.mask, c.sq + c.sk, odd=True)
    c.return_lse = rng.random() < 0.6


def _merge(rng, c: FuzzCase, r: Recipe, prof: Profile) -> None:
    c.sq = _query_length(rng, prof, r.qclass)
    c.sk = max(r.parts, draw_length(rng, prof))
    c.b = r.b
    while c.b * c.hq * c.sq * c.sk > prof.work:
        if c.sk > max(r.parts, c.sq):
            c.sk = max(r.parts, c.sk // 2)
        else:
            c.sq = _in_class(c.sq // 2, r.qclass, prof.max_len)
    c.split, c.causal, c.return_lse = r.split, r.mask == "causal", True
    cuts = sorted(rng.sample(range(1, c.sk), r.parts - 1)) if r.parts > 1 else []
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [c.sk])]
    for _ in range(r.empty_parts):          # parts with no keys (NaN outputs, lse -inf)
        sizes.insert(rng.randint(0, len(sizes)), 0)
    c.parts = tuple(sizes)


_DRAW = {"attention": _attention, "varlen": _varlen, "kvcache": _kvcache, "merge": _merge, "hopper": _attention}
_ENTRY_WEIGHTS = {"attention": 0.55, "varlen": 0.17, "kvcache": 0.2, "merge": 0.08, "hopper": 0.55}


def draw_case(seed: int, index: int, size: str = "full", dtypes=DTYPE_NAMES, entries=ENTRIES) -> FuzzCase:
    """Case `index` of the run seeded by `seed`: a pure function of the arguments."""
    prof = PROFILES[size]
    dtypes = tuple(d for d in DTYPE_NAMES if d in set(dtypes))
    if not dtypes:
        raise ValueError("no dtype to draw from (float16, bfloat16, float32)")
    rng = random.Random(f"flashport-fuzz/{seed}/{index}")
    c = FuzzCase(seed=seed, index=index, data_seed=rng.getrandbits(62))
    unknown = set(entries) - set(ENTRIES + FOCUS_ENTRIES)
    if unknown or not entries:
        raise ValueError(f"entries must name some of {', '.join(ENTRIES + FOCUS_ENTRIES)}, got {sorted(entries)}")
    drawn = _wchoice(rng, tuple((e, _ENTRY_WEIGHTS[e]) for e in ENTRIES + FOCUS_ENTRIES if e in entries))
    pool = recipe_pool(seed, size, dtypes)[drawn]
    if not pool:
        raise ValueError(f"entries {drawn!r}: no recipes at size {size!r} for dtypes {list(dtypes)} (the Hopper "
                         "recipes need size 'full' and a 16-bit dtype)")
    c.entry = "attention" if drawn == "hopper" else drawn
    c.recipe = rng.randrange(len(pool))
    r = pool[c.recipe]
    _apply(c, r, rng)
    _DRAW[drawn](rng, c, r, prof)
    c.window = tuple(c.window)
    return c

"""Fuzzing the programmable calls: random mods from flashport.mods over random shapes, forward and gradients.

`draw(seed, index)` is a pure function of its arguments (a case: a dict of JSON-able fields); `run(case,
backend, device)` builds the tensors from the case's own seed, runs flashport.attention with the mods on
`backend` and the float64 reference, and applies the tolerance rule (flashport.check.rule_error) to the
output, lse and every gradient: q, k, v, a captured relative-position table and attn_bias.

    python -m flashport.fuzz.mods --n 300 --seed 7 --backend blockwise --device cuda
    TRITON_INTERPRET=1 python -m flashport.fuzz.mods --n 100 --backend triton --device cpu

A backend that serves part of the programmable features (its Capabilities' `mods` and `mod_grads`) is fuzzed on
that part: `served` turns the others off in each drawn case (--all-features keeps them, and such cases SKIP).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from .. import mods
from ..check import flash_extras, magnitude, rule_error
from ..backend.reference import materialized_attention
from ..programmable import build

MASKS = ("none", "causal", "window_sinks", "prefix_lm", "document", "block_sparse", "empty_rows")
ALL_MASKS = MASKS + ("band", "lambda")   # drawn apart, last (see draw)
# masks as users write them, without a block mask: mask_rules.band_of reads the bands among them as built-in windows
# (in the mask's own top-left positions: `causal` with Sq < Sk hides keys no bottom-right window can), the rest stay
# mask_mods
LAMBDAS = ("causal", "causal_bottom_right", "window", "symmetric", "ahead", "strict", "every_third")
SCORES = ("none", "alibi", "softcap", "rel_table")
BIAS = ("none", "full", "head_row", "key_only")


def draw(seed: int, index: int) -> dict:
    rng = random.Random(f"flashport-fuzz-mods/{seed}/{index}")
    hkv = rng.choice((1, 2))
    sq = rng.choice((1, 3, 17, 40, 64, 97))
    c = dict(seed=seed, index=index, data_seed=rng.randrange(2 ** 31), b=rng.choice((1, 2)), sq=sq,
                sk=rng.choice((sq, sq, 1, 33, 80)), hkv=hkv, hq=hkv * rng.choice((1, 2, 3)),
                d=rng.choice((8, 16, 40, 64)), dtype=rng.choice(("float32", "float16")),
                mask=rng.choice(MASKS), score=rng.choice(SCORES), bias=rng.choice(BIAS),
                causal=rng.random() < 0.25, block=rng.random() < 0.4, block_size=rng.choice((8, 16, 32)),
                window=rng.randint(1, 20), grad_table=rng.random() < 0.7, grad_bias=rng.random() < 0.7)
    # drawn last, so the fields above stay what earlier seeds drew: block masks that are built-in rules, which
    # backend=None runs as such -- a window (bottom-right, in absolute positions as users write it), packed
    # documents (a varlen call), prefix-LM or a window with sinks (two built-in calls)
    if rng.random() < 0.3:
        kind = rng.choice(("band", "document", "prefix_lm", "window_sinks"))
        if kind == "band":
            c.update(mask="band", band=(rng.choice((-1, 0, 1, 5, 17)), rng.choice((-1, 0, 2, 9))), block=True)
        else:   # documents, prefix-LM and sinks are rules of Sq = Sk (the prefix shorter than the sequence, no causal
            # flag)
            c.update(mask=kind, doc_causal=rng.random() < 0.5, block=True, sk=sq)
            if kind == "prefix_lm":
                c.update(window=rng.randint(1, max(1, sq - 1)), causal=False)
            if kind == "window_sinks":   # the declared rule serves it with its block mask or without one
                c.update(block=rng.random() < 0.5)
        if rng.random() < 0.7:
            c.update(score="none", bias="none")
    if rng.random() < 0.15:
        c.update(mask="lambda", lam=rng.choice(LAMBDAS), block=False)
        if rng.random() < 0.7:
            c.update(score="none", bias="none")
    if c["mask"] == "document" and c["sk"] == c["sq"] and rng.random() < 0.5:
        c.update(block=False)   # the ids mods.document declares: a varlen call without a block mask
    # state changed in place between two calls of one mod, which the memos must see: a lambda whose window lives in a
    # list it captures, called first with another window (mod_state), or mods.document's ids, first one document
    # (the documents read per ids version)
    c.update(stateful=(c["mask"] == "lambda" or c["mask"] == "document" and not c["block"]) and rng.random() < 0.5)
    return c


def _lambda_mask(name: str, sq: int, sk: int, w: list):
    """A user's mask_mod as a lambda; the windows read w[0], a Python value the caller may change in place."""
    off = sk - sq
    return {"causal": lambda b, h, i, j: i >= j,
            "causal_bottom_right": lambda b, h, i, j: i + off >= j,
            "window": lambda b, h, i, j: (i >= j) & (i - j <= w[0]),
            "symmetric": lambda b, h, i, j: (i - j).abs() <= w[0],
            "ahead": lambda b, h, i, j: (j - i <= w[0]) & (i - j <= w[0] // 2),
            "strict": lambda b, h, i, j: i > j,
            "every_third": lambda b, h, i, j: (i - j) % 3 == 0}[name]


def served(c: dict, backend: str) -> dict:
    """The case with the features `backend` does not declare turned off: attn_bias and block masks where its
    Capabilities.mods lacks them, a table without grad where it has no mod_grads."""
    from .. import dispatch
    caps = dispatch.get(backend).caps
    c = dict(c)
    if "attn_bias" not in caps.mods:
        c["bias"] = "none"
    if "block_mask" not in caps.mods:
        c["block"] = False
    if not caps.mod_grads:
        c["grad_table"] = False
    return c


def _band_mask(sq: int, sk: int, left: int, right: int):
    def mask(b, h, i, j):
        d = i + (sk - sq)
        return ((j >= d - left) | (left < 0)) & ((j <= d + right) | (right < 0))
    return mask


def _mods(c: dict, g: torch.Generator, device, window: list):
    sq, sk, hq = c["sq"], c["sk"], c["hq"]
    ids = torch.sort(torch.randint(0, 3, (max(sq, sk),), generator=g))[0].to(device)
    mask = {"none": None, "causal": mods.causal, "window_sinks": mods.sliding_window(c["window"], sinks=2),
            "prefix_lm": mods.prefix_lm(c["window"]),
            "document": mods.document(ids, causal=c.get("doc_causal", False)),
            "block_sparse": mods.block_sparse(-(-sq // 8), -(-sk // 8), block_size=8, density=0.4,
                                              seed=c["data_seed"], device=device),
            "empty_rows": lambda b, h, i, j: (i >= sq // 2) & (j <= i + h % 2),
            "band": _band_mask(sq, sk, *c.get("band", (-1, -1))),
            "lambda": _lambda_mask(c.get("lam", "causal"), sq, sk, window)}[c["mask"]]
    table = torch.randn(hq, 7, generator=g).to(device).requires_grad_(c["grad_table"])
    slopes = (torch.rand(hq, generator=g) * 0.5).to(device)
    score = {"none": None, "alibi": mods.alibi(slopes), "softcap": mods.tanh_softcap(2.5),
             "rel_table": mods.relative_position(table)}[c["score"]]
    shape = {"none": None, "full": (c["b"], hq, sq, sk), "head_row": (hq, sq, 1), "key_only": (sk,)}[c["bias"]]
    bias = None if shape is None else torch.randn(*shape, generator=g).to(device).requires_grad_(c["grad_bias"])
    return score, mask, bias, table, ids


def run(c: dict, backend: str | None = "blockwise", device="cpu") -> dict:
    """-> {"status": "PASS" | "FAIL" | "SKIP", "worst": ratio of error to bound, "problems": [...]}; backend None:
    auto's choice (each case's whole call, its input check included).  An exception other than a declared refusal
    is a FAIL naming it, so one broken case cannot hide the verdicts of the rest."""
    import flashport
    try:
        return _run(c, backend, device)
    except flashport.UnsupportedError as e:   # a declared refusal anywhere in the case (the block mask's too)
        return dict(status="SKIP", worst=0.0, problems=[" ".join(str(e).split())[:300]])
    except Exception as e:   # noqa: BLE001 -- the verdict, not the traceback, is what the fuzz reports
        return dict(status="FAIL", worst=float("inf"), problems=[f"raised {type(e).__name__}: "
                                                                 + " ".join(str(e).split())[:400]])


def _run(c: dict, backend: str | None, device: str) -> dict:
    import flashport
    g = torch.Generator().manual_seed(c["data_seed"])
    dtype = getattr(torch, c["dtype"])
    q, k, v = (torch.randn(c["b"], s, h, c["d"], generator=g).to(device, dtype).requires_grad_()
               for s, h in ((c["sq"], c["hq"]), (c["sk"], c["hkv"]), (c["sk"], c["hkv"])))
    do = torch.randn(c["b"], c["sq"], c["hq"], c["d"], generator=g).to(device, dtype)
    window = [c["window"] + 3 if c.get("stateful") else c["window"]]
    score, mask, bias, table, ids = _mods(c, g, device, window)
    case_ids = ids.clone()
    if c.get("stateful") and c["mask"] == "document":
        ids.zero_()                 # one document for the first call
    bm = None
    if c["block"] and mask is not None:
        bm = flashport.create_block_mask(mask, c["b"], c["hq"], c["sq"], c["sk"], device=device,
                                         block_size=c["block_size"])
        mask = None
    kw = dict(score_mod=score, mask_mod=mask, block_mask=bm, attn_bias=bias, causal=c["causal"])
    if c.get("stateful"):   # the first window traced and memoised, then the case's own set in place
        with torch.no_grad():
            flashport.attention(q, k, v, backend=backend, **kw)
        window[0] = c["window"]
        ids.copy_(case_ids)
    try:
        before = flashport.rewrites()
        out, lse = flashport.attention(q, k, v, backend=backend, return_lse=True, **kw)
        # the built-in calls backend=None made of the mods (flashport.rewrites counts them per rule)
        rewritten = [rule for rule, n in flashport.rewrites().items() if n > before[rule]]
    except flashport.UnsupportedError as e:   # a backend that declares what it cannot serve (flex: head dims)
        return dict(status="SKIP", worst=0.0, problems=[" ".join(str(e).split())[:300]])
    extra = [t for t, used in ((table, c["score"] == "rel_table"), (bias, bias is not None))
             if used and t.requires_grad]
    leaves = [q, k, v, *extra]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = flashport.attention(q64, k64, v64, backend="reference", return_lse=True, **kw)
    prog = build(score, mask, bm, bias, batch=c["b"], heads_q=c["hq"], sq=c["sq"], sk=c["sk"], device=q.device)
    low, _ = materialized_attention(q, k, v, scale=c["d"] ** -0.5, right=0 if c["causal"] else -1,
                                    compute_dtype=dtype, prog=prog)
    problems, worst = [], 0.0

    def check(name, got, want, lowp, factor, mag=None, extra=0.0):
        nonlocal worst
        err, bound = rule_error(got, want, lowp, dtype, factor, mag, extra)
        worst = max(worst, err / bound if bound > 0 else (0.0 if err == 0 else float("inf")))
        if not err <= bound:
            problems.append(f"{name}: error {err:.3e} > bound {bound:.3e}")

    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)):
        problems.append("lse: rows that see no key differ from the reference")
    got = torch.autograd.grad(out, leaves, do, allow_unused=True, materialize_grads=True)
    ref_leaves = [q64, k64, v64] + leaves[3:]
    want = torch.autograd.grad(ref, ref_leaves, do.double(), allow_unused=True, materialize_grads=True,
                               retain_graph=True)
    # the rounding every flash backward has and the math path lacks (Delta, recomputed P): flashport.check
    extras = flash_extras(ref, ref_lse, (q64, k64, v64), do, dtype, c["d"] ** -0.5, ref_grads=want, more=extra)
    check("out", out, ref, low, 2.0, extra=extras["out"])
    math = torch.autograd.grad(low, leaves, do, allow_unused=True, materialize_grads=True)
    mag = magnitude(q, k, v, do)
    terms = [extras["dq"], extras["dk"], extras["dv"], *extras["more"]]
    for name, a, b, m, e in zip(("dq", "dk", "dv", "d_extra1", "d_extra2"), got, want, math, terms):
        check(name, a, b, m, 3.0, mag, e)
    return dict(status="FAIL" if problems else "PASS", worst=worst, problems=problems, rewritten=rewritten)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=20261206)
    ap.add_argument("--backend", default="blockwise", help="a backend's name, or auto (backend=None)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--log", default=None, help="JSON lines: one case and its verdict per line")
    ap.add_argument("--all-features", action="store_true",
                    help="keep features the backend does not declare (those cases SKIP) instead of turning them off")
    a = ap.parse_args(argv)
    t0, fails, skips, counts = time.time(), 0, 0, {}
    log = open(a.log, "w") if a.log else None
    for i in range(a.n):
        c = draw(a.seed, i)
        backend = None if a.backend == "auto" else a.backend
        c = c if a.all_features or backend is None else served(c, backend)
        r = run(c, backend, a.device)
        fails += r["status"] == "FAIL"
        skips += r["status"] == "SKIP"
        for key in ("mask", "score", "bias"):
            counts[f"{key}={c[key]}"] = counts.get(f"{key}={c[key]}", 0) + 1
        if c["mask"] == "lambda":
            counts[f"lambda={c['lam']}"] = counts.get(f"lambda={c['lam']}", 0) + 1
        if c.get("stateful"):
            counts[f"stateful_{c['mask']}"] = counts.get(f"stateful_{c['mask']}", 0) + 1
        for rule in r.get("rewritten", ()):   # run as a built-in call (backend=None): flashport.rewrites' rules
            counts[f"as_builtin_{rule}"] = counts.get(f"as_builtin_{rule}", 0) + 1
        counts[f"block_mask={c['block'] and c['mask'] != 'none'}"] = counts.get(
            f"block_mask={c['block'] and c['mask'] != 'none'}", 0) + 1
        if log:
            log.write(json.dumps({**c, **r}) + "\n")
            log.flush()   # a run cut by its time limit keeps every case it finished
        if r["status"] == "FAIL":
            print(f"FAIL seed={a.seed} index={i}: {c} {r['problems']}", flush=True)
    print(f"mods fuzz: {a.n - fails - skips}/{a.n} PASS, {fails} FAIL, {skips} SKIP on {a.backend} ({a.device}), "
          f"seed {a.seed}, "
          f"{time.time() - t0:.1f} s; cases by feature: {dict(sorted(counts.items()))}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

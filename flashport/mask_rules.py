"""The built-in window a user's own mask_mod is, read off its code.

`flashport.mods` marks its ready-made masks with the rule they are (`builtin_rule`), so backend=None runs them as
built-in causal or windowed calls.  A user who writes the same mask as a lambda, as FlexAttention's documentation
does,

    lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 1024)

should not pay for a compiled mask (or, on a CPU, for evaluating it per tile) where the built-in rule says the
same.  `band_of` traces the mask_mod once (make_fx on index tensors, as the Triton kernels' mod compiler does) and
accepts exactly the masks it can prove are a band of the diagonal:

  * the graph reads q_idx and kv_idx only (never b or h, never a captured tensor), through integer linear forms
    (add, sub, neg, multiplication by an integer literal) and `abs`;
  * every comparison (>=, >, <=, <, ==, !=) is between forms whose difference depends on the positions only through
    d = q_idx - kv_idx: a * d + c, or |a * d + c| against a constant;
  * comparisons combine through and / or / xor / not (and the constant True / False that FlexAttention's
    `and_masks` / `or_masks` start from).

Such a mask is a function of d that is constant for |d| beyond every comparison's breakpoint, so evaluating it on
the d between those bounds decides it exactly; it is the built-in rule ("band", left, right) where the visible d
are one run that holds the diagonal (d = 0).  Anything else is None, and the call keeps its mask_mod.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .mod_state import fingerprint, same

MAX_REACH = 1 << 20        # the largest breakpoint evaluated (a window of a million keys); beyond: not recognised
MAX_SCALE = 1 << 16        # the largest coefficient of q_idx or kv_idx accepted (|values| stay far below 2**63)

_CMP = {"ge", "gt", "le", "lt", "eq", "ne"}
_BOOL = {"bitwise_and", "bitwise_or", "bitwise_xor", "logical_and", "logical_or", "logical_xor"}
_NOT = {"bitwise_not", "logical_not"}


@dataclass(frozen=True)
class _Lin:
    """aq * q_idx + akv * kv_idx + c."""
    aq: int
    akv: int
    c: int

    def __add__(self, o: "_Lin") -> "_Lin":
        return _Lin(self.aq + o.aq, self.akv + o.akv, self.c + o.c)

    def scale(self, k: int) -> "_Lin":
        return _Lin(self.aq * k, self.akv * k, self.c * k)

    @property
    def of_d(self) -> bool:   # a function of q_idx - kv_idx (a constant included)
        return self.aq == -self.akv


@dataclass(frozen=True)
class _Abs:
    """|form|, form a function of d: usable only against a constant."""
    form: _Lin


_BOOLEAN = "bool"


def _operand(a, val: dict):
    if hasattr(a, "op"):
        return val.get(a)
    if isinstance(a, int) and not isinstance(a, bool):
        return _Lin(0, 0, a)
    return a if isinstance(a, bool) else None


def _reach(gm) -> Optional[int]:
    """A bound R such that the graph's output is a bool function of d = q_idx - kv_idx alone that is constant for
    d > R and for d < -R; None where the graph is not of the accepted form."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 4:
        return None
    val = {placeholders[2]: _Lin(1, 0, 0), placeholders[3]: _Lin(0, 1, 0)}   # b, h: any use is refused
    reach = 0
    for n in nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            out = n.args[0]
            out = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
            return reach + 1 if val.get(out) == _BOOLEAN else None
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0] if n.op == "call_function" else ""
        if name in ("new_ones", "new_zeros") and len(n.args) == 2 and list(n.args[1]) == [] \
                and n.kwargs.get("dtype") == torch.bool:
            val[n] = name == "new_ones"   # FlexAttention's and_masks / or_masks start from b.new_ones / new_zeros
            continue
        if n.op != "call_function" or any(not isinstance(v, (int, bool)) for v in n.kwargs.values()):
            return None
        args = [_operand(a, val) for a in n.args]
        alpha = n.kwargs.get("alpha", 1)
        if any(a is None for a in args):
            return None
        if name in ("add", "sub", "rsub") and len(args) == 2 and all(isinstance(a, _Lin) for a in args):
            x, y = args if name != "rsub" else args[::-1]
            val[n] = x + y.scale(-alpha if name != "add" else alpha)
        elif name == "neg" and isinstance(args[0], _Lin):
            val[n] = args[0].scale(-1)
        elif name == "mul" and len(args) == 2 and all(isinstance(a, _Lin) for a in args):
            x, y = args
            if x.aq == x.akv == 0:
                val[n] = y.scale(x.c)
            elif y.aq == y.akv == 0:
                val[n] = x.scale(y.c)
            else:
                return None
        elif name == "abs" and isinstance(args[0], _Lin) and args[0].of_d:
            val[n] = _Abs(args[0])
        elif name in _CMP and len(args) == 2:
            x, y = args
            if isinstance(x, _Lin) and isinstance(y, _Lin):
                diff = x + y.scale(-1)          # a * d + c: its sign changes within |d| <= |c|
                if not diff.of_d:
                    return None
                reach = max(reach, abs(diff.c))
            elif isinstance(x, _Abs) or isinstance(y, _Abs):
                a, k = (x, y) if isinstance(x, _Abs) else (y, x)
                if not (isinstance(k, _Lin) and k.aq == k.akv == 0):
                    return None
                reach = max(reach, abs(a.form.c) + abs(k.c))   # |a d + c| crosses k within |d| <= |k| + |c|
            else:
                return None
            val[n] = _BOOLEAN
        elif name in _BOOL and len(args) == 2 and all(a == _BOOLEAN or isinstance(a, bool) for a in args):
            val[n] = _BOOLEAN
        elif name in _NOT and args[0] == _BOOLEAN:
            val[n] = _BOOLEAN
        else:
            return None
        if reach > MAX_REACH:
            return None
        lin = val[n]
        if isinstance(lin, _Lin) and (max(abs(lin.aq), abs(lin.akv)) > MAX_SCALE or abs(lin.c) > MAX_SCALE * MAX_REACH):
            # int64 math that could wrap is a function of the absolute positions, not of d alone
            return None
    return None


def _band(gm, reach: int) -> Optional[tuple]:
    """Evaluate the graph on d = -reach .. reach -> ("band", left, right), or None where the visible d are not one
    run holding 0."""
    d = torch.arange(-reach, reach + 1, dtype=torch.int64)
    zero = torch.zeros_like(d)
    try:
        with torch.no_grad():
            seen = gm(zero, zero, d + reach, torch.full_like(d, reach))
    except Exception:   # noqa: BLE001 - an optimisation must not fail the call: the mask_mod keeps serving it
        return None
    if not isinstance(seen, torch.Tensor) or seen.dtype != torch.bool or seen.shape != d.shape:
        return None
    where = torch.nonzero(seen).flatten()
    if where.numel() == 0:
        return None
    lo, hi = d[where[0]].item(), d[where[-1]].item()
    if where.numel() != hi - lo + 1 or not lo <= 0 <= hi:
        return None
    # Query i sees key j = i - d: j from i - hi to i - lo; reaching the evaluated edge means unbounded that way.
    return ("band", -1 if hi == reach else hi, -1 if lo == -reach else -lo)


def _recognise(mask_mod: Callable) -> Optional[tuple]:
    from .kernels.mod_codegen import _trace
    from .kernels.mod_ops import Refused
    try:
        gm = _trace(mask_mod, False, torch.device("cpu"))
    except Refused:
        return None
    reach = _reach(gm)
    return None if reach is None else _band(gm, reach)


# code (or the callable itself) -> (its fingerprint, rule): a training loop passes the same mask every step, often
# as a new lambda of the same code; tracing costs milliseconds.  Bounded.
_memo: OrderedDict = OrderedDict()
MEMO_SIZE = 64


def band_of(mask_mod: Callable) -> Optional[tuple]:
    """("band", left, right) in the mask_mod's own (top-left) positions, as `mods._rule` declares it, where the
    mask_mod provably is one; else None."""
    fp = fingerprint(mask_mod)   # what the trace read beyond the code, by value (mod_state)
    key = fp[0] if fp and fp[0] is not None else mask_mod
    hit = _memo.get(key)
    if hit is not None and same(hit[0][1:], fp[1:]):
        _memo.move_to_end(key)
        return hit[1]
    rule = _recognise(mask_mod)
    _memo[key] = (fp, rule)
    while len(_memo) > MEMO_SIZE:
        _memo.popitem(last=False)
    return rule

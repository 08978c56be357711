"""Compiling score_mod / mask_mod into @triton.jit functions the attention kernels apply at their score stage.

A mod is traced once with make_fx on [1, 1, 1, 1] index tensors (score float32, b / h / q_idx / kv_idx int64)
into an aten graph; a whitelist of elementwise aten ops becomes the body of a generated jit function

    score_mod(score, b, h, q_idx, kv_idx, cap) -> float32     (natural units, as the user wrote it)
    score_grad(score, b, h, q_idx, kv_idx, cap) -> float32    d score_mod / d score at the same point
    mask_mod(b, h, q_idx, kv_idx, cap) -> bool

whose index arguments broadcast ([BLOCK_M, 1] x [1, BLOCK_N] tiles, or transposed; b and h are scalars).
Tensors the mods read (captured: tables, document ids, slopes) travel in `cap`, a flat tuple of
(pointer, strides..., sizes...) per tensor; indexing one clamps every index into its dimension (negative indices
wrap first, as in PyTorch), so no load ever leaves the tensor, whatever the tile's out-of-range rows read.
The generated source is written to <cache dir>/mods/ and imported (Triton needs real source), and memoised by
that source: it depends only on the graph and the captured tensors' dtypes and ranks, so changing B, S or a
captured tensor's values never generates (or compiles) a new function.  Python numbers inside a mod are part of
its code; capture a 0-d tensor to vary one without a recompile.

Anything outside the whitelist gives a reason string instead (the triton backend refuses with it).
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

MAX_CAPTURED = 8       # captured tensors one call's mods may read (each is 1 + 2 * rank entries of the `cap` tuple)
MAX_RANK = 4
# Counters of the generated-function cache: "generated" counts sources written and imported (cache misses),
# "hits" reuses; tests read them to check that new shapes or values generate nothing.
stats: Counter = Counter()

_TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
       torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
       torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}


class Refused(Exception):
    """A mod the compiler does not handle; the message is the reason."""


# ----------------------------------------------------------------------------- tracing
def _index_args(with_score: bool, device) -> tuple:
    # distinct tensor objects: make_fx identifies inputs by identity, and four references to one tensor
    # would trace as one placeholder
    idx = tuple(torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device) for _ in range(4))
    return ((torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=device),) if with_score else ()) + idx


def _trace(fn: Callable, with_score: bool, device, grad: bool = False):
    """make_fx graph of fn (or of d fn / d score when grad) on index tensors of the call's device (where its
    captured tensors live), or Refused."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def score_grad(score, b, h, q_idx, kv_idx):
        s = score.detach().requires_grad_()
        with torch.enable_grad():
            y = fn(s, b, h, q_idx, kv_idx)
            (g,) = torch.autograd.grad(y, (s,), torch.ones_like(y), allow_unused=True, materialize_grads=True)
        return g

    target = score_grad if grad else fn
    try:
        with torch.no_grad() if not grad else torch.enable_grad():
            return make_fx(target, tracing_mode="real")(*_index_args(with_score, device))
    except RuntimeError as e:
        text = str(e)
        if "data-dependent" in text or "_local_scalar_dense" in text:
            raise Refused("data-dependent Python control flow or a tensor read as a Python value "
                          "(if / int() / .item() on a traced tensor)") from e
        raise Refused(f"tracing failed: {type(e).__name__}: {text.splitlines()[0][:200]}") from e
    except Exception as e:  # noqa: BLE001 - whatever the user's code raises becomes the reason
        raise Refused(f"tracing failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from e


# ----------------------------------------------------------------------------- code generation
def _lit(x) -> str:
    if isinstance(x, bool):
        return "True" if x else "False"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return 'float("nan")'
        if math.isinf(x):
            return 'float("inf")' if x > 0 else 'float("-inf")'
        return repr(x)
    raise Refused(f"constant {x!r} of type {type(x).__name__}")


def _dtype(node) -> torch.dtype:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise Refused(f"{node.target} produced a {type(val).__name__}, not a tensor")
    return val.dtype


class _Gen:
    """Translates one graph into lines of a jit function body.  `captured` lists the call's captured tensors in
    slot order; the score and mask functions of a call share it, so that both read one `cap` tuple."""

    def __init__(self, gm, captured: list, names: tuple):
        self.gm = gm
        self.captured = captured       # [(tensor)], the call's captured tensors in slot order (appended to)
        self.lines: list = []
        self.env: dict = {}            # node -> expression (a name or literal)
        self.dtypes: dict = {}         # node -> torch dtype (None for Python literals)
        self.tile: dict = {}           # node -> set of tile axes it varies along ("i", "j")
        self.names = names

    # -- operands
    def arg(self, a):
        if hasattr(a, "op"):
            if a not in self.env:
                t = self.constant(a)
                raise Refused(f"a captured tensor of shape {tuple(t.shape)} used whole (index it, or capture a "
                              f"0-d tensor)")
            return self.env[a]
        if isinstance(a, (list, tuple)):
            raise Refused(f"a list argument {a!r}")
        return _lit(a)

    def dt(self, a):
        return self.dtypes.get(a) if hasattr(a, "op") else None

    def axes(self, *args) -> set:
        out = set()
        for a in args:
            if hasattr(a, "op"):
                out |= self.tile[a]
            elif isinstance(a, (list, tuple)):
                out |= self.axes(*a)
        return out

    def cast(self, a, dtype: torch.dtype) -> str:
        """Operand a as dtype (literals stay Python numbers, which Triton types like PyTorch's scalars)."""
        e = self.arg(a)
        if not hasattr(a, "op") or self.dt(a) == dtype:
            return e
        if dtype == torch.bool:
            return f"({e} != 0)"
        return f"{e}.to({_TL[dtype]})"

    def emit(self, node, expr: str, dtype: torch.dtype, axes: set) -> None:
        name = f"v{len(self.env)}"
        self.lines.append(f"    {name} = {expr}")
        self.env[node] = name
        self.dtypes[node] = dtype
        self.tile[node] = axes

    # -- captured tensors
    def slot(self, t: torch.Tensor) -> tuple:
        for n, c in enumerate(self.captured):
            if c is t:
                break
        else:
            if t.dim() > MAX_RANK:
                raise Refused(f"a captured tensor of rank {t.dim()} (at most {MAX_RANK})")
            if t.dtype not in _TL:
                raise Refused(f"a captured tensor of dtype {t.dtype}")
            if t.numel() >= 2 ** 31:     # the kernels index captured tensors in int32
                raise Refused(f"a captured tensor of {t.numel()} elements (at most 2**31 - 1)")
            if len(self.captured) == MAX_CAPTURED:
                raise Refused(f"more than {MAX_CAPTURED} captured tensors")
            self.captured.append(t)
            n = len(self.captured) - 1
        base = sum(1 + 2 * c.dim() for c in self.captured[:n])
        return base, t.dim()

    def constant(self, node) -> torch.Tensor:
        if node.op == "get_attr":
            return getattr(self.gm, node.target)
        if node.op == "call_function" and _name(node) in ("lift_fresh_copy", "detach", "alias", "clone"):
            return self.constant(node.args[0])
        raise Refused(f"indexing a tensor the mod computed ({node.target}); only captured tensors can be indexed")

    def run(self) -> tuple:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.names):
            raise Refused(f"expected {len(self.names)} arguments, traced {len(placeholders)}")
        for node, name in zip(placeholders, self.names):
            self.env[node] = name
            self.dtypes[node] = torch.float32 if name == "score" else torch.int32
            self.tile[node] = {"score": {"i", "j"}, "q_idx": {"i"}, "kv_idx": {"j"}}.get(name, set())
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":
                t = getattr(self.gm, node.target)
                if t.dim() == 0 and _made_by_the_mod(node):
                    # torch.tensor(x) inside the mod: a literal of its code (each trace makes a new tensor)
                    self.emit(node, f"tl.full([], {_lit(t.item())}, {_TL[t.dtype]})", t.dtype, set())
                elif t.dim() == 0:   # a captured 0-d tensor is a value: one scalar load
                    _zero_d(self, node, t)
                continue             # others are read through aten.index
            if node.op != "call_function":
                raise Refused(f"graph node {node.op} {node.target}")
            _op(self, node)
        (out,) = [n for n in self.gm.graph.nodes if n.op == "output"]
        res = out.args[0]
        if isinstance(res, (list, tuple)):
            if len(res) != 1:
                raise Refused("the mod returned several values")
            res = res[0]
        if not hasattr(res, "op"):
            raise Refused(f"the mod returned {res!r}, not a tensor")
        return res


def _made_by_the_mod(node) -> bool:
    """make_fx lifts a tensor created during the trace (torch.tensor inside the mod) through lift_fresh_copy; a
    tensor the mod closes over is read directly."""
    return bool(node.users) and all(_name(u) == "lift_fresh_copy" for u in node.users)


def _name(node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _overload(node) -> str:
    return getattr(node.target, "_overloadname", "")


def _result(g: _Gen, node) -> torch.dtype:
    return _dtype(node)


def _binary(op: str):
    def gen(g: _Gen, node):
        a, b = node.args[:2]
        rt = _result(g, node)
        alpha = node.kwargs.get("alpha", 1)
        if rt.is_floating_point:
            ea, eb = g.cast(a, rt), g.cast(b, rt)
        else:
            ea, eb = g.arg(a), g.arg(b)
        if alpha != 1:
            eb = f"({eb} * {_lit(alpha)})"
        g.emit(node, f"({ea} {op} {eb})", rt, g.axes(a, b))
    return gen


def _rsub(g: _Gen, node):
    a, b = node.args[:2]
    rt = _result(g, node)
    alpha = node.kwargs.get("alpha", 1)
    ea = g.cast(a, rt) if rt.is_floating_point else g.arg(a)
    ea = ea if alpha == 1 else f"({ea} * {_lit(alpha)})"
    g.emit(node, f"({g.cast(b, rt) if rt.is_floating_point else g.arg(b)} - {ea})", rt, g.axes(a, b))


def _true_div(g: _Gen, node):
    a, b = node.args[:2]
    rt = _result(g, node)
    mode = node.kwargs.get("rounding_mode")
    if mode is None:
        g.emit(node, f"({g.cast(a, rt)} / {g.cast(b, rt)})", rt, g.axes(a, b))
        return
    if rt.is_floating_point:
        raise Refused(f"division with rounding_mode={mode!r} of floating tensors")
    (_floor_div if mode == "floor" else _trunc_div)(g, node)


def _trunc_div(g: _Gen, node):
    a, b = node.args[:2]
    g.emit(node, f"({g.arg(a)} // {g.arg(b)})", _result(g, node), g.axes(a, b))   # Triton's // truncates


def _floor_div(g: _Gen, node):
    a, b = node.args[:2]
    rt = _result(g, node)
    if rt.is_floating_point:
        raise Refused("floor division of floating tensors")
    ea, eb = g.arg(a), g.arg(b)
    # Triton's integer // and % truncate towards zero (C); PyTorch floors: one step down where the signs differ
    g.emit(node, f"floor_div({ea}, {eb})", rt, g.axes(a, b))


def _remainder(g: _Gen, node):
    a, b = node.args[:2]
    rt = _result(g, node)
    if rt.is_floating_point:
        raise Refused("remainder of floating tensors")
    g.emit(node, f"floor_mod({g.arg(a)}, {g.arg(b)})", rt, g.axes(a, b))


def _compare(op: str):
    def gen(g: _Gen, node):
        a, b = node.args[:2]
        dts = [d for d in (g.dt(a), g.dt(b)) if d is not None]
        common = dts[0] if len(dts) == 1 else torch.promote_types(*dts) if dts else None
        if common is not None and common.is_floating_point:
            ea, eb = g.cast(a, common), g.cast(b, common)
        else:
            ea, eb = g.arg(a), g.arg(b)
        g.emit(node, f"({ea} {op} {eb})", torch.bool, g.axes(a, b))
    return gen


def _bitwise(op: str):
    def gen(g: _Gen, node):
        a, b = node.args[:2]
        rt = _result(g, node)
        if rt == torch.bool:
            ea, eb = g.cast(a, torch.bool), g.cast(b, torch.bool)
        else:
            ea, eb = g.arg(a), g.arg(b)
        g.emit(node, f"({ea} {op} {eb})", rt, g.axes(a, b))
    return gen


def _logical(op: str):
    def gen(g: _Gen, node):
        a, b = node.args[:2]
        g.emit(node, f"({g.cast(a, torch.bool)} {op} {g.cast(b, torch.bool)})", torch.bool, g.axes(a, b))
    return gen


def _unary(template: str, float_only: bool = False):
    def gen(g: _Gen, node):
        (a,) = node.args[:1]
        rt = _result(g, node)
        if float_only and not rt.is_floating_point:
            raise Refused(f"{_name(node)} of a {rt} tensor")
        x = g.cast(a, rt) if rt.is_floating_point else g.arg(a)
        g.emit(node, template.format(x=x, t=_TL[rt]), rt, g.axes(a))
    return gen


def _not(g: _Gen, node):
    (a,) = node.args[:1]
    rt = _result(g, node)
    g.emit(node, f"({g.cast(a, torch.bool)} == 0)" if rt == torch.bool else f"(~{g.arg(a)})", rt, g.axes(a))


def _where(g: _Gen, node):
    c, a, b = node.args[:3]
    rt = _result(g, node)
    g.emit(node, f"tl.where({g.cast(c, torch.bool)}, {g.cast(a, rt)}, {g.cast(b, rt)})", rt, g.axes(c, a, b))


def _masked_fill(g: _Gen, node):
    x, m, v = node.args[:3]
    rt = _result(g, node)
    g.emit(node, f"tl.where({g.cast(m, torch.bool)}, {g.cast(v, rt)}, {g.cast(x, rt)})", rt, g.axes(x, m, v))


def _minmax(fn: str):
    def gen(g: _Gen, node):
        a, b = node.args[:2]
        rt = _result(g, node)
        g.emit(node, f"tl.{fn}({g.cast(a, rt)}, {g.cast(b, rt)})", rt, g.axes(a, b))
    return gen


def _clamp(g: _Gen, node):
    x = node.args[0]
    name = _name(node)
    lo = node.args[1] if name in ("clamp", "clamp_min") and len(node.args) > 1 else node.kwargs.get("min")
    hi = (node.args[2] if name == "clamp" and len(node.args) > 2 else node.args[1] if name == "clamp_max"
          else node.kwargs.get("max"))
    rt = _result(g, node)
    e = g.cast(x, rt)
    if lo is not None:
        e = f"tl.maximum({e}, {g.cast(lo, rt)})"
    if hi is not None:
        e = f"tl.minimum({e}, {g.cast(hi, rt)})"
    g.emit(node, e, rt, g.axes(x, lo, hi))


def _pow(g: _Gen, node):
    x, p = node.args[:2]
    rt = _result(g, node)
    if hasattr(p, "op") or p not in (0, 1, 2, 3, 4, -1, 0.5, -0.5):
        raise Refused(f"pow with exponent {p!r} (integers -1..4 and +-0.5 are compiled)")
    e = g.cast(x, rt)
    forms = {0: f"({e} * 0 + 1)", 1: e, 2: f"({e} * {e})", 3: f"({e} * {e} * {e})", 4: f"(({e} * {e}) * ({e} * {e}))",
             -1: f"(1.0 / {e})", 0.5: f"tl.sqrt_rn({e})", -0.5: f"(1.0 / tl.sqrt_rn({e}))"}
    g.emit(node, forms[p], rt, g.axes(x))


def _to_copy(g: _Gen, node):
    (a,) = node.args[:1]
    rt = _result(g, node)
    if rt not in _TL:
        raise Refused(f"conversion to {rt}")
    g.emit(node, g.cast(a, rt), rt, g.axes(a))


def _identity(g: _Gen, node):
    a = node.args[0]
    if hasattr(a, "op") and a not in g.env and a.op == "get_attr":
        return               # a lifted copy of a captured tensor: aten.index reads it through g.constant
    g.env[node], g.dtypes[node], g.tile[node] = g.arg(a), g.dtypes[a], g.tile[a]


def _zero_d(g: _Gen, node, t: torch.Tensor):
    if t.dim() != 0:
        raise Refused(f"a captured tensor of shape {tuple(t.shape)} used whole (index it, or capture a 0-d tensor)")
    base, _ = g.slot(t)
    g.emit(node, f"tl.load(cap[{base}])", t.dtype, set())


def _fill(g: _Gen, node):
    """ones_like / zeros_like / full_like / scalar_tensor / full([]): a constant of the result's dtype."""
    name = _name(node)
    value = {"ones_like": 1, "zeros_like": 0}.get(name)
    if value is None:
        value = node.args[1] if name in ("full_like", "full") else node.args[0]
    if name == "full" and list(node.args[0]) not in ([], [1], [1, 1], [1, 1, 1], [1, 1, 1, 1]):
        raise Refused(f"aten.full of shape {node.args[0]}")
    rt = _result(g, node)
    g.emit(node, f"tl.full([], {_lit(value)}, {_TL[rt]})", rt, set())


def _index(g: _Gen, node):
    src, indices = node.args[:2]
    t = g.constant(src)
    if len(indices) != t.dim() or any(i is None for i in indices):
        raise Refused(f"indexing a captured tensor of rank {t.dim()} with {len(indices)} index tensors "
                      "(give one index per dimension: slices are not elementwise)")
    for ix in indices:
        if not hasattr(ix, "op") or g.dt(ix) in (None, torch.bool) or g.dt(ix).is_floating_point:
            raise Refused("indexing a captured tensor by anything but integer index tensors")
    base, rank = g.slot(t)
    terms = []
    for d, ix in enumerate(indices):
        stride, size = f"cap[{base + 1 + d}]", f"cap[{base + 1 + rank + d}]"
        terms.append(f"clamp_index({g.arg(ix)}, {size}) * {stride}")
    g.emit(node, f"tl.load(cap[{base}] + {' + '.join(terms)})", t.dtype, g.axes(*indices))


def _backward(template: str):
    def gen(g: _Gen, node):
        a, b = node.args[:2]
        rt = _result(g, node)
        g.emit(node, template.format(g=g.cast(a, rt), y=g.cast(b, rt)), rt, g.axes(a, b))
    return gen


def _threshold_backward(g: _Gen, node):
    grad, x, thr = node.args[:3]
    rt = _result(g, node)
    g.emit(node, f"tl.where({g.arg(x)} <= {_lit(thr)}, 0.0, {g.cast(grad, rt)}).to({_TL[rt]})", rt, g.axes(grad, x))


def _sign(g: _Gen, node):
    (a,) = node.args[:1]
    rt = _result(g, node)
    x = g.arg(a)
    g.emit(node, f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({_TL[rt]})", rt, g.axes(a))


_OPS = {
    "add": _binary("+"), "sub": _binary("-"), "mul": _binary("*"), "rsub": _rsub,
    "div": _true_div, "floor_divide": _floor_div, "remainder": _remainder,
    "eq": _compare("=="), "ne": _compare("!="), "lt": _compare("<"), "le": _compare("<="), "gt": _compare(">"),
    "ge": _compare(">="),
    "bitwise_and": _bitwise("&"), "bitwise_or": _bitwise("|"), "bitwise_xor": _bitwise("^"),
    "logical_and": _logical("&"), "logical_or": _logical("|"), "logical_xor": _logical("^"),
    "bitwise_not": _not, "logical_not": _not,
    "neg": _unary("(-{x})"), "abs": _unary("tl.abs({x})"), "relu": _unary("tl.maximum({x}, 0)"),
    "exp": _unary("tl.exp({x})", True), "exp2": _unary("tl.exp2({x})", True), "log": _unary("tl.log({x})", True),
    "log2": _unary("tl.log2({x})", True), "sqrt": _unary("tl.sqrt_rn({x})", True),
    "rsqrt": _unary("(1.0 / tl.sqrt_rn({x}))", True), "sigmoid": _unary("tl.sigmoid({x})", True),
    "tanh": _unary("tanh({x}.to(tl.float32), True).to({t})", True), "sin": _unary("tl.sin({x})", True),
    "cos": _unary("tl.cos({x})", True), "sgn": _sign, "sign": _sign,
    "where": _where, "masked_fill": _masked_fill, "minimum": _minmax("minimum"), "maximum": _minmax("maximum"),
    "clamp": _clamp, "clamp_min": _clamp, "clamp_max": _clamp, "pow": _pow,
    "_to_copy": _to_copy, "detach": _identity, "alias": _identity, "clone": _identity, "lift_fresh_copy": _identity,
    "expand": _identity,
    "ones_like": _fill, "zeros_like": _fill, "full_like": _fill, "scalar_tensor": _fill, "full": _fill,
    "index": _index,
    "tanh_backward": _backward("({g} * (1.0 - {y} * {y}))"),
    "sigmoid_backward": _backward("({g} * {y} * (1.0 - {y}))"),
    "threshold_backward": _threshold_backward,
}


def _op(g: _Gen, node) -> None:
    name = _name(node)
    fn = _OPS.get(name)
    if fn is None and name.endswith("_") and not name.startswith("_") and name[:-1] in _OPS:
        # An in-place op (autograd's formulas use some: clamp's logical_and_, maximum's masked_fill_): its functional
        # form, and later reads of the tensor it mutated see the new value.
        _OPS[name[:-1]](g, node)
        self_ = node.args[0]
        g.env[self_], g.dtypes[self_], g.tile[self_] = g.env[node], g.dtypes[node], g.tile[node]
        return
    if fn is None:
        raise Refused(f"aten.{name} is outside what the Triton mod compiler handles (elementwise arithmetic, "
                      "comparisons, logic, where, clamp, exp / log / tanh / sigmoid and indexing captured tensors)")
    fn(g, node)


HEADER = '''"""Generated by flashport.kernels.mod_codegen from a traced {what}; do not edit (key {key})."""
import triton
import triton.language as tl

from flashport.kernels.common import clamp_index, floor_div, floor_mod, tanh

'''


def _source(g: _Gen, res, kind: str) -> str:
    args = ", ".join(g.names)
    body = "\n".join(g.lines)
    out = g.env[res]
    if kind == "mask":
        ret = g.cast(res, torch.bool)
    else:
        ret = f"{out}.to(tl.float32)" if g.dtypes[res] != torch.float32 else out
        if g.tile[res] != {"i", "j"}:   # a result constant along a tile axis still fills the tile
            ret = f"({ret} + tl.zeros_like(score))"
    return f"@triton.jit\ndef {kind}_fn({args}, cap):\n{body}\n    return {ret}\n"


def _generate(gm, captured: list, kind: str) -> str:
    names = ("b", "h", "q_idx", "kv_idx") if kind == "mask" else ("score", "b", "h", "q_idx", "kv_idx")
    gm.graph.eliminate_dead_code()   # the gradient's trace keeps the forward's unused values
    g = _Gen(gm, captured, names)
    res = g.run()
    if kind == "mask" and g.dtypes[res] != torch.bool:
        raise Refused(f"mask_mod returned {g.dtypes[res]}, not bool")
    return _source(g, res, kind)


# ----------------------------------------------------------------------------- loading the generated source
_loaded: dict = {}      # source key -> JITFunction


def _cache_dir() -> str:
    from .. import env
    path = os.path.join(env.cache_dir(), "mods")
    try:
        os.makedirs(path, exist_ok=True)
        return path
    except OSError:     # a read-only home: the process's temp dir serves
        path = os.path.join(tempfile.gettempdir(), "flashport-mods")
        os.makedirs(path, exist_ok=True)
        return path


def load(body: str, kind: str):
    """The jit function of a generated body (memoised by its text; written once to the cache dir)."""
    key = hashlib.sha256(body.encode()).hexdigest()[:20]
    fn = _loaded.get(key)
    if fn is not None:
        stats["hits"] += 1
        return fn
    stats["generated"] += 1
    text = HEADER.format(what=kind, key=key) + body
    path = os.path.join(_cache_dir(), f"flashport_mod_{key}.py")
    if not (os.path.exists(path) and open(path).read() == text):
        tmp = f"{path}.{os.getpid()}.tmp"       # written whole, then renamed: concurrent processes never see half
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    name = f"flashport_mod_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module            # Triton reads the function's source through its module
    spec.loader.exec_module(module)
    fn = _loaded[key] = getattr(module, f"{kind}_fn")
    return fn


# ----------------------------------------------------------------------------- the entry point
@dataclass(frozen=True)
class CompiledMods:
    """The generated functions of one call's mods and the tensors they read (slot order of `cap`)."""

    score: Optional[Callable] = None
    score_grad: Optional[Callable] = None
    mask: Optional[Callable] = None
    captured: tuple = ()

    def cap(self) -> Optional[tuple]:
        """The kernels' `cap` argument: per captured tensor its pointer, strides and sizes (None: nothing)."""
        if not self.captured:
            return None
        out = []
        for t in self.captured:
            out += [t, *t.stride(), *t.shape]
        return tuple(out)


def _fingerprint(fn) -> tuple:
    """What a memoised compile of fn depends on beyond its code: the objects its closure cells, bound instance and
    module attributes hold (compared by identity: a tensor rebound in the closure is a new trace)."""
    if fn is None:
        return ()
    out = [getattr(fn, "__code__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:   # an empty cell
            out.append(None)
    owner = getattr(fn, "__self__", None) or (fn if isinstance(fn, torch.nn.Module) else None)
    if owner is not None:
        out += list(getattr(owner, "__dict__", {}).values())
        if isinstance(owner, torch.nn.Module):
            out += list(owner._parameters.values()) + list(owner._buffers.values())
    return tuple(out)


# (id(score_mod), id(mask_mod), device) -> (score_mod, mask_mod, fingerprints, result): a training loop calls the
# same mods every step, and tracing costs milliseconds.  Bounded; an entry keeps its mods and tensors alive.
_memo: OrderedDict = OrderedDict()
MEMO_SIZE = 64


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _compile(score_mod, mask_mod, device) -> Union[CompiledMods, str]:
    captured: list = []
    out = {}
    for kind, fn in (("score", score_mod), ("mask", mask_mod)):
        if fn is None:
            continue
        who = "score_mod" if kind == "score" else "mask_mod"
        try:
            if kind == "score":
                out["score"] = load(_generate(_trace(fn, True, device), captured, "score"), "score")
                grad = _trace(fn, True, device, grad=True)
                out["score_grad"] = load(_generate(grad, captured, "score"), "score")
            else:
                out["mask"] = load(_generate(_trace(fn, False, device), captured, "mask"), "mask")
        except Refused as e:
            return f"{who} is not compiled by the Triton kernels: {e}"
    for t in captured:
        if t.device != device:
            return f"a mod reads a tensor on {t.device}, the call is on {device}"
    return CompiledMods(captured=tuple(captured), **out)


def compile_mods(score_mod: Optional[Callable], mask_mod: Optional[Callable], device) -> Union[CompiledMods, str]:
    """CompiledMods of a call's mods on `device`, or the reason (naming the mod) why they are not compiled.
    Memoised per pair of mod objects while what they close over is the same (see _fingerprint)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (id(score_mod), id(mask_mod), device)
    fps = (_fingerprint(score_mod), _fingerprint(mask_mod))
    hit = _memo.get(key)
    if hit is not None and hit[0] is score_mod and hit[1] is mask_mod and all(map(_same, hit[2], fps)):
        _memo.move_to_end(key)
        return hit[3]
    result = _compile(score_mod, mask_mod, device)
    _memo[key] = (score_mod, mask_mod, fps, result)
    while len(_memo) > MEMO_SIZE:
        _memo.popitem(last=False)
    return result

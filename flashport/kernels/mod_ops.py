"""The aten ops a score_mod / mask_mod may use, as Triton expressions (kernels/mod_codegen.py's whitelist).

Each translator gets the code generator `g` (mod_codegen._Gen: operands as expressions, their dtypes and the tile
axes they vary along) and one graph node, and emits one line `vN = <expression>`.  Operands are cast to the result's
dtype where PyTorch would compute in it (floating results; comparisons in the promoted dtype); integer arithmetic
keeps Triton's own promotion (the kernels' indices are int32, PyTorch's int64: equal below 2**31).  Division and
remainder of integers follow PyTorch's floor rule, not Triton's truncation.  An op missing here is a reason.
"""
from __future__ import annotations

import math

import torch

TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
      torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
      torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}


class Refused(Exception):
    """A mod the compiler does not handle; the message is the reason."""


def lit(x) -> str:
    """A Python number of the graph as Triton source."""
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


def dtype_of(node) -> torch.dtype:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise Refused(f"{node.target} produced a {type(val).__name__}, not a tensor")
    return val.dtype


def made_by_the_mod(node) -> bool:
    """make_fx lifts a tensor created during the trace (torch.tensor inside the mod) through lift_fresh_copy; a
    tensor the mod closes over is read directly."""
    return bool(node.users) and all(op_name(u) == "lift_fresh_copy" for u in node.users)


def op_name(node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _binary(op: str):
    def gen(g, node):
        a, b = node.args[:2]
        rt = dtype_of(node)
        alpha = node.kwargs.get("alpha", 1)
        if rt.is_floating_point:
            ea, eb = g.cast(a, rt), g.cast(b, rt)
        else:
            ea, eb = g.arg(a), g.arg(b)
        if alpha != 1:
            eb = f"({eb} * {lit(alpha)})"
        g.emit(node, f"({ea} {op} {eb})", rt, g.axes(a, b))
    return gen


def _rsub(g, node):
    a, b = node.args[:2]
    rt = dtype_of(node)
    alpha = node.kwargs.get("alpha", 1)
    ea = g.cast(a, rt) if rt.is_floating_point else g.arg(a)
    ea = ea if alpha == 1 else f"({ea} * {lit(alpha)})"
    g.emit(node, f"({g.cast(b, rt) if rt.is_floating_point else g.arg(b)} - {ea})", rt, g.axes(a, b))


def _true_div(g, node):
    a, b = node.args[:2]
    rt = dtype_of(node)
    mode = node.kwargs.get("rounding_mode")
    if mode is None:
        g.emit(node, f"({g.cast(a, rt)} / {g.cast(b, rt)})", rt, g.axes(a, b))
        return
    if rt.is_floating_point:
        raise Refused(f"division with rounding_mode={mode!r} of floating tensors")
    (_floor_div if mode == "floor" else _trunc_div)(g, node)


def _trunc_div(g, node):
    a, b = node.args[:2]
    g.emit(node, f"({g.arg(a)} // {g.arg(b)})", dtype_of(node), g.axes(a, b))   # Triton's // truncates


def _floor_div(g, node):
    a, b = node.args[:2]
    rt = dtype_of(node)
    if rt.is_floating_point:
        raise Refused("floor division of floating tensors")
    ea, eb = g.arg(a), g.arg(b)
    # Triton's integer // and % truncate towards zero (C); PyTorch floors: one step down where the signs differ
    g.emit(node, f"floor_div({ea}, {eb})", rt, g.axes(a, b))


def _remainder(g, node):
    a, b = node.args[:2]
    rt = dtype_of(node)
    if rt.is_floating_point:
        raise Refused("remainder of floating tensors")
    g.emit(node, f"floor_mod({g.arg(a)}, {g.arg(b)})", rt, g.axes(a, b))


def _compare(op: str):
    def gen(g, node):
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
    def gen(g, node):
        a, b = node.args[:2]
        rt = dtype_of(node)
        if rt == torch.bool:
            ea, eb = g.cast(a, torch.bool), g.cast(b, torch.bool)
        else:
            ea, eb = g.arg(a), g.arg(b)
        g.emit(node, f"({ea} {op} {eb})", rt, g.axes(a, b))
    return gen


def _logical(op: str):
    def gen(g, node):
        a, b = node.args[:2]
        g.emit(node, f"({g.cast(a, torch.bool)} {op} {g.cast(b, torch.bool)})", torch.bool, g.axes(a, b))
    return gen


def _unary(template: str, float_only: bool = False):
    def gen(g, node):
        (a,) = node.args[:1]
        rt = dtype_of(node)
        if float_only and not rt.is_floating_point:
            raise Refused(f"{op_name(node)} of a {rt} tensor")
        x = g.cast(a, rt) if rt.is_floating_point else g.arg(a)
        g.emit(node, template.format(x=x, t=TL[rt]), rt, g.axes(a))
    return gen


def _not(g, node):
    (a,) = node.args[:1]
    rt = dtype_of(node)
    g.emit(node, f"({g.cast(a, torch.bool)} == 0)" if rt == torch.bool else f"(~{g.arg(a)})", rt, g.axes(a))


def _where(g, node):
    c, a, b = node.args[:3]
    rt = dtype_of(node)
    g.emit(node, f"tl.where({g.cast(c, torch.bool)}, {g.cast(a, rt)}, {g.cast(b, rt)})", rt, g.axes(c, a, b))


def _masked_fill(g, node):
    x, m, v = node.args[:3]
    rt = dtype_of(node)
    g.emit(node, f"tl.where({g.cast(m, torch.bool)}, {g.cast(v, rt)}, {g.cast(x, rt)})", rt, g.axes(x, m, v))


def _minmax(fn: str):
    def gen(g, node):
        a, b = node.args[:2]
        rt = dtype_of(node)
        g.emit(node, f"tl.{fn}({g.cast(a, rt)}, {g.cast(b, rt)})", rt, g.axes(a, b))
    return gen


def _clamp(g, node):
    x = node.args[0]
    name = op_name(node)
    lo = node.args[1] if name in ("clamp", "clamp_min") and len(node.args) > 1 else node.kwargs.get("min")
    hi = (node.args[2] if name == "clamp" and len(node.args) > 2 else node.args[1] if name == "clamp_max"
          else node.kwargs.get("max"))
    rt = dtype_of(node)
    e = g.cast(x, rt)
    if lo is not None:
        e = f"tl.maximum({e}, {g.cast(lo, rt)})"
    if hi is not None:
        e = f"tl.minimum({e}, {g.cast(hi, rt)})"
    g.emit(node, e, rt, g.axes(x, lo, hi))


def _pow(g, node):
    x, p = node.args[:2]
    rt = dtype_of(node)
    if hasattr(p, "op") or p not in (0, 1, 2, 3, 4, -1, 0.5, -0.5):
        raise Refused(f"pow with exponent {p!r} (integers -1..4 and +-0.5 are compiled)")
    e = g.cast(x, rt)
    forms = {0: f"({e} * 0 + 1)", 1: e, 2: f"({e} * {e})", 3: f"({e} * {e} * {e})", 4: f"(({e} * {e}) * ({e} * {e}))",
             -1: f"(1.0 / {e})", 0.5: f"tl.sqrt_rn({e})", -0.5: f"(1.0 / tl.sqrt_rn({e}))"}
    g.emit(node, forms[p], rt, g.axes(x))


def _to_copy(g, node):
    (a,) = node.args[:1]
    rt = dtype_of(node)
    if rt not in TL:
        raise Refused(f"conversion to {rt}")
    g.emit(node, g.cast(a, rt), rt, g.axes(a))


def _identity(g, node):
    a = node.args[0]
    if hasattr(a, "op") and a not in g.env and a.op == "get_attr":
        return               # a lifted copy of a captured tensor: aten.index reads it through g.constant
    g.env[node], g.dtypes[node], g.tile[node] = g.arg(a), g.dtypes[a], g.tile[a]


def zero_d(g, node, t: torch.Tensor):
    if t.dim() != 0:
        raise Refused(f"a captured tensor of shape {tuple(t.shape)} used whole (index it, or capture a 0-d tensor)")
    base, _ = g.slot(t)
    g.emit(node, f"tl.load(cap[{base}])", t.dtype, set())


def _fill(g, node):
    """ones_like / zeros_like / full_like / scalar_tensor / full([]): a constant of the result's dtype."""
    name = op_name(node)
    value = {"ones_like": 1, "zeros_like": 0}.get(name)
    if value is None:
        value = node.args[1] if name in ("full_like", "full") else node.args[0]
    if name == "full" and list(node.args[0]) not in ([], [1], [1, 1], [1, 1, 1], [1, 1, 1, 1]):
        raise Refused(f"aten.full of shape {node.args[0]}")
    rt = dtype_of(node)
    g.emit(node, f"tl.full([], {lit(value)}, {TL[rt]})", rt, set())


def _index(g, node):
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
    def gen(g, node):
        a, b = node.args[:2]
        rt = dtype_of(node)
        g.emit(node, template.format(g=g.cast(a, rt), y=g.cast(b, rt)), rt, g.axes(a, b))
    return gen


def _threshold_backward(g, node):
    grad, x, thr = node.args[:3]
    rt = dtype_of(node)
    g.emit(node, f"tl.where({g.arg(x)} <= {lit(thr)}, 0.0, {g.cast(grad, rt)}).to({TL[rt]})", rt, g.axes(grad, x))


def _sign(g, node):
    (a,) = node.args[:1]
    rt = dtype_of(node)
    x = g.arg(a)
    g.emit(node, f"tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)).to({TL[rt]})", rt, g.axes(a))


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


def translate(g, node) -> None:
    name = op_name(node)
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

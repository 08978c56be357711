"""Compiling score_mod / mask_mod into @triton.jit functions the attention kernels apply at their score stage.

A mod is traced once with make_fx on [1, 1, 1, 1] index tensors (score float32, b / h / q_idx / kv_idx int64)
into an aten graph; a whitelist of elementwise aten ops (kernels/mod_ops.py) becomes the body of a generated jit
function

    score_mod(score, b, h, q_idx, kv_idx, cap) -> float32     (natural units, as the user wrote it)
    score_grad(score, b, h, q_idx, kv_idx, cap) -> float32    d score_mod / d score at the same point
    mask_mod(b, h, q_idx, kv_idx, cap) -> bool
    cap_grad(score, b, h, q_idx, kv_idx, cap, dy, live, gcap)   adds dy * d score_mod / d value into the gradient
                                                               buffers of the captured tensors that need one (atomics)

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
import os
import sys
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .. import env
from ..mod_state import fingerprint, same
from .mod_ops import TL, Refused, lit, made_by_the_mod, op_name, translate, zero_d

MAX_CAPTURED = 8       # captured tensors one call's mods may read (each is 1 + 2 * rank entries of the `cap` tuple)
MAX_RANK = 4
# Counters of the generated-function cache: "generated" counts sources written and imported (cache misses),
# "hits" reuses; tests read them to check that new shapes or values generate nothing.
stats: Counter = Counter()


# ----------------------------------------------------------------------------- tracing
def _index_args(with_score: bool, device) -> tuple:
    # distinct tensor objects: make_fx identifies inputs by identity, and four references to one tensor
    # would trace as one placeholder
    idx = tuple(torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device) for _ in range(4))
    return ((torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=device),) if with_score else ()) + idx


def _trace(fn: Callable, with_score: bool, device, grad=False):
    """make_fx graph of fn (grad True: of d fn / d score; a tuple of captured tensors: of fn's gradients into them,
    each an index_put of d fn / d value into zeros) on index tensors of the call's device (where its captured
    tensors live), or Refused."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def score_grad(score, b, h, q_idx, kv_idx):
        s = score.detach().requires_grad_()
        with torch.enable_grad():
            y = fn(s, b, h, q_idx, kv_idx)
            (g,) = torch.autograd.grad(y, (s,), torch.ones_like(y), allow_unused=True, materialize_grads=True)
        return g

    def cap_grads(score, b, h, q_idx, kv_idx):
        with torch.enable_grad():
            y = fn(score, b, h, q_idx, kv_idx)
            return torch.autograd.grad(y, grad, torch.ones_like(y), allow_unused=True)

    def called(*args):   # fn itself may take more parameters, with defaults: make_fx wants exactly the indices
        return fn(*args)

    if grad is False:
        target = (lambda score, b, h, q_idx, kv_idx: called(score, b, h, q_idx, kv_idx)) if with_score else \
            (lambda b, h, q_idx, kv_idx: called(b, h, q_idx, kv_idx))
    else:
        target = score_grad if grad is True else cap_grads
    try:
        with torch.no_grad() if grad is False else torch.enable_grad():
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
        self.buffers: dict = {}        # gradient graphs: node -> [(indices, values)] accumulated into zeros

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
        return lit(a)

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
        return f"{e}.to({TL[dtype]})"

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
            if t.dtype not in TL:
                raise Refused(f"a captured tensor of dtype {t.dtype}")
            if t.numel() >= 2 ** 31:     # the kernels index captured tensors in int32
                raise Refused(f"a captured tensor of {t.numel()} elements (at most 2**31 - 1)")
            if len(self.captured) == MAX_CAPTURED:
                raise Refused(f"more than {MAX_CAPTURED} captured tensors")
            self.captured.append(t)
            n = len(self.captured) - 1
        base = sum(1 + 2 * c.dim() for c in self.captured[:n])
        return base, t.dim()

    def scatter(self, node) -> bool:
        """A gradient graph's buffers (autograd's backward of indexing a captured tensor): new_zeros makes one,
        index_put with accumulate adds (indices, values) to it, add joins two.  False for any other node."""
        name = op_name(node)
        buf = lambda a: hasattr(a, "op") and a in self.buffers  # noqa: E731
        if name in ("new_zeros", "zeros"):
            self.buffers[node] = []
        elif name in ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"):
            base, indices, values = node.args[:3]
            accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
            if not buf(base) or not accumulate:
                raise Refused(f"aten.{name} on anything but a gradient buffer")
            self.buffers[node] = self.buffers[base] + [(indices, values)]
        elif name == "add" and buf(node.args[0]) and buf(node.args[1]):
            self.buffers[node] = self.buffers[node.args[0]] + self.buffers[node.args[1]]
        else:
            return False
        return True

    def constant(self, node) -> torch.Tensor:
        if node.op == "get_attr":
            return getattr(self.gm, node.target)
        if node.op == "call_function" and op_name(node) in ("lift_fresh_copy", "detach", "alias", "clone"):
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
                if t.dim() == 0 and made_by_the_mod(node):
                    # torch.tensor(x) inside the mod: a literal of its code (each trace makes a new tensor)
                    self.emit(node, f"tl.full([], {lit(t.item())}, {TL[t.dtype]})", t.dtype, set())
                elif t.dim() == 0:   # a captured 0-d tensor is a value: one scalar load
                    zero_d(self, node, t)
                continue             # others are read through aten.index
            if node.op != "call_function":
                raise Refused(f"graph node {node.op} {node.target}")
            if not self.scatter(node):
                translate(self, node)
        (out,) = [n for n in self.gm.graph.nodes if n.op == "output"]
        res = out.args[0]
        if self.buffers or (isinstance(res, (list, tuple)) and all(r is None for r in res)):
            return tuple(res)   # a gradient graph: one buffer (or None) per captured tensor
        if isinstance(res, (list, tuple)):
            if len(res) != 1:
                raise Refused("the mod returned several values")
            res = res[0]
        if not hasattr(res, "op"):
            raise Refused(f"the mod returned {res!r}, not a tensor")
        return res



HEADER = '''"""Generated by flashport.kernels.mod_codegen from a traced {what}; do not edit (key {key})."""
import triton
import triton.language as tl

from flashport.kernels.common import add_reduced, clamp_index, floor_div, floor_mod, tanh

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


# add_reduced's MODE per what a gradient's element index depends on: nothing that varies over the tile (one sum per
# tile), the query only (a sum per query), the key only (per key), q_idx - kv_idx only (per diagonal: a relative
# position table); anything else (0) adds element by element.
REDUCE = {frozenset(): 1, frozenset({"q"}): 2, frozenset({"kv"}): 3, frozenset({"d"}): 4}


def _positions(g: _Gen, node, memo: dict) -> frozenset:
    """Which positions an index expression depends on: "q" (q_idx), "kv" (kv_idx), "d" (only through q_idx - kv_idx
    or kv_idx - q_idx), "s" (the score, or anything else per element); b and h are constant over a tile."""
    if isinstance(node, (list, tuple)):
        return frozenset().union(*(_positions(g, a, memo) for a in node))
    if not hasattr(node, "op"):
        return frozenset()
    if node not in memo:
        if node.op == "placeholder":
            memo[node] = frozenset({{"q_idx": "q", "kv_idx": "kv", "score": "s"}[g.env[node]]}
                                   if g.env[node] in ("q_idx", "kv_idx", "score") else ())
        elif (node.op == "call_function" and op_name(node) == "sub" and len(node.args) == 2 and not node.kwargs
              and {_positions(g, a, memo) for a in node.args} == {frozenset({"q"}), frozenset({"kv"})}
              and all(a.op == "placeholder" for a in node.args)):
            memo[node] = frozenset({"d"})
        elif node.op == "call_function" and op_name(node) == "mul" and any(type(a) is int and a == 0 for a in node.args):
            memo[node] = frozenset()   # x * 0: how a broadcast (size-1) dimension of attn_bias is read
        else:
            memo[node] = _positions(g, list(node.args) + list(node.kwargs.values()), memo)
    return memo[node]


def _generate_cap_grad(gm, captured: list, leaves: tuple) -> str:
    """cap_grad_fn(score, b, h, q_idx, kv_idx, cap, dy, live, gcap): for every pair where `live`, adds
    dy * d score_mod / d value into each leaf's float32 gradient buffer at the element the mod read (atomics, after
    summing the tile's terms that share an element where the index shows which do: common.add_reduced).
    gcap holds per leaf its buffer's pointer and strides; the leaf's sizes (index clamping) come from cap."""
    gm.graph.eliminate_dead_code()
    g = _Gen(gm, captured, ("score", "b", "h", "q_idx", "kv_idx"))
    outs = g.run()
    if len(outs) != len(leaves):
        raise Refused(f"expected {len(leaves)} gradients, traced {len(outs)}")
    sums = env.flag("FLASHPORT_CAP_GRAD_SUMS")   # 0: element by element (A/B timing)
    lines, gbase, memo = list(g.lines), 0, {}
    for leaf, out in zip(leaves, outs):
        rank = leaf.dim()
        for indices, values in [] if out is None else g.buffers[out]:
            cbase, _ = g.slot(leaf)
            terms = " + ".join(f"clamp_index({g.arg(ix)}, cap[{cbase + 1 + rank + d}]) * gcap[{gbase + 1 + d}]"
                               for d, ix in enumerate(indices))
            mode = REDUCE.get(frozenset().union(*(_positions(g, ix, memo) for ix in indices)), 0) if sums else 0
            lines.append(f"    add_reduced(gcap[{gbase}], ({terms}) + tl.zeros(dy.shape, tl.int32), "
                         f"tl.where(live, {g.cast(values, torch.float32)} * dy, 0.0), live, q_idx, kv_idx, {mode})")
        gbase += 1 + rank
    body = "\n".join(lines) or "    pass"
    return f"@triton.jit\ndef cap_grad_fn(score, b, h, q_idx, kv_idx, cap, dy, live, gcap):\n{body}\n"


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
    cap_grad: Optional[Callable] = None   # the captured tensors' gradients (cap_grad_fn), None when none is needed
    grad_leaves: tuple = ()               # the tensors cap_grad differentiates, in the call's `captured` order

    def gcap(self) -> tuple:
        """Zeroed float32 gradient buffers of grad_leaves and the kernels' `gcap` argument (pointer, strides each)."""
        bufs = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in self.grad_leaves]
        return bufs, tuple(x for buf in bufs for x in (buf, *buf.stride()))

    def cap(self) -> Optional[tuple]:
        """The kernels' `cap` argument: per captured tensor its pointer, strides and sizes (None: nothing)."""
        if not self.captured:
            return None
        out = []
        for t in self.captured:
            out += [t, *t.stride(), *t.shape]
        return tuple(out)


# (id(score_mod), id(mask_mod), device) -> (score_mod, mask_mod, fingerprints, result): a training loop calls the
# same mods every step, and tracing costs milliseconds.  Bounded; an entry keeps its mods and tensors alive.
_memo: OrderedDict = OrderedDict()
MEMO_SIZE = 64


def _compile(score_mod, mask_mod, device, grads_for: tuple = ()) -> Union[CompiledMods, str]:
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
                if grads_for:
                    gm = _trace(fn, True, device, grad=tuple(grads_for))
                    out["cap_grad"] = load(_generate_cap_grad(gm, captured, tuple(grads_for)), "cap_grad")
                    out["grad_leaves"] = tuple(grads_for)
            else:
                out["mask"] = load(_generate(_trace(fn, False, device), captured, "mask"), "mask")
        except Refused as e:
            return f"{who} is not compiled by the Triton kernels: {e}"
    for t in captured:
        if t.device != device:
            return f"a mod reads a tensor on {t.device}, the call is on {device}"
    return CompiledMods(captured=tuple(captured), **out)


def compile_mods(score_mod: Optional[Callable], mask_mod: Optional[Callable], device,
                 grads_for: tuple = ()) -> Union[CompiledMods, str]:
    """CompiledMods of a call's mods on `device`, or the reason (naming the mod) why they are not compiled.
    grads_for: tensors score_mod captures whose gradients the backward computes (cap_grad).  Memoised per pair of
    mod objects and those tensors while what the mods read is the same (mod_state.fingerprint)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (id(score_mod), id(mask_mod), device, tuple(map(id, grads_for)))
    fps = (fingerprint(score_mod), fingerprint(mask_mod))
    hit = _memo.get(key)
    if hit is not None and hit[0] is score_mod and hit[1] is mask_mod and all(map(same, hit[2], fps)):
        _memo.move_to_end(key)
        return hit[3]
    result = _compile(score_mod, mask_mod, device, grads_for)
    _memo[key] = (score_mod, mask_mod, fps, result)
    while len(_memo) > MEMO_SIZE:
        _memo.popitem(last=False)
    return result

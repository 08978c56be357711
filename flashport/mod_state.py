"""What a traced mod depends on beyond its code, for the memos that skip re-tracing it (the Triton mod compiler's,
kernels/mod_codegen.compile_mods, and the band reader's, mask_rules.band_of).

A trace bakes in every Python value the mod reads: a window in a closure cell, `self.window` on the module that
builds the lambda, an entry of a captured list or dict, a default argument, a callable object's attribute.  Those
can change in place between two calls with the same mod object, so comparing them by identity would serve the old
trace (a wrong answer, silently).  `fingerprint` therefore records them by value, down to `DEPTH` levels:

- the callable's code, its closure cells, defaults, the globals its code names, and its owner (the instance of a
  bound method, a callable object or an nn.Module);
- of objects, only the attributes the code names (`co_names`: `self.cfg.window` names cfg and window), properties
  among them read, so a large module costs what the mod reads of it;
- of lists, tuples and dicts, every entry (at most MAX_ENTRIES, else the fingerprint never matches: re-traced);
- functions among them, their own fingerprint.

Tensors are recorded by identity, shape and dtype only: the compiled mods load their values at run time (a traced
`.item()` is refused), so an optimizer's in-place step on a captured table changes nothing that was traced.
Modules, classes and other values are recorded by identity."""
from __future__ import annotations

import functools
import types
from typing import Callable, Optional

import torch

DEPTH = 4
MAX_ENTRIES = 256
_VALUES = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size, range, slice)
_OPAQUE = (type, types.ModuleType, types.BuiltinFunctionType)


def _parts(fn) -> tuple:
    """(code, globals, closure values, defaults, owner) of a plain function, bound method, functools.partial,
    nn.Module (its forward) or callable object (its __call__)."""
    owner = None
    if isinstance(fn, types.MethodType):
        owner, fn = fn.__self__, fn.__func__
    elif isinstance(fn, torch.nn.Module):
        owner, fn = fn, type(fn).forward
    elif isinstance(fn, functools.partial):
        return None, {}, [fn.func, fn.args, fn.keywords], (), None
    elif not isinstance(fn, types.FunctionType) and callable(fn):
        owner, fn = fn, getattr(type(fn), "__call__", None)
    code = getattr(fn, "__code__", None)
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:   # an empty cell
            cells.append(None)
    defaults = (getattr(fn, "__defaults__", None) or (), getattr(fn, "__kwdefaults__", None) or {})
    return code, getattr(fn, "__globals__", None) or {}, cells, defaults, owner


def fingerprint(fn: Optional[Callable], depth: int = DEPTH) -> tuple:
    """A flat tuple whose entries `same` compares: values by equality, other objects by identity."""
    if fn is None:
        return ()
    code, glob, cells, defaults, owner = _parts(fn)
    names = frozenset(code.co_names) if code is not None else frozenset()
    out: list = [code]          # the code fixes how many cells and defaults follow
    for x in (*cells, *defaults, *(glob[n] for n in sorted(names) if n in glob)):
        _record(x, names, depth, out)
    if owner is not None:
        out.append(owner)
        _attributes(owner, names, depth, out)
    return tuple(out)


def _record(x, names: frozenset, depth: int, out: list) -> None:
    if isinstance(x, torch.Tensor):
        out += [x, x.shape, x.dtype]
        return
    if isinstance(x, (list, tuple, dict, set, frozenset)) and depth > 0:   # by contents: a new equal list is a hit
        out.append(type(x))
        if len(x) > MAX_ENTRIES:
            out.append(object())    # a new object each time: no later fingerprint is `same` as this one
            return
        out.append(len(x))
        items = [y for kv in x.items() for y in kv] if isinstance(x, dict) else \
            (sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x)
        for y in items:
            _record(y, names, depth - 1, out)
        return
    out.append(x)
    if isinstance(x, _VALUES + _OPAQUE) or depth <= 0:
        return
    if isinstance(x, (types.FunctionType, types.MethodType, functools.partial)) or (
            callable(x) and hasattr(x, "__dict__")):
        out += fingerprint(x, depth - 1)           # a function the mod calls, or a callable object it holds
    if hasattr(x, "__dict__") and not isinstance(x, types.FunctionType):
        _attributes(x, names, depth - 1, out)      # what the mod's own code reads of it


def _attributes(obj, names: frozenset, depth: int, out: list) -> None:
    """The attributes of obj that the code names, by value (nn.Module's parameters, buffers and submodules too)."""
    where = [getattr(obj, "__dict__", {})]
    if isinstance(obj, torch.nn.Module):
        where += [obj._parameters, obj._buffers, obj._modules]
    for n in sorted(names):
        for d in where:
            if n in d:
                out.append(n)
                _record(d[n], names, depth, out)
                break
        else:
            if isinstance(getattr(type(obj), n, None), property):   # computed from other state on every read
                out.append(n)
                try:
                    value = getattr(obj, n)
                except Exception:  # noqa: BLE001 - a property that fails here fails in the trace as well
                    value = object()    # never `same`: traced again
                _record(value, names, depth, out)


def same(a: tuple, b: tuple) -> bool:
    """Whether two fingerprints record the same state: values equal, every other object the same one."""
    return len(a) == len(b) and all(x is y or (type(x) is type(y) and isinstance(x, _VALUES) and x == y)
                                    for x, y in zip(a, b))

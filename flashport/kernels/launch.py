"""Direct launches of compiled Triton / Gluon kernels, without JITFunction.run's per-call work.

`kernel[grid](*args, **meta)` binds and specialises every argument, builds the cache key, checks the used
globals and builds launch metadata for hooks on every call: about 20 us of host time, plus ~3 us per
TensorDescriptor built and validated.  A short attention call (S = 512 to 1024) runs ~50 us on the GPU
and is timed eagerly, so that host time is on its critical path.  Here the first call of each
specialisation class goes through the JIT (compiling, caching, validating the descriptors); later calls
hand the same compiled kernel's launcher the arguments directly.

What decides Triton's specialisation is part of our key: each int's class (== 1: a constant; % 16 == 0;
outside int32), each tensor's dtype and 16-byte alignment, each descriptor's block shape and layout, the
constexprs and the device.  The key is built on every call, so it is built from exact-type tests and a
per-descriptor tuple made once (`Desc.spec`): a Gluon layout hashes in Python, microseconds per call.
With a launch hook installed (Triton's profiler, proton) every call takes the JIT path, so hooks still see
every launch; PyTorch's profiler sees the kernels either way (CUPTI).
"""
from __future__ import annotations

import torch

# Both imports are private or young Triton API (tested on 3.6).  Each may be missing on its own; a missing one
# leaves a defined None, never a name that fails at the first launch.  Without knobs (or its launch hooks)
# every launch takes the plain JIT path; TensorDescriptor only matters to the Gluon (Hopper) kernels, which
# gate themselves on the Triton version.
try:
    from triton import knobs
except ImportError:  # pragma: no cover - depends on the installed Triton
    knobs = None
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None


def _has_private_api() -> bool:
    """Does this Triton have the launch hook chains with `.calls` (Triton 3.6's knobs) that the direct path
    reads?  The compiled kernel's fields are checked per kernel (DirectLauncher._entry)."""
    runtime = getattr(knobs, "runtime", None)
    hooks = (getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None))
    return all(hasattr(h, "calls") for h in hooks)


DIRECT = _has_private_api()   # False: DirectLauncher is kernel[grid](...) and nothing else


def triton_direct(t: torch.Tensor) -> bool:
    """The `direct` of the portable Triton kernels' launches: CUDA tensors (the interpreter takes the JIT) and
    FLASHPORT_TRITON_DIRECT (default on; 0 rolls back to the JIT).  env is imported here: the launch tests load
    this module on its own, outside the package."""
    from .. import env
    return t.is_cuda and env.flag("FLASHPORT_TRITON_DIRECT")


_JIT_ONLY = ("jit only",)     # a cache entry for a compiled kernel that lacks the fields the direct path needs


class Desc:
    """A TMA descriptor's arguments, light enough to build per call: what the launcher reads (base's
    data_ptr, shape, strides, padding) and what specialises the kernel (block shape, layout)."""
    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "padding", "spec")

    def __init__(self, base, shape, strides, block_shape, layout):
        self.base, self.shape, self.strides = base, shape, strides
        self.block_shape, self.layout, self.padding = block_shape, layout, "zero"
        self.spec = (base.dtype, tuple(block_shape), _layout_token(layout))

    def real(self) -> "TensorDescriptor":
        """The Gluon TensorDescriptor the JIT binds (validated; over the 2D view of base)."""
        return TensorDescriptor.from_tensor(self.base.view(self.shape), list(self.block_shape), self.layout)


def _jit_args(args) -> list:
    """args with each Desc replaced by the TensorDescriptor the JIT binds."""
    return [a.real() if isinstance(a, Desc) else a for a in args]


# id(layout) -> (layout, token).  Holding the layout keeps its id from being reused by another object, so
# one token names one layout object; two equal layout objects get two tokens (one extra JIT call, never a
# wrong kernel).
_layouts: dict = {}


def _layout_token(layout) -> int:
    entry = _layouts.get(id(layout))
    if entry is None or entry[0] is not layout:
        entry = _layouts[id(layout)] = (layout, len(_layouts))
    return entry[1]


def _spec_class(x):
    t = type(x)
    if t is int:
        return (x == 1, x % 16 == 0, not -2 ** 31 <= x < 2 ** 31)
    if t is Desc:
        return x.spec
    if t is float or x is None:
        return t
    if t is bool:
        return x
    if t is tuple:   # the compiled mods' captured tensors, a block mask's skip arguments: specialised per element
        return tuple(map(_spec_class, x))
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() % 16 == 0)
    if isinstance(x, int):   # an int subclass (not bool, handled above)
        return (x == 1, x % 16 == 0, not -2 ** 31 <= x < 2 ** 31)
    return type(x)


class DirectLauncher:
    """launcher(grid, args, meta): jit_fn[grid](*args, **meta), where args are the kernel's non-constexpr
    parameters in order (Desc for a tensor descriptor) and meta its constexprs (every parameter after them, which
    are part of the key by value: never a tensor) plus launch options (num_warps).  Compiled kernels are cached per
    specialisation class.  direct=False: always the JIT (Triton's interpreter, CPU tensors)."""

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self._compiled: dict = {}

    def _entry(self, kernel, args, meta):
        """What a direct launch needs of a compiled kernel, or _JIT_ONLY when it lacks those private fields."""
        if not all(hasattr(kernel, f) for f in ("run", "function", "packed_metadata")):
            return _JIT_ONLY
        names = self.jit_fn.arg_names
        constexprs = tuple(meta[n] for n in names[len(args):])   # every one after the plain args
        return kernel.run, kernel.function, kernel.packed_metadata, constexprs

    def compile(self, grid, args, meta):
        """The compiled kernel for these arguments (JIT: compiles on a miss, raises what the compiler raises)."""
        kernel = self.jit_fn.warmup(*_jit_args(args), grid=grid, **meta)
        return kernel.result() if hasattr(kernel, "result") else kernel

    def unbound(self, args, meta) -> list[str]:
        """What would keep a direct launch from reproducing jit_fn[grid](*args, **meta): a constexpr among the
        positional args, a parameter after them missing from meta, or a tensor in meta (a key by value would hold
        it).  Empty: none (tests)."""
        import inspect
        params = inspect.signature(getattr(self.jit_fn, "fn", self.jit_fn)).parameters   # JIT or interpreted
        constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
        names = list(params)
        wrong = [f"constexpr {n} passed positionally" for n in names[:len(args)] if n in constexprs]
        wrong += [f"{n} not in meta" for n in names[len(args):] if n not in meta]
        tensors = [n for n, x in meta.items() if isinstance(x, torch.Tensor)
                   or (isinstance(x, tuple) and any(isinstance(e, torch.Tensor) for e in x))]
        return wrong + [f"tensor {n} in meta" for n in tensors]

    def __call__(self, grid, args, meta, direct: bool = True):
        if not (DIRECT and direct):
            self.jit_fn[grid](*_jit_args(args), **meta)
            return
        device = torch._C._cuda_getDevice()   # torch.cuda.current_device() without its lazy-init check
        key = (device, tuple(meta.items()), tuple(_spec_class(a) for a in args))
        entry = self._compiled.get(key)
        if entry is None or entry is _JIT_ONLY or knobs.runtime.launch_enter_hook.calls \
                or knobs.runtime.launch_exit_hook.calls:
            kernel = self.jit_fn[grid](*_jit_args(args), **meta)
            if entry is None:
                self._compiled[key] = self._entry(kernel, args, meta)
            return
        run, function, packed, constexprs = entry
        g0, g1, g2 = (*grid, 1, 1)[:3]
        run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device), function, packed, None, None, None, *args,
            *constexprs)

"""Backend registry and selection: explicit `backend=` > `use_backend()` / FLASHPORT_BACKEND > auto.

Each backend declares capabilities and answers `supports(spec) -> list[str]` with the reasons it
cannot serve a call (empty list = it can).  A named backend is strict: it serves the call or
`UnsupportedError` is raised.  Auto order is the registration order; `reference` is never chosen
automatically.  Selection happens in Python, outside any compiled graph.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field

from .spec import AttnSpec

log = logging.getLogger("flashport")


class UnsupportedError(ValueError):
    """No backend (or not the named one) can serve this call; the message lists every reason."""


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reasons: list[str] = field(default_factory=list)
    capabilities: dict = field(default_factory=dict)


class Backend:
    """Base class.  Subclasses set `name`, `capabilities`, and implement `run`.

    `run(spec, inputs) -> (out, lse)` returns out in q's dtype and lse float32 ([B, Hq, Sq] for
    dense/kvcache, [Hq, total_q] for varlen), differentiable through torch.autograd when needed.
    """

    name: str = "?"
    auto: bool = True            # may auto-selection pick it?
    auto_devices: tuple = ()     # device types auto-selection may pick it on; () = every device
    slow_on_gpu: bool = False    # materialises scores or runs at PyTorch-op speed on a GPU
    capabilities: dict = {}

    def availability(self) -> list[str]:
        """Reasons this backend cannot run at all in this process (missing package, no device)."""
        return []

    def supports(self, spec: AttnSpec) -> list[str]:
        raise NotImplementedError

    def run(self, spec: AttnSpec, inputs):
        raise NotImplementedError


_REGISTRY: dict[str, Backend] = {}
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("flashport_backend", default=None)
fallback_counts: Counter = Counter()  # auto landings on slow paths on a GPU, by backend name
_warned: set = set()


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise UnsupportedError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def backends() -> list[BackendInfo]:
    """Every registered backend in auto-priority order, with why it is unavailable if it is."""
    out = []
    for b in _REGISTRY.values():
        reasons = b.availability()
        out.append(BackendInfo(b.name, not reasons, list(reasons), dict(b.capabilities)))
    return out


@contextlib.contextmanager
def use_backend(name: str):
    """Force a backend inside the block (strict, like `backend=`)."""
    get(name)  # unknown names fail here, not at the first call
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def _reasons(b: Backend, spec: AttnSpec) -> list[str]:
    return b.availability() or b.supports(spec)


def _requested(backend) -> str | None:
    """The named backend, if any: `backend=` > use_backend() > FLASHPORT_BACKEND.  Only None (or an unset
    variable) means "not given": an empty string is an unknown name, never "auto" (the contract's rule)."""
    if backend is not None:
        return backend
    forced = _forced.get()
    if forced is not None:
        return forced
    return os.environ.get("FLASHPORT_BACKEND")


def select(spec: AttnSpec, backend: str | None = None) -> Backend:
    name = _requested(backend)
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"backend must be a str or None, got {type(name).__name__}")
        b = get(name)
        reasons = _reasons(b, spec)
        if reasons:
            raise UnsupportedError(f"backend {name!r} cannot serve this call:\n  - {name}: " + "; ".join(reasons))
        log.debug("flashport: %s chosen explicitly for %s", name, spec)
        return b
    tried = []
    for b in _REGISTRY.values():
        if not b.auto:
            tried.append(f"  - {b.name}: never chosen automatically (name it to use it)")
            continue
        if b.auto_devices and spec.device.type not in b.auto_devices:
            tried.append(f"  - {b.name}: not chosen automatically on {spec.device.type} (name it to use it)")
            continue
        reasons = _reasons(b, spec)
        if reasons:
            tried.append(f"  - {b.name}: " + "; ".join(reasons))
            continue
        if spec.device.type == "cuda" and b.slow_on_gpu:
            fallback_counts[b.name] += 1
            if b.name not in _warned:
                _warned.add(b.name)
                warnings.warn(f"flashport: no fast GPU backend serves this call, running on {b.name!r} "
                              f"(PyTorch-op speed). Reasons:\n" + "\n".join(tried), RuntimeWarning, stacklevel=3)
        log.debug("flashport: %s chosen automatically for %s", b.name, spec)
        return b
    raise UnsupportedError("no backend can serve this call:\n" + "\n".join(tried))

"""The JAX backends' registry: the same shape as flashport.dispatch (declared capabilities, reasons,
strict named choice, auto order), with one difference JAX imposes: a call cannot know whether it will be
differentiated, so a backend serves a call only if it serves its forward and its backward.

Selection runs in Python at trace time from the static spec; the chosen backend's computation is a jitted
function with the spec static, so equal shapes and options never retrace.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import jax

from ..capabilities import Capabilities, reasons as capability_reasons
from ..dispatch import BackendInfo, UnsupportedError
from .spec import JaxSpec

trace_counts: Counter = Counter()   # backend name -> times its jitted body was traced (tests read it)


@dataclass(frozen=True)
class JaxCapabilities(Capabilities):
    kinds: tuple = ("dense",)
    paged_kvcache: bool = False
    alibi: bool = False
    dropout: bool = False
    deterministic: bool = False
    devices: tuple = ("cpu", "gpu", "tpu")          # JAX platforms
    segment_ids: bool = True                        # one [B, S] array for queries and keys (Sq == Sk)
    pair_segment_ids: bool = True                   # (q_ids [B, Sq], kv_ids [B, Sk])
    empty_rows: bool = True                         # rows that see no key give zeros, lse -inf


class JaxBackend:
    """Base class: `name`, `caps`, a docstring saying what it serves; `forward(spec, q, k, v, q_seg, kv_seg)
    -> (out, lse or None)` traced under jit (differentiable by JAX or through the backend's custom_vjp)."""

    name: str = "?"
    caps: JaxCapabilities = JaxCapabilities()
    auto: bool = True
    auto_platforms: tuple = ()      # platforms auto-selection may pick it on; () = every platform

    @property
    def capabilities(self) -> dict:
        return {**self.caps.as_dict(), "auto_platforms": list(self.auto_platforms) or ["any"]}

    def availability(self) -> list[str]:
        """Reasons it cannot run at all in this process (no such device, jax lacks the kernel)."""
        return []

    def own_reasons(self, spec: JaxSpec) -> list[str]:
        """What the declaration cannot say (block divisibility, alignment)."""
        return []

    def auto_reasons(self, spec: JaxSpec) -> list[str]:
        """Why auto-selection passes over a call it could serve (a materialising path on long sequences)."""
        return []

    def options(self, spec: JaxSpec):
        """Hashable tuning choices for this call (tile sizes), part of the jit key."""
        return None

    def supports(self, spec: JaxSpec) -> list[str]:
        out = []
        for role in ("fwd", "bwd"):
            prefix = "backward: " if role == "bwd" else ""
            for why in capability_reasons(self.caps, spec, role):
                if prefix + why not in out and why not in out:
                    out.append(prefix + why)
        if spec.segments != "none" and not self.caps.segment_ids:
            out.append("segment_ids")
        elif spec.segments == "pair" and not self.caps.pair_segment_ids:
            out.append("separate query / key segment ids (rows may see no key)")
        return out + [w for w in self.own_reasons(spec) if w not in out]

    def forward(self, spec: JaxSpec, opts, q, k, v, q_seg, kv_seg):
        raise NotImplementedError

    def __call__(self, spec: JaxSpec, q, k, v, q_seg, kv_seg):
        return _jitted(self.name, spec, self.options(spec), q, k, v, q_seg, kv_seg)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jitted(name, spec, opts, q, k, v, q_seg, kv_seg):
    trace_counts[name] += 1
    return _REGISTRY[name].forward(spec, opts, q, k, v, q_seg, kv_seg)


_REGISTRY: dict[str, JaxBackend] = {}


def register(backend: JaxBackend) -> JaxBackend:
    """Add (or replace) a backend; registration order is the auto priority."""
    _REGISTRY[backend.name] = backend
    _select.cache_clear()
    return backend


def get(name: str) -> JaxBackend:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise UnsupportedError(f"unknown JAX backend {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def names() -> list[str]:
    return list(_REGISTRY)


def backends() -> list[BackendInfo]:
    """Every JAX backend in auto-priority order, with why it is unavailable if it is."""
    return [BackendInfo(b.name, not b.availability(), list(b.availability()), dict(b.capabilities))
            for b in _REGISTRY.values()]


def select(spec: JaxSpec, name: str | None) -> JaxBackend:
    return _select(spec, name)


def clear_cache() -> None:
    _select.cache_clear()


@functools.lru_cache(maxsize=1024)
def _select(spec: JaxSpec, name: str | None) -> JaxBackend:
    if name is not None:
        b = get(name)
        why = b.availability() + b.supports(spec)
        if why:
            raise UnsupportedError(f"JAX backend {name!r} cannot serve this call: {'; '.join(why)}")
        return b
    tried = []
    for b in _REGISTRY.values():
        if not b.auto:
            tried.append(f"{b.name}: never chosen automatically")
            continue
        if b.auto_platforms and spec.device.type not in b.auto_platforms:
            tried.append(f"{b.name}: auto-selected only on {', '.join(b.auto_platforms)}")
            continue
        why = b.availability() + b.supports(spec) + b.auto_reasons(spec)
        if not why:
            return b
        tried.append(f"{b.name}: {'; '.join(why)}")
    raise UnsupportedError("no JAX backend can serve this call:\n  " + "\n  ".join(tried))


def why_not(spec: JaxSpec) -> dict[str, list[str]]:
    """Every backend's reasons for this call ([] for those that serve it), for tests and `check`."""
    return {b.name: b.availability() + b.supports(spec) for b in _REGISTRY.values()}

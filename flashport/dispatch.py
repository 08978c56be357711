"""Backend registry and selection: explicit `backend=` > `use_backend()` / FLASHPORT_BACKEND > auto.

Every kernel family is a backend with declared `Capabilities` (flashport/capabilities.py); one
generic check reads them and a backend adds its own reasons.  Forward and backward are chosen
separately (xFormers' FwOp / BwOp): backends whose saved state is (out, lse) mix freely, e.g. the
Gluon forward with the Triton backward; a backend that needs its own forward state (PyTorch SDPA)
is chosen as a pair.  A name is strict: "triton" (both directions) or "gluon/triton" (forward /
backward) serves the call or `UnsupportedError` says why.  Auto takes the fastest measured plan
from the selection table (flashport/table.py) where a bucket fits, and the static priority
(registration order, each backend's preferences) elsewhere; only exact backends take part,
`reference` is never chosen automatically, and a `measured_only` backend (an optional peer such as
`fa4`) only where the table measured it.  Selection happens in Python, outside compiled graphs,
and is memoised per call description.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

from . import capabilities, env, rollout
from .capabilities import Capabilities
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


@dataclass
class Saved:
    """What a backward receives from whichever forward ran: the contract's (out, lse) plus the
    producing backend's private state, passed only to a backward of the same `state_family`."""

    q: object
    k: object
    v: object
    out: object
    lse: object            # float32, [B, Hq, Sq] (dense) or [Hq, total_q] (varlen); -inf where a row sees no key
    private: object = None
    producer: str = ""


class Backend:
    """Base class.  Subclasses set `name`, `caps` (Capabilities) and a docstring saying what they serve.

    A backend with caps.saved_state == "lse" implements
        forward(spec, inputs) -> (out, lse, private)        out in q's dtype, lse float32
        backward(spec, inputs, saved: Saved, dout, dlse) -> (dq, dk, dv)
    and may be mixed with any other such backend.  A backend with saved_state == "own" implements
    run(spec, inputs) -> (out, lse) with its own autograd.
    """

    name: str = "?"
    caps: Capabilities = Capabilities()
    auto: bool = True            # may auto-selection pick it?
    auto_devices: tuple = ()     # device types auto-selection may pick it on; () = every device
    slow_on_gpu: bool = False    # materialises scores or runs at PyTorch-op speed on a GPU
    measured_only: bool = False  # auto takes it only where the selection table measured it, never by static priority
    state_family: str = ""       # backends sharing private forward state (e.g. lse in log2 units)

    @property
    def capabilities(self) -> dict:
        return self.caps.as_dict()

    def availability(self) -> list[str]:
        """Reasons this backend cannot run at all in this process (missing package, no device)."""
        return []

    def own_reasons(self, spec: AttnSpec, role: str) -> list[str]:
        """What the declaration cannot say (a probe, a tensor-size limit)."""
        return []

    def brackets_backward(self, spec: AttnSpec) -> bool:
        """An "own"-state backend whose run() gives the call's backward its profiler range and count itself (else
        serve brackets it with two autograd Functions)."""
        return False

    def supports(self, spec: AttnSpec, role: str | None = None) -> list[str]:
        """Reasons it cannot serve `spec` in `role` ("fwd", "bwd"; None: every role the call needs)."""
        roles = (role,) if role else (("fwd", "bwd") if spec.needs_grad else ("fwd",))
        out = []
        for r in roles:
            prefix = "backward: " if r == "bwd" and role is None else ""
            for why in capabilities.reasons(self.caps, spec, r) + self.own_reasons(spec, r):
                if prefix + why not in out:
                    out.append(prefix + why)
        return out

    def prefers(self, spec: AttnSpec, role: str) -> bool:
        """Static priority: False where another backend is known to be faster (used where no table fits)."""
        return True

    def leads(self, spec: AttnSpec, role: str) -> bool:
        """Static priority: True where this backend is known to be faster than every other (ranked before those
        that merely prefer the call; used where no table fits)."""
        return False

    def input_reasons(self, spec: AttnSpec, inputs) -> list[str]:
        """What only the call's inputs can show (whether a programmable mod compiles here): asked by auto-selection
        for calls with mods, whose spec names the features but not the functions.  Empty: it can serve them."""
        return []

    def extra_bytes(self, spec: AttnSpec, role: str = "fwd") -> int:
        """Working memory one call allocates beyond its inputs (for stats()): the output and lse forward,
        dq, dk, dv and the row statistics backward.  A backend that allocates more says so."""
        item = torch.finfo(spec.dtype).bits // 8
        rows = spec.batch * spec.seqlen_q * spec.heads_q
        if role == "fwd":
            return rows * (spec.head_dim_v * item + 4)
        keys = spec.batch * spec.seqlen_k * spec.heads_kv
        return rows * (spec.head_dim * item + 8) + keys * (spec.head_dim + spec.head_dim_v) * item

    def forward(self, spec: AttnSpec, inputs):
        raise NotImplementedError

    def backward(self, spec: AttnSpec, inputs, saved: Saved, dout, dlse):
        raise NotImplementedError

    def run(self, spec: AttnSpec, inputs):
        """This backend alone, forward and backward -> (out, lse).  An "own"-state backend overrides it."""
        from .plan import run_plan
        pair = self.__dict__.get("_pair")   # made once: a frozen dataclass costs microseconds per call
        if pair is None:
            pair = self._pair = Plan(self, self)
        return run_plan(pair, spec, inputs)


@dataclass(frozen=True)
class Plan:
    """The forward's backend and the backward's (the same object for a pair)."""

    fwd: Backend
    bwd: Backend

    @property
    def name(self) -> str:
        return self.fwd.name if self.fwd is self.bwd else f"{self.fwd.name}/{self.bwd.name}"

    def run(self, spec: AttnSpec, inputs):
        if self.fwd is self.bwd:
            return self.fwd.run(spec, inputs)
        from .plan import run_plan
        return run_plan(self, spec, inputs)


_REGISTRY: dict[str, Backend] = {}
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("flashport_backend", default=None)
fallback_counts: Counter = Counter()  # auto landings on slow paths on a GPU, by backend name
_warned: set = set()
_memo: dict = {}
MEMO_SIZE = 4096      # distinct call descriptions remembered; the oldest half is dropped beyond it


def register(backend: Backend, first: bool = False) -> Backend:
    """Add (or replace) a backend.  Static priority is registration order; `first=True` puts it ahead of
    every built-in one (a candidate kernel under rollout, which the guard then watches)."""
    global _REGISTRY
    if first:
        _REGISTRY = {backend.name: backend, **{n: b for n, b in _REGISTRY.items() if n != backend.name}}
    else:
        _REGISTRY[backend.name] = backend
    clear_cache()
    return backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    clear_cache()


def clear_cache() -> None:
    """Forget memoised choices (after registering a backend, or patching one in a test), the launch plans too."""
    _memo.clear()
    from . import plan_cache
    plan_cache.clear()


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise UnsupportedError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def backends() -> list[BackendInfo]:
    """Every registered backend in static-priority order, with why it is unavailable if it is."""
    out = []
    for b in _REGISTRY.values():
        reasons = b.availability() + _disabled_reasons(b.name)
        out.append(BackendInfo(b.name, not reasons, list(reasons), dict(b.capabilities)))
    return out


@contextlib.contextmanager
def use_backend(name: str):
    """Force a backend (or a "fwd/bwd" pair) inside the block (strict, like `backend=`)."""
    _parse(name)  # unknown names fail here, not at the first call
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def _requested(backend) -> str | None:
    """The named backend, if any: `backend=` > use_backend() > FLASHPORT_BACKEND.  Only None (or an unset
    variable) means "not given": an empty string is an unknown name, never "auto" (the contract's rule)."""
    if backend is not None:
        return backend
    forced = _forced.get()
    if forced is not None:
        return forced
    return env.raw("FLASHPORT_BACKEND")


def _disabled() -> frozenset:
    names = frozenset(n.strip() for n in env.value("FLASHPORT_DISABLE").split(",") if n.strip())
    for n in sorted(names - _REGISTRY.keys()):   # a typo in the kill switch disables nothing: say so, once per name
        env.warn_once(f"FLASHPORT_DISABLE names {n!r}, which no backend is called (backends: "
                      f"{', '.join(sorted(_REGISTRY))}); it disables nothing", stacklevel=2)
    return names


def _disabled_reasons(name: str, quarantine: bool = True) -> list[str]:
    if name in _disabled():
        return ["disabled by FLASHPORT_DISABLE"]
    why = rollout.is_quarantined(name) if quarantine else None
    return [f"quarantined ({why}; flashport.release_quarantine({name!r}) takes it back)"] if why else []


def _parse(name) -> tuple[Backend, Backend]:
    if not isinstance(name, str):
        raise TypeError(f"backend must be a backend's name (a str), got {type(name).__name__}")
    if "/" in name:
        f, _, b = name.partition("/")
        fb, bb = get(f), get(b)
        for x in (fb, bb):
            if x.caps.saved_state != "lse":
                raise UnsupportedError(f"backend {name!r}: {x.name} keeps its own forward state and cannot be "
                                       f"paired with another backend; name it alone")
        return fb, bb
    b = get(name)
    return b, b


def _state_reasons(b: Backend, spec: AttnSpec, state: str) -> list[str]:
    """What the caller's state rules out: inside the SDPA hook, a backend whose kernel here is the very op the
    hook replaces (it would enter the hook again, without end)."""
    if state == "sdpa_hook" and spec.device.type in b.caps.sdpa_flash_devices:
        return [f"runs PyTorch SDPA's flash op on {spec.device.type}, which flashport's SDPA hook replaces"]
    return []


def _reasons(b: Backend, spec: AttnSpec, role: str, quarantine: bool = True, state: str = "any") -> list[str]:
    return (b.availability() or _disabled_reasons(b.name, quarantine) or _state_reasons(b, spec, state)
            or b.supports(spec, role))


# Switches that change an answer; read at every call (a few dict lookups) and part of the memo key.
_KEY_SWITCHES = ("FLASHPORT_DISABLE", "FLASHPORT_HOPPER_FWD", "FLASHPORT_HOPPER_BWD", "FLASHPORT_TABLE",
                 "FLASHPORT_CACHE_DIR", "TRITON_INTERPRET", "FLASHPORT_ALLOW_UNTESTED_TRITON",
                 "FLASHPORT_HOPPER_FWD_WINDOW", "FLASHPORT_HOPPER_BWD_WINDOW", "FLASHPORT_HOPPER_FWD_SPLIT",
                 "FLASHPORT_HOPPER_FWD_ALIBI", "FLASHPORT_HOPPER_BWD_ALIBI", "FLASHPORT_HOPPER_BWD_SPLIT",
                 "FLASHPORT_CUDNN_FIRST")


def select(spec: AttnSpec, backend: str | None = None) -> Plan:
    return select_counted(spec, backend)[0]


def select_counted(spec: AttnSpec, backend: str | None = None, state: str = "any",
                   inputs=None) -> tuple[Plan, bool]:
    """(plan, fallback): fallback is True where auto took this plan only because its first choice is
    quarantined or because no fast GPU backend serves the call (stats() counts those calls).
    state: what the caller can take.  "any" (eager calls); "prefer_lse" (the custom ops of flashport/ops.py):
    auto prefers plans whose backward runs from (out, lse), as an own-state backward must recompute its forward
    there; "sdpa_hook" (flashport/integrations/sdpa.py, serving PyTorch SDPA's flash op): as "prefer_lse", and
    no backend, named or auto, whose kernel on this device is that op (Capabilities.sdpa_flash_devices).
    inputs: the call's AttnInputs; for a call with mods, auto then takes the first plan whose backends accept them
    (Backend.input_reasons)."""
    name = _requested(backend)
    key = (spec, name, state, env.raws(_KEY_SWITCHES))
    hit = _memo.get(key)
    if hit is None:
        hit = (_named(spec, name, state), False) if name is not None else _auto(spec, state)
        if len(_memo) >= MEMO_SIZE:   # bounded: a server that sees every sequence length must not grow
            for k in list(_memo)[:MEMO_SIZE // 2]:
                del _memo[k]
        _memo[key] = hit
    plan, fallback = hit
    refused: list = []
    if inputs is not None and name is None and spec.mods:
        plan = _accepting(spec, plan, inputs, state, refused)
    if spec.device.type == "cuda" and name is None:
        for b in {plan.fwd, plan.bwd} if spec.needs_grad else {plan.fwd}:
            if b.slow_on_gpu:
                _warn_slow(b, spec, refused)
                fallback = True
    return plan, fallback


def _plan_input_reasons(plan: Plan, spec: AttnSpec, inputs) -> list[str]:
    why = plan.fwd.input_reasons(spec, inputs)
    if spec.needs_grad and plan.bwd is not plan.fwd:
        why = why + [f"backward: {r}" for r in plan.bwd.input_reasons(spec, inputs)]
    return why


def _accepting(spec: AttnSpec, plan: Plan, inputs, state: str, refused: list) -> Plan:
    """Auto's plan for a call with mods: `plan` where its backends accept the inputs, else the first plan in auto's
    order that does (the backends passed over, with their reasons, go to `refused`)."""
    why = _plan_input_reasons(plan, spec, inputs)
    if not why:
        return plan
    refused.append(f"  - {plan.name}: " + "; ".join(why))
    for p in _lse_plans(spec, options(spec, state=state), state):
        if p == plan or p.fwd.measured_only or p.bwd.measured_only:
            continue
        why = _plan_input_reasons(p, spec, inputs)
        if not why:
            log.debug("flashport: %s chosen for %s; passed over for its inputs:\n%s", p.name, spec, "\n".join(refused))
            return p
        refused.append(f"  - {p.name}: " + "; ".join(why))
    raise UnsupportedError("no backend can serve this call's mods:\n" + "\n".join(refused))


def _named(spec: AttnSpec, name: str, state: str = "any") -> Plan:
    f, b = _parse(name)
    if f is b:
        reasons = (b.availability() or _disabled_reasons(b.name) or _state_reasons(b, spec, state)
                   or b.supports(spec))
    else:
        reasons = _reasons(f, spec, "fwd", state=state) + (
            [f"backward: {r}" for r in _reasons(b, spec, "bwd", state=state)] if spec.needs_grad else [])
    if reasons:
        raise UnsupportedError(f"backend {name!r} cannot serve this call:\n  - {name}: " + "; ".join(reasons))
    log.debug("flashport: %s chosen explicitly for %s", name, spec)
    return Plan(f, b)


def _candidates(spec: AttnSpec, tried: list) -> list[Backend]:
    out = []
    for b in _REGISTRY.values():
        if not b.auto:
            tried.append(f"  - {b.name}: never chosen automatically (name it to use it)")
        elif b.auto_devices and spec.device.type not in b.auto_devices:
            tried.append(f"  - {b.name}: not chosen automatically on {spec.device.type} (name it to use it)")
        elif not b.caps.exact:
            tried.append(f"  - {b.name}: not exact")
        else:
            out.append(b)
    return out


def options(spec: AttnSpec, tried: list | None = None, quarantine: bool = True, state: str = "any") -> list[Plan]:
    """Every plan auto-selection may take for `spec`, in static-priority order (preferred first);
    quarantine=False: as if no backend were quarantined; state: select_counted's."""
    tried = [] if tried is None else tried
    cands = _candidates(spec, tried)   # a quarantined one is refused by _reasons, with why
    fwd_ok, bwd_ok = [], []
    for b in cands:
        rf = _reasons(b, spec, "fwd", quarantine, state)
        rb = _reasons(b, spec, "bwd", quarantine, state) if spec.needs_grad else []
        if rf:
            tried.append(f"  - {b.name}: " + "; ".join(rf))
        elif rb and b.caps.saved_state == "own":
            tried.append(f"  - {b.name}: backward: " + "; ".join(rb))
        if not rf:
            fwd_ok.append(b)
        if spec.needs_grad and not rb:
            bwd_ok.append(b)
        elif spec.needs_grad and b.caps.saved_state == "lse" and not rf:
            tried.append(f"  - {b.name} (backward): " + "; ".join(rb))

    plans = []
    for f in _ranked(fwd_ok, spec, "fwd"):
        if not spec.needs_grad:
            plans.append(Plan(f, f))
        elif f.caps.saved_state == "own":
            if f in bwd_ok:
                plans.append(Plan(f, f))
        else:
            plans += [Plan(f, b) for b in _ranked([b for b in bwd_ok if b.caps.saved_state == "lse"], spec, "bwd")]
    return plans


def _ranked(bs: list, spec: AttnSpec, role: str) -> list:
    """Static priority: those that lead the call, then those that prefer it, then the others, each in registration
    order; a backend slow on a GPU (blockwise: PyTorch ops tile by tile) after every other there, whatever it
    prefers.  Else it would pair as the backward of a forward whose usual partner does not prefer the call (a Gluon
    forward at D=96, whose Triton backward defers to cuDNN's own plan), or run whole calls that cuDNN cannot serve at
    such head dims (ALiBi, softcap)."""
    slow = [b for b in bs if spec.device.type == "cuda" and getattr(b, "slow_on_gpu", False)]
    rest = [b for b in bs if b not in slow]
    lead = [b for b in rest if b.leads(spec, role)]
    rest = [b for b in rest if b not in lead]
    return lead + [b for b in rest if b.prefers(spec, role)] + [b for b in rest if not b.prefers(spec, role)] + slow


def _lse_plans(spec: AttnSpec, plans: list[Plan], state: str) -> list[Plan]:
    if state == "any" or not spec.needs_grad:
        return plans
    lse = [p for p in plans if p.fwd.caps.saved_state == "lse" and p.bwd.caps.saved_state == "lse"]
    return lse or plans


def _static(plans: list[Plan]) -> Plan | None:
    """The first plan static priority may take: none that uses a `measured_only` backend."""
    return next((p for p in plans if not (p.fwd.measured_only or p.bwd.measured_only)), None)


def _auto(spec: AttnSpec, state: str = "any") -> tuple[Plan, bool]:
    tried: list = []
    plans = _lse_plans(spec, options(spec, tried, state=state), state)
    from . import table
    plan = table.best(spec, plans) if plans else None
    how = "from the selection table" if plan is not None else "by static priority"
    plan = plan or _static(plans)
    if plan is None:
        tried += [f"  - {b.name}: chosen automatically only where the selection table measured it (name it to use it)"
                  for b in dict.fromkeys(b for p in plans for b in (p.fwd, p.bwd)) if b.measured_only]
        raise UnsupportedError("no backend can serve this call:\n" + "\n".join(tried))
    fallback = False
    if rollout._quarantined:
        every = _lse_plans(spec, options(spec, [], quarantine=False, state=state), state)
        first = table.best(spec, every) or _static(every) or plan
        fallback = first.name != plan.name
    if log.isEnabledFor(logging.DEBUG):
        log.debug("flashport: %s chosen automatically (%s%s) for %s; candidates %s; not eligible:\n%s", plan.name,
                  how, ", a fallback" if fallback else "", spec, [p.name for p in plans], "\n".join(tried) or "  none")
    return plan, fallback


def _warn_slow(b: Backend, spec: AttnSpec, refused: list = ()) -> None:
    fallback_counts[b.name] += 1   # monitor.stats() counts the call itself
    if b.name not in _warned:
        _warned.add(b.name)
        tried: list = list(refused)
        options(spec, tried)
        warnings.warn(f"flashport: no fast GPU backend serves this call, running on {b.name!r} "
                      f"(PyTorch-op speed). Reasons:\n" + "\n".join(tried), RuntimeWarning, stacklevel=5)

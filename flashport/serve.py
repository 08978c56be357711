"""Running a call once its spec is built: choose the plan, run it inside its profiler range, count it, let the
guard sample it.  The eager entry points (api.py) and the custom ops (ops.py) share it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import dispatch, monitor, plan_cache, rollout
from .contents import guard as guard_contents
from .dropout import draw_rng_state
from .kvcache import append_kv, restore_kv


def with_rng(spec, inputs):
    if spec.dropout_p > 0:
        inputs.rng_state = draw_rng_state(spec.device)
    return inputs


@dataclass(frozen=True, eq=False)
class Launch:
    """What a call's description fixes about running it (everything but the tensors): the plan and what the
    monitor counts.  flashport/plan_cache.py keeps them per description, so a repeated call skips validation,
    selection and this arithmetic."""

    spec: object
    plan: dispatch.Plan
    fallback: bool
    flops: int
    bytes_read: int
    peak_fwd: int
    peak_bwd: int
    own: bool              # the backward runs in the backend's own autograd: bracketed here for its range and count
                           # (unless the backend brackets it itself: Backend.brackets_backward)
    range: object          # a _Ranged factory's arguments, or None with FLASHPORT_RANGES=0
    guard: tuple           # rollout's (rate, tolerance) from the switches; flashport.guard() overrides it per call
    slow: bool             # a backend at PyTorch-op speed on a GPU (selection warns and counts it at every call)


def launch(spec, inputs, plan, fallback) -> Launch:
    name = plan.fwd.name
    return Launch(spec, plan, fallback, monitor.flops(spec), monitor.bytes_read(inputs),
                  plan.fwd.extra_bytes(spec, "fwd"), plan.bwd.extra_bytes(spec, "bwd") if spec.needs_grad else 0,
                  spec.needs_grad and plan.fwd.caps.saved_state == "own" and not plan.fwd.brackets_backward(spec),
                  monitor.range_args(spec, name),
                  rollout.configured(), spec.device.type == "cuda" and (plan.fwd.slow_on_gpu or plan.bwd.slow_on_gpu))


def serve(spec, inputs, plan, fallback, run=None):
    """-> (out, lse), differentiable through torch.autograd when spec.needs_grad; `run(spec, inputs)` replaces
    plan.run (forward_only's)."""
    return run_launch(launch(spec, inputs, plan, fallback), inputs, run)


def run_launch(la: Launch, inputs, run=None):
    """serve() of a prepared Launch: count it, run it inside its range, let the guard sample it."""
    spec, plan = la.spec, la.plan
    name = plan.fwd.name
    monitor.count_forward(name, la.fallback, la.flops, la.bytes_read, la.peak_fwd,
                          plan.bwd.name if spec.needs_grad else None, la.peak_bwd)
    if la.own:   # its backward runs in its own autograd: bracket it to give it a range and a count
        rng, q, k, v = monitor.bracket_inputs(spec, name, inputs.q, inputs.k, inputs.v)
        inputs = dataclasses.replace(inputs, q=q, k=k, v=v)
    try:
        with monitor.ranged_by(la.range):
            out, lse = (run or plan.run)(spec, inputs)
    except Exception:
        monitor.add(name, errors=1)
        raise
    if la.own:
        out = monitor.bracket_output(rng, out)
    check, tolerance = rollout.sampled(la.guard)
    if check:
        rollout.check(spec, inputs, out, name, tolerance)
    return out, lse


def _select(spec, inputs, backend, state):
    """Dense and varlen calls -> (plan, fallback, inputs with varlen contents guarded and the dropout seed)."""
    if spec.kind == "varlen":
        inputs = guard_contents(spec, inputs)
    plan, fallback = dispatch.select_counted(spec, backend, state, inputs)
    return plan, fallback, with_rng(spec, inputs)


def call(spec, inputs, backend, key=None):
    """Dense and varlen calls: select, then serve; key: the call's plan_cache description (None: not cached)."""
    plan, fallback, inputs = _select(spec, inputs, backend, "any")
    la = launch(spec, inputs, plan, fallback)
    plan_cache.put(key, la)
    return run_launch(la, inputs)


def forward_only(spec, inputs, backend, state):
    """For a caller with its own autograd (the custom ops): the plan is chosen for `spec` (with
    its backward when spec.needs_grad), only its forward runs -> (out, lse, saved_lse, rng_state or None).
    saved_lse is what the backward should get as lse: the forward's own float64 lse for float64 inputs (the
    contract's float32 lse would cost those gradients half their digits), else lse itself."""
    plan, fallback, inputs = _select(spec, inputs, backend, state)
    kept = {}

    def run(spec, inputs):
        if plan.fwd.caps.saved_state != "lse":
            return plan.run(spec, inputs)
        out, lse, kept["private"] = plan.fwd.forward(spec, inputs)
        return out, lse

    out, lse = serve(dataclasses.replace(spec, needs_grad=False), inputs, plan, fallback, run)
    private = kept.get("private")
    exact = (spec.dtype == torch.float64 and isinstance(private, torch.Tensor) and private.dtype == torch.float64
             and private.shape == lse.shape)
    return out, lse, private if exact else lse, inputs.rng_state


def backward_only(spec, inputs, backend, state, out, lse, dout, dlse):
    """The backward of forward_only's call -> (dq, dk, dv).  A backend that keeps its own forward state (named
    explicitly, or the only one serving the call) recomputes its forward under autograd first."""
    plan, _ = dispatch.select_counted(spec, backend, state)
    b = plan.bwd
    if b.caps.saved_state != "lse":
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
            out2, _ = serve(spec, dataclasses.replace(inputs, q=q, k=k, v=v), plan, False)
            return torch.autograd.grad(out2, (q, k, v), dout)
    saved = dispatch.Saved(inputs.q, inputs.k, inputs.v, out, lse, None, plan.fwd.name)
    monitor.add(b.name, backward=1, flops=monitor.flops(spec, "bwd"))
    try:
        with monitor.ranged(spec, b.name, backward=True):
            return b.backward(spec, inputs, saved, dout, dlse)
    except Exception:
        monitor.add(b.name, errors=1)
        raise


def kvcache_call(spec, inputs, append, k_cache, v_cache, backend, key=None, launched=None):
    """key: the call's plan_cache description (its Launch is kept); launched: the Launch of a cached description."""
    k_new, v_new, cache_seqlens = append
    if launched is None:   # (its numbers read only the tensors' shapes, which the content guard leaves alone)
        plan, fallback = dispatch.select_counted(spec, backend)  # a rejected call writes nothing into the cache
        launched = launch(spec, inputs, plan, fallback)
        plan_cache.put(key, launched)
    table = inputs.block_table   # as given (the append skips out-of-range entries itself), before guard clamps it
    inputs = guard_contents(spec, inputs, cache_seqlens)
    with torch.no_grad():
        # The slots the append overwrites come back, so a call that fails after it leaves the cache as it was.
        saved = append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, table, save=True)
        try:
            return run_launch(launched, inputs)
        except BaseException:
            restore_kv(k_cache, v_cache, saved, cache_seqlens, table)
            raise

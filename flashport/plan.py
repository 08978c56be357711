"""Running a plan: one autograd Function whose forward and backward may come from different backends.

The forward saves q, k, v, out and lse (the contract's state, which every "lse" backend reads) and its
private state; the backward gets the private state only when its backend shares the forward's
`state_family` (the Triton and Gluon kernels share lse in log2 units), and derives what it needs from
lse otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import monitor
from .dispatch import Plan, Saved


@dataclass
class _Call:
    plan: Plan
    spec: object
    inputs: object


class _Attention(torch.autograd.Function):
    """extras: the programmable call's differentiable tensors (attn_bias, captured tables), whose gradients
    the backward backend returns after dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call, *extras):
        out, lse, private = call.plan.fwd.forward(call.spec, call.inputs)
        same = private is not None and call.plan.fwd.state_family == call.plan.bwd.state_family
        ctx.save_for_backward(q, k, v, out, lse, *((private,) if same else ()))
        ctx.call = call
        ctx.n_extras = len(extras)
        # An output nobody differentiates (lse, unless returned and used) arrives as None, not as zeros.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *private = ctx.saved_tensors
        none = (None,) * ctx.n_extras
        if dout is None and dlse is None:
            return (None, None, None, None) + none
        if dout is None:   # only lse is differentiated
            dout = torch.zeros_like(out)
        call = ctx.call
        name = call.plan.bwd.name
        saved = Saved(q, k, v, out, lse, private[0] if private else None, call.plan.fwd.name)
        monitor.add(name, backward=1, flops=monitor.flops(call.spec, "bwd"))
        try:
            with monitor.ranged(call.spec, name, backward=True):
                dq, dk, dv, *dextras = call.plan.bwd.backward(call.spec, call.inputs, saved, dout, dlse)
        except Exception:
            monitor.add(name, errors=1)
            raise
        return (dq, dk, dv, None, *dextras) + none[len(dextras):]


def run_plan(plan: Plan, spec, inputs):
    """-> (out, lse); differentiable through torch.autograd when spec.needs_grad."""
    if spec.needs_grad:
        extras = () if inputs.prog is None else inputs.prog.differentiable
        return _Attention.apply(inputs.q, inputs.k, inputs.v, _Call(plan, spec, inputs), *extras)
    out, lse, _ = plan.fwd.forward(spec, inputs)
    return out, lse

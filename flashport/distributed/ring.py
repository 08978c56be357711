"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds its shard of q, k, v ([B, S_local, H, D], laid out by `layout`).  The K/V blocks travel once
around the ring (point-to-point sends posted before the step's compute, so they overlap it); at every step the
rank attends with its queries to the block in hand, one flashport call per visible rectangle (blocks.py), and
merges the partial results exactly with their lse:

    lse = log(exp(lse_acc) + exp(lse_b));   out = exp(lse_acc - lse) * out_acc + exp(lse_b - lse) * out_b

(merge_attention_states' math, with the running output in float32 -- float64 for float64 inputs -- and
cast to q's dtype once at the end).  The backward runs the ring again: each block's gradient is flashport's
backward on that block given the *final* out and lse (softmax probabilities are exp(s - lse) with the global
lse, so the blocks' gradients add up exactly), and dK/dV accumulators travel with their K/V blocks, arriving
home after a full turn.  GQA blocks travel with their Hkv heads, never expanded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import dispatch, serve
from ..dispatch import UnsupportedError
from ..spec import dense_spec
from .blocks import step_calls
from .comm import Ring
from .layout import check_divisible, check_layout, chunks_per_rank, segments

_STATE = "prefer_lse"   # plans whose backward runs from (out, lse): the ring hands it the global ones
_KV_TAG, _DKV_TAG = 0, 2


@dataclass(frozen=True)
class RingOptions:
    layout: str
    rank: int
    world: int
    local_len: int
    left: int
    right: int
    scale: float
    group: object = None

    def q_segments(self):
        return segments(self.rank, self.world, self.local_len, self.layout)

    def calls(self, step: int):
        """The calls of ring step `step`, when this rank holds the block of rank (rank - step) mod W."""
        src = (self.rank - step) % self.world
        return step_calls(self.q_segments(), segments(src, self.world, self.local_len, self.layout),
                          self.left, self.right)


def _spec(q, k, v, call, scale, needs_grad):
    spec, inputs = dense_spec(q, k, v, causal=False, softmax_scale=scale, window_size=(call.left, call.right),
                              softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=True)
    return dataclasses.replace(spec, needs_grad=needs_grad), inputs


def _block_forward(q, k, v, call, scale, needs_grad):
    spec, inputs = _spec(q, k, v, call, scale, needs_grad)
    _, _, lse, _ = out_lse = serve.forward_only(spec, inputs, None, _STATE)
    return out_lse[0], lse          # lse: float64 for float64 inputs where the backend keeps it so


def _block_backward(q, k, v, call, scale, out, lse, dout, dlse):
    spec, inputs = _spec(q, k, v, call, scale, True)
    plan, _ = dispatch.select_counted(spec, None, _STATE)
    if plan.bwd.caps.saved_state != "lse":
        raise UnsupportedError(f"ring_attention needs a backward that runs from (out, lse); {plan.bwd.name!r} "
                               "keeps its own forward state (unset FLASHPORT_BACKEND or name another backend)")
    return serve.backward_only(spec, inputs, None, _STATE, out, lse, dout, dlse)


def _merge_into(acc_out, acc_lse, call, out_b, lse_b):
    """acc rows [q0, q1) <- exact merge with a partial result over other keys (a -inf part adds nothing)."""
    a = acc_lse[:, :, call.q0:call.q1]
    lse_b = lse_b.to(a.dtype)
    m = torch.maximum(a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ea, eb = torch.exp(a - m), torch.exp(lse_b - m)
    total = ea + eb
    live = total > 0
    acc_lse[:, :, call.q0:call.q1] = torch.where(live, m + torch.log(total), torch.full_like(total, float("-inf")))
    inv = torch.where(live, 1.0 / total.clamp_min(torch.finfo(total.dtype).tiny), torch.zeros_like(total))
    wa = (ea * inv).transpose(1, 2)[..., None]            # [B, rows, Hq, 1]
    wb = (eb * inv).transpose(1, 2)[..., None]
    rows = acc_out[:, call.q0:call.q1]
    acc_out[:, call.q0:call.q1] = rows * wa + torch.where(wb > 0, out_b.to(rows.dtype) * wb, 0.0)


def _rows(t, call):       # [B, S, H, D] rows of a call, contiguous (the backends' saved-state layout)
    return t[:, call.q0:call.q1].contiguous()


def _lse_rows(t, call):   # [B, H, S]
    return t[:, :, call.q0:call.q1].contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, opts: RingOptions):
        ring = Ring(opts.group)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        b, s, hq, _ = q.shape
        out = torch.zeros(b, s, hq, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
        needs_grad = any(ctx.needs_input_grad[:3])
        k_cur, v_cur = k, v
        for step in range(opts.world):
            pending = ring.shift([k_cur, v_cur], _KV_TAG) if step + 1 < opts.world else None
            for c in opts.calls(step):
                o_b, l_b = _block_forward(q[:, c.q0:c.q1], k_cur[:, c.k0:c.k1], v_cur[:, c.k0:c.k1], c,
                                          opts.scale, needs_grad)
                _merge_into(out, lse, c, o_b, l_b)
            if pending is not None:
                k_cur, v_cur = pending.wait()
        out = out.to(q.dtype)
        saved_lse = lse if q.dtype == torch.float64 else lse.float()
        ctx.opts = opts
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, saved_lse)
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        opts: RingOptions = ctx.opts
        if dout is None:
            dout = torch.zeros_like(out)
        ring = Ring(opts.group)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        travelling = None     # the dK/dV accumulators of the block in hand, arriving from the previous rank
        for step in range(opts.world):
            pending = ring.shift([k_cur, v_cur], _KV_TAG) if step + 1 < opts.world else None
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            for c in opts.calls(step):
                g = _block_backward(q[:, c.q0:c.q1], k_cur[:, c.k0:c.k1], v_cur[:, c.k0:c.k1], c, opts.scale,
                                    _rows(out, c), _lse_rows(lse, c), _rows(dout, c),
                                    None if dlse is None else _lse_rows(dlse, c))
                dq[:, c.q0:c.q1] += g[0]
                dk[:, c.k0:c.k1] += g[1]
                dv[:, c.k0:c.k1] += g[2]
            if travelling is not None:
                dk_in, dv_in = travelling.wait()
                dk += dk_in
                dv += dv_in
            if opts.world > 1:   # on to the next rank; after the last step this is the block's way home
                travelling = ring.shift([dk, dv], _DKV_TAG)
            if pending is not None:
                k_cur, v_cur = pending.wait()
        if travelling is not None:
            dk, dv = travelling.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# ----------------------------------------------------------------------------- the entry point
def _group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call torch.distributed.init_process_group "
                         "first; a single process can use world_size=1)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    g = group if group is not None else dist.group.WORLD
    if dist.get_rank(g) < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return g


def _window(window_size, causal) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    for w in window_size:
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"window_size entries must be ints, got {window_size!r}")
        if w < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    left, right = window_size
    if causal:
        if right not in (-1, 0):
            raise ValueError(f"causal=True contradicts window_size[1]={right}: causal means right = 0")
        right = 0
    return left, right


def ring_attention(q, k, v, *, group=None, causal=False, layout="zigzag", softmax_scale=None, window_size=(-1, -1),
                   return_lse=False):
    """Exact attention over a sequence sharded across the ranks of `group` (default: the world).

    q [B, S_local, Hq, D], k [B, S_local, Hkv, D], v [B, S_local, Hkv, Dv]: this rank's shard
    (shard_sequence(x, rank, world_size, layout)) of a self-attention sequence of S = S_local * W tokens.
    Equivalent single-device math: with full = unshard_sequence(all ranks' shards, layout),
        out_full = flashport.attention(q_full, k_full, v_full, causal=..., softmax_scale=..., window_size=...)
    and this rank gets its shard of out_full ([B, S_local, Hq, Dv], q's dtype), plus its shard of the lse
    ([B, Hq, S_local] float32) with return_lse.  Differentiable in q, k, v.  Every rank of the group must call
    it with the same shapes and options.  Visibility is global: query i sees key j iff
    i - left <= j <= i + right (causal: right = 0).
    """
    g = _group(group)
    check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    left, right = _window(window_size, causal)
    # the local call's checks: tensors, ranks, dtypes, devices, Hq % Hkv, softmax_scale
    spec, _ = dense_spec(q, k, v, causal=False, softmax_scale=softmax_scale, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"q and k must hold the same shard length (self-attention), got {q.shape[1]} and "
                         f"{k.shape[1]}")
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    s_local = q.shape[1]
    if s_local % chunks_per_rank(layout):
        raise ValueError(f"q.shape[1]={s_local}: layout='zigzag' needs an even shard length (two chunks per "
                         f"rank); the global sequence length {s_local * world} cannot be sharded so")
    check_divisible(s_local * world, world, layout, "sequence length")
    if dist.get_backend(g) == "nccl" and q.device.type != "cuda":
        raise ValueError(f"q is on {q.device}, but the group's backend is NCCL: its tensors must be CUDA tensors")
    opts = RingOptions(layout=layout, rank=rank, world=world, local_len=s_local, left=left, right=right,
                       scale=spec.softmax_scale, group=group)
    out, lse = _RingAttention.apply(q, k, v, opts)
    return (out, lse) if return_lse else out

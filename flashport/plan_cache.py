"""The launch-plan cache: a dense call whose description was seen before skips validation and selection.

A description is everything the validation and the selection read: the tensors' shapes, dtypes and devices,
whether each is unit-stride in its head dimension, whether the call needs gradients, the keyword options (of
exactly the types the contract accepts), the named backend (argument and use_backend()), and every switch
(env.state_key).  The same description always passes the same checks and gets the same plan, so a hit runs the
stored serve.Launch directly on the new tensors.  What changes a choice without changing a description (a
backend registered, a table loaded, a quarantine) clears the cache through dispatch.clear_cache().

Only the common call is cached: plain tensors, no ALiBi slopes, no dropout (each call draws a seed), no
programmable mods, no plan that warns of a slow GPU path.  Everything else takes the full path every time.
KV-cache calls are cached the same way (kvcache_key); a hit still runs the checks that the tensors' memory and
contents decide (spec.kvcache_inputs: the append's aliasing, the index tensors' values where content checks are on)."""
from __future__ import annotations

import torch

from . import dispatch, env
from .spec import AttnInputs

_Tensor = torch.Tensor
_is_grad_enabled = torch.is_grad_enabled
_forced = dispatch._forced.get   # use_backend()'s name
_NUMBER = (float, int)
_cache: dict = {}
SIZE = 4096   # descriptions remembered; the oldest half is dropped beyond it (a server sees many lengths)


def _plain_options(causal, softmax_scale, window_size, softcap, alibi_slopes, return_lse, backend) -> bool:
    """Whether the options every cached entry point shares are of exactly the types the contract accepts, with no
    ALiBi slopes (anything else takes the full path, which validates it)."""
    return (alibi_slopes is None and causal.__class__ is bool and return_lse.__class__ is bool
            and window_size.__class__ is tuple and len(window_size) == 2 and window_size[0].__class__ is int
            and window_size[1].__class__ is int and softcap.__class__ in _NUMBER
            and (softmax_scale is None or softmax_scale.__class__ in _NUMBER)
            and (backend is None or backend.__class__ is str))


def dense_key(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic,
              return_lse, backend):
    """The call's description, or None where the call is not one the cache serves."""
    if (q.__class__ is not _Tensor or k.__class__ is not _Tensor or v.__class__ is not _Tensor
            or deterministic.__class__ is not bool or dropout_p.__class__ not in _NUMBER or dropout_p
            or not _plain_options(causal, softmax_scale, window_size, softcap, alibi_slopes, return_lse, backend)):
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return None
    grad = _is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (qs, ks, vs, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, grad,
            q.stride(3) == 1, k.stride(3) == 1, v.stride(3) == 1, causal, softmax_scale, window_size, softcap,
            deterministic, return_lse, backend, _forced(), env.state_key())


def _described(t):
    """(shape, dtype, device) of an optional plain tensor (None: absent); False where it is something else."""
    if t is None:
        return None
    if t.__class__ is not _Tensor:
        return False
    return t.shape, t.dtype, t.device


def kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, window_size, softcap,
                alibi_slopes, return_lse, backend):
    """A KV-cache call's description (as dense_key's, with the caches, the new tokens and the index tensors), or
    None where the cache does not serve the call: ALiBi, a Python int as cache_seqlens, or a tensor that requires
    grad (the full path raises for it)."""
    if (q.__class__ is not _Tensor or k_cache.__class__ is not _Tensor or v_cache.__class__ is not _Tensor
            or cache_seqlens.__class__ is not _Tensor
            or not _plain_options(causal, softmax_scale, window_size, softcap, alibi_slopes, return_lse, backend)):
        return None
    new, table = (_described(k), _described(v)), _described(block_table)
    if False in new or table is False or q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        return None
    if _is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
        return None
    return ("kvcache", q.shape, k_cache.shape, v_cache.shape, q.dtype, k_cache.dtype, v_cache.dtype, q.device,
            k_cache.device, v_cache.device, *new, _described(cache_seqlens), table, q.stride(3) == 1,
            k_cache.stride(3) == 1, v_cache.stride(3) == 1, causal, softmax_scale, window_size, softcap, return_lse,
            backend, _forced(), env.state_key())


def get(key):
    return None if key is None else _cache.get(key)


def put(key, launch) -> None:
    if key is None or launch.slow:
        return
    if len(_cache) >= SIZE:
        for old in list(_cache)[:SIZE // 2]:
            del _cache[old]
    _cache[key] = launch


def clear() -> None:
    _cache.clear()


def inputs(q, k, v) -> AttnInputs:
    """The call's tensors as dense_spec would pass them (a copy only where the head dimension is strided)."""
    return AttnInputs(q if q.stride(3) == 1 else q.contiguous(), k if k.stride(3) == 1 else k.contiguous(),
                      v if v.stride(3) == 1 else v.contiguous())

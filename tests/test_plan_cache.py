"""The launch-plan cache (flashport/plan_cache.py): a repeated call skips validation and selection, and nothing a
description leaves out can change what a call does or which errors it raises."""
import random

import pytest
import torch

import flashport
from flashport import api, dispatch, plan_cache, rollout


def _qkv(s=8, grad=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(s)
    return tuple(torch.randn(1, s, 2, 16, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(3))


@pytest.fixture(autouse=True)
def _fresh():
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


@pytest.fixture
def specs_built(monkeypatch):
    """How many calls went through validation (api.dense_spec)."""
    n = [0]
    real = api.dense_spec

    def counted(*a, **kw):
        n[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(api, "dense_spec", counted)
    return n


def test_a_repeated_call_is_validated_once_and_a_new_shape_again(specs_built):
    q, k, v = _qkv()
    first = flashport.attention(q, k, v, causal=True)
    again = flashport.attention(*(x.clone() for x in (q, k, v)), causal=True)
    assert specs_built[0] == 1
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    flashport.attention(*_qkv(s=9), causal=True)
    flashport.attention(q, k, v, causal=False)
    assert specs_built[0] == 3


def test_bad_input_after_a_cached_good_call_still_raises():
    q, k, v = _qkv()
    flashport.attention(q, k, v, causal=True, softmax_scale=0.5, window_size=(3, 0))
    with pytest.raises(TypeError, match="causal"):
        flashport.attention(q, k, v, causal=1, softmax_scale=0.5, window_size=(3, 0))
    with pytest.raises(TypeError, match="window_size"):
        flashport.attention(q, k, v, causal=True, softmax_scale=0.5, window_size=(3, False))
    with pytest.raises(ValueError, match="softmax_scale"):
        flashport.attention(q, k, v, causal=True, softmax_scale=float("nan"), window_size=(3, 0))
    with pytest.raises(TypeError, match="share one dtype"):
        flashport.attention(q, k.double(), v, causal=True, softmax_scale=0.5, window_size=(3, 0))
    with pytest.raises(TypeError, match="softcap"):
        flashport.attention(q, k, v, causal=True, softmax_scale=0.5, window_size=(3, 0), softcap=True)


def test_a_strided_head_dim_is_copied_on_a_hit_as_on_a_miss():
    q, k, v = _qkv()
    ref = flashport.attention(q, k, v)
    wide = torch.stack([k, k], -1)[..., 0]           # k's values, head dimension at stride 2
    assert wide.stride(-1) == 2
    for _ in range(2):
        torch.testing.assert_close(flashport.attention(q, wide, v), ref, rtol=0, atol=0)


def test_the_named_backend_and_the_switches_are_part_of_the_description(monkeypatch):
    q, k, v = _qkv()
    ran = []
    ref = dispatch._REGISTRY["reference"]
    real = ref.forward
    monkeypatch.setattr(ref, "forward", lambda s, i: ran.append(1) or real(s, i))
    flashport.attention(q, k, v)
    assert ran == []
    with flashport.use_backend("reference"):
        flashport.attention(q, k, v)
    assert len(ran) == 1
    flashport.attention(q, k, v)
    assert len(ran) == 1
    monkeypatch.setenv("FLASHPORT_BACKEND", "reference")
    flashport.attention(q, k, v)
    assert len(ran) == 2
    monkeypatch.setenv("FLASHPORT_DISABLE", "reference")
    with pytest.raises(flashport.UnsupportedError, match="disabled"):
        flashport.attention(q, k, v)


def test_a_hit_counts_and_is_guarded_like_a_miss():
    q, k, v = _qkv()
    flashport.reset_stats()
    for _ in range(3):
        flashport.attention(q, k, v)
    name = dispatch.select(api.dense_spec(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                          alibi_slopes=None, dropout_p=0.0, deterministic=False,
                                          return_lse=False)[0]).fwd.name
    st = flashport.stats()[name]
    assert st["calls"] == 3 and st["forward"] == 3 and st["flops"] > 0 and st["peak_extra_bytes"] > 0
    with flashport.guard(sample_rate=1.0):
        flashport.attention(q, k, v)
    rollout.collect(wait=True)
    assert flashport.stats()[name]["guard_checks"] == 1


def test_grad_mode_is_part_of_the_description():
    q, k, v = _qkv(grad=True)
    with torch.no_grad():
        assert not flashport.attention(q, k, v).requires_grad
    out = flashport.attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_a_quarantine_clears_the_cache():
    q, k, v = _qkv()
    first = dispatch.select(api.dense_spec(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1),
                                           softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False,
                                           return_lse=False)[0]).fwd.name
    flashport.attention(q, k, v)
    assert len(plan_cache._cache) == 1
    rollout.quarantine(first, "test")
    try:
        assert len(plan_cache._cache) == 0
        flashport.reset_stats()
        flashport.attention(q, k, v)
        assert first not in flashport.stats()
    finally:
        rollout.release_quarantine(first)


def test_uncached_calls_and_the_bound(monkeypatch):
    q, k, v = _qkv()
    flashport.attention(q, k, v, dropout_p=0.1)
    flashport.attention(q, k, v, window_size=[2, 0])
    flashport.attention(q, k, v, alibi_slopes=torch.ones(2))
    assert len(plan_cache._cache) == 0
    monkeypatch.setattr(plan_cache, "SIZE", 4)
    for s in range(1, 11):
        flashport.attention(*_qkv(s=s))
        assert len(plan_cache._cache) <= 4


def _random_call(rng):
    """(q, k, v), keywords, whether gradients are taken: one random call over the dense contract (rng: random.Random)."""
    b, hkv = rng.choice((1, 2)), rng.choice((1, 2))
    sq, sk = rng.choice((1, 5, 17, 33)), rng.choice((1, 5, 17, 33))
    d = rng.choice((8, 16, 40))
    dtype = rng.choice((torch.float32, torch.float64, torch.float16, torch.bfloat16))
    causal = rng.random() < 0.4
    window = (rng.choice((-1, 0, 3, 9)), -1 if causal else rng.choice((-1, 0, 4)))
    kw = dict(causal=causal, window_size=window, softcap=rng.choice((0.0, 0.0, 5.0)),
              softmax_scale=rng.choice((None, 0.3, 1)), return_lse=rng.random() < 0.5)
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    shapes = ((b, sq, hkv * rng.choice((1, 2)), d), (b, sk, hkv, d), (b, sk, hkv, d))
    qkv = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    if rng.random() < 0.3:   # a strided head dimension
        qkv[1] = torch.stack([qkv[1], qkv[1]], -1)[..., 0]
    return qkv, kw, rng.random() < 0.5


@pytest.mark.parametrize("seed", range(60))
def test_a_hit_gives_what_a_miss_gives_over_random_calls(seed):
    """Random calls over the dense contract (shapes, GQA, masks, softcap, scale, dtypes, strides, lse, grads): the
    second call (a hit) returns bit for bit what the first (a miss) and an uncached call return, gradients included."""
    qkv, kw, grad = _random_call(random.Random(seed))

    def call():
        xs = [x.detach().clone().requires_grad_(grad) for x in qkv]
        res = flashport.attention(*xs, **kw)
        out = res[0] if kw["return_lse"] else res
        grads = torch.autograd.grad(out.float().sum(), xs) if grad else ()
        return (res if kw["return_lse"] else (res,)), grads

    first = call()
    n = len(plan_cache._cache)
    second = call()
    assert len(plan_cache._cache) == n
    dispatch.clear_cache()
    uncached = call()
    for a, b_, c in zip([*first[0], *first[1]], [*second[0], *second[1]], [*uncached[0], *uncached[1]]):
        torch.testing.assert_close(b_, a, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(c, a, rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------- KV-cache calls
def _kv_state(seed, paged=False, b=2, cap=24, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    if paged:
        kc, vc = (torch.randn(2 * b * cap // 8, 8, hkv, d, generator=g) for _ in range(2))
        table = torch.randperm(2 * b * cap // 8, generator=g)[:b * cap // 8].reshape(b, cap // 8).to(torch.int32)
    else:
        kc, vc = (torch.randn(b, cap, hkv, d, generator=g) for _ in range(2))
        table = None
    return kc, vc, table


def _kv_call(seed, kc, vc, table, b=2, cap=24, hkv=2, d=16):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    sq = rng.choice([1, 1, 3])
    s_new = rng.choice([0, 1, sq])
    q = torch.randn(b, sq, 2 * hkv, d, generator=g)
    k, v = (torch.randn(b, s_new, hkv, d, generator=g) for _ in range(2)) if s_new else (None, None)
    lens = torch.tensor([rng.randint(0, cap - s_new) for _ in range(b)], dtype=torch.int32)
    kw = dict(cache_seqlens=lens, block_table=table, causal=rng.random() < 0.5,
              window_size=rng.choice([(-1, -1), (4, 0)]), return_lse=rng.random() < 0.5)
    return (q, kc, vc, k, v), kw


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_calls_give_the_same_results_and_appends_cached_or_not(paged, monkeypatch):
    described = [0]
    real = api.kvcache_spec
    monkeypatch.setattr(api, "kvcache_spec", lambda *a, **kw: described.__setitem__(0, described[0] + 1) or real(*a, **kw))
    states = [_kv_state(3, paged) for _ in range(2)]
    for i in range(30):
        results = []
        for n, (kc, vc, table) in enumerate(states):   # state 0 through the cache, state 1 uncached
            args, kw = _kv_call(100 + i, kc, vc, table)
            with monkeypatch.context() as m:
                if n == 1:   # never cached
                    m.setattr(plan_cache, "kvcache_key", lambda *a: None)
                results.append(flashport.attention_with_kvcache(*args, **kw))
        for a, b in zip(*(r if isinstance(r, tuple) else (r,) for r in results)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(states[0][:2], states[1][:2]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)   # the same appends
    assert 30 < described[0] < 2 * 30   # state 0's repeated descriptions were not validated again


def test_a_cached_kvcache_description_still_checks_memory_and_contents():
    kc, vc, _ = _kv_state(0)
    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    flashport.attention_with_kvcache(q, kc, vc, k, k.clone(), cache_seqlens=lens)
    assert plan_cache._cache   # described and kept
    with pytest.raises(ValueError, match="cache_seqlens"):   # contents: past the capacity
        flashport.attention_with_kvcache(q, kc, vc, k, k.clone(), cache_seqlens=torch.tensor([3, 24], dtype=torch.int32))
    with pytest.raises(ValueError, match="overlaps k_cache"):   # memory: the new tokens alias the cache
        flashport.attention_with_kvcache(q, kc, vc, kc[:, :1], k.clone(), cache_seqlens=lens)
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        flashport.attention_with_kvcache(q, kc, vc, k, k.clone(), cache_seqlens=lens.long())
    with pytest.raises(ValueError, match="inference-only"):
        flashport.attention_with_kvcache(q.requires_grad_(), kc, vc, k, k.clone(), cache_seqlens=lens)


def test_a_cached_kvcache_call_that_fails_leaves_the_cache_as_it_was(monkeypatch):
    kc, vc, _ = _kv_state(1)
    q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    flashport.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens)
    before = kc.clone(), vc.clone()
    backend = dispatch.get("sdpa-cpu")
    monkeypatch.setattr(backend, "forward", lambda spec, inputs: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        flashport.attention_with_kvcache(q, kc, vc, k * 2, v * 2, cache_seqlens=lens)   # a hit: same description
    torch.testing.assert_close(kc, before[0], rtol=0, atol=0)
    torch.testing.assert_close(vc, before[1], rtol=0, atol=0)

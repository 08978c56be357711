"""attention_with_kvcache (dense and paged, in-place append, chunked prefill, GQA, window, softcap)
on `reference` and `blockwise` against flashport.attention on the equivalent dense k/v; rejected
calls write nothing.  Also merge_attention_states."""
import pytest
import torch

import flashport
from flashport.kvcache import gather_pages

BACKENDS = ["reference", "blockwise"]
HQ, HKV, D, DV = 4, 2, 16, 8


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    from flashport.backend import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_M", 4)
    monkeypatch.setattr(blockwise, "BLOCK_N", 16)


def make_cache(b, capacity, page=None, seed=0):
    """Dense [B, capacity, Hkv, D|Dv] or paged caches with a shuffled block table; every slot holds
    NaN so that reading a position past the valid length would show."""
    g = torch.Generator().manual_seed(seed)
    if page is None:
        kc = torch.full((b, capacity, HKV, D), float("nan"))
        vc = torch.full((b, capacity, HKV, DV), float("nan"))
        return kc, vc, None
    nblk = -(-capacity // page)
    num_blocks = b * nblk + 3                                  # spare blocks nobody uses
    kc = torch.full((num_blocks, page, HKV, D), float("nan"))
    vc = torch.full((num_blocks, page, HKV, DV), float("nan"))
    table = torch.randperm(num_blocks, generator=g)[:b * nblk].reshape(b, nblk).to(torch.int32)
    return kc, vc, table


def dense_view(cache, table):
    return cache if table is None else gather_pages(cache, table)


def fill_prefix(kc, vc, table, lens, seed=1):
    """Write random valid prefixes of length lens[b] directly into the cache slots."""
    g = torch.Generator().manual_seed(seed)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        k = torch.randn(1, n, HKV, D, generator=g)
        v = torch.randn(1, n, HKV, DV, generator=g)
        if table is None:
            kc[b, :n], vc[b, :n] = k[0], v[0]
        else:
            page = kc.shape[1]
            for p in range(n):
                blk = table[b, p // page].item()
                kc[blk, p % page], vc[blk, p % page] = k[0, p], v[0, p]


def expected(q, kc, vc, table, lens, **kw):
    """flashport.attention (reference) per batch entry on the first lens[b] cache positions."""
    k, v = dense_view(kc, table), dense_view(vc, table)
    outs, lses = [], []
    slopes = kw.pop("alibi_slopes", None)
    for b, n in enumerate(lens):
        o, l = flashport.attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], return_lse=True, backend="reference",
                                   alibi_slopes=slopes if slopes is None or slopes.dim() == 1 else slopes[b:b + 1],
                                   **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


SETTINGS = [
    dict(),
    dict(causal=True),
    dict(causal=True, window_size=(5, 0)),
    dict(softcap=2.5),
    dict(causal=True, alibi=True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [None, 16, 256], ids=lambda p: "dense" if p is None else f"page{p}")
@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: "-".join(kw) or "plain")
@pytest.mark.parametrize("sq", [1, 5], ids=lambda s: "decode" if s == 1 else "prefill")
def test_append_then_attend(backend, page, kw, sq):
    b, capacity = 3, 40
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(b, HQ) * 0.3 + 0.05 if page else torch.rand(HQ) * 0.3 + 0.05
    kc, vc, table = make_cache(b, capacity, page)
    before = [0, 17, 33]
    fill_prefix(kc, vc, table, before)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, sq, HQ, D, generator=g)
    k_new, v_new = torch.randn(b, sq, HKV, D, generator=g), torch.randn(b, sq, HKV, DV, generator=g)
    untouched = dense_view(kc, table).clone()
    out, lse = flashport.attention_with_kvcache(q, kc, vc, k_new, v_new, block_table=table, return_lse=True,
                                                cache_seqlens=torch.tensor(before, dtype=torch.int32),
                                                backend=backend, **kw)
    # the cache now holds the new tokens at cache_seqlens, and nothing else moved
    dk, dv = dense_view(kc, table), dense_view(vc, table)
    for i, n in enumerate(before):
        assert torch.equal(dk[i, n:n + sq], k_new[i]) and torch.equal(dv[i, n:n + sq], v_new[i])
        assert torch.equal(dk[i, :n], untouched[i, :n])
        assert dk[i, n + sq:].isnan().all(), "append wrote past its slots"
    want, want_lse = expected(q, kc, vc, table, [n + sq for n in before], **kw)
    assert out.shape == (b, sq, HQ, DV) and lse.shape == (b, HQ, sq) and lse.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [None, 16])
def test_whole_cache_valid_without_seqlens(backend, page):
    kc, vc, table = make_cache(2, 32, page)
    fill_prefix(kc, vc, table, [32, 32])
    q = torch.randn(2, 3, HQ, D)
    out = flashport.attention_with_kvcache(q, kc, vc, block_table=table, causal=True, backend=backend)
    want, _ = expected(q, kc, vc, table, [32, 32], causal=True)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_cache_rows_are_zero(backend):
    kc, vc, _ = make_cache(2, 8)
    out, lse = flashport.attention_with_kvcache(torch.randn(2, 1, HQ, D), kc, vc, return_lse=True, backend=backend,
                                                cache_seqlens=torch.zeros(2, dtype=torch.int32))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# ----------------------------------------------------------------------------- rejected calls
def _snapshot(*ts):
    return [t.clone() for t in ts]


def _same(a, b):
    return all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejected_calls_write_nothing(backend):
    kc, vc, table = make_cache(2, 32, 16)
    q = torch.randn(2, 2, HQ, D)
    k_new, v_new = torch.randn(2, 2, HKV, D), torch.randn(2, 2, HKV, DV)
    saved = _snapshot(kc, vc)
    bad = [
        dict(cache_seqlens=torch.tensor([31, 0], dtype=torch.int32), block_table=table),         # too small
        dict(cache_seqlens=torch.tensor([0, 0], dtype=torch.int32), block_table=table + 100),    # out of range
        dict(cache_seqlens=torch.tensor([0, 0], dtype=torch.int32), block_table=table.long()),   # wrong dtype
        dict(cache_seqlens=torch.tensor([-1, 0], dtype=torch.int32), block_table=table),         # negative
    ]
    for kw in bad:
        with pytest.raises((ValueError, TypeError)):
            flashport.attention_with_kvcache(q, kc, vc, k_new, v_new, backend=backend, **kw)
        assert _same(saved, (kc, vc)), f"rejected call {kw} wrote into the cache"
    with pytest.raises(ValueError):  # an unknown backend is rejected before the append
        flashport.attention_with_kvcache(q, kc, vc, k_new, v_new, block_table=table, backend="no-such-backend",
                                         cache_seqlens=torch.tensor([0, 0], dtype=torch.int32))
    assert _same(saved, (kc, vc))
    with pytest.raises(flashport.UnsupportedError):  # a known backend refusing the call (sdpa has no cache)
        flashport.attention_with_kvcache(q, kc, vc, k_new, v_new, block_table=table, backend="sdpa",
                                         cache_seqlens=torch.tensor([0, 0], dtype=torch.int32))
    assert _same(saved, (kc, vc))


@pytest.mark.parametrize("which", ["q", "k", "k_cache"])
def test_inputs_requiring_grad_raise(which):
    kc, vc, _ = make_cache(1, 8)
    kc.zero_(), vc.zero_()
    args = dict(q=torch.randn(1, 1, HQ, D), k_cache=kc, v_cache=vc, k=torch.randn(1, 1, HKV, D),
                v=torch.randn(1, 1, HKV, DV))
    args[which].requires_grad_()
    with pytest.raises(ValueError, match="grad"):
        flashport.attention_with_kvcache(**args, cache_seqlens=torch.zeros(1, dtype=torch.int32), backend="blockwise")


# ----------------------------------------------------------------------------- merge
def _parts(q, k, v, cuts, **kw):
    bounds = [0, *cuts, k.shape[1]]
    res = [flashport.attention(q, k[:, a:b], v[:, a:b], return_lse=True, backend="blockwise", **kw)
           for a, b in zip(bounds, bounds[1:])]
    return [o for o, _ in res], [l for _, l in res]


@pytest.mark.parametrize("cuts", [[13], [5, 30], [0, 20]], ids=str)
def test_merge_of_parts_equals_whole(cuts):
    q, k, v = torch.randn(2, 7, HQ, D), torch.randn(2, 41, HKV, D), torch.randn(2, 41, HKV, DV)
    whole, whole_lse = flashport.attention(q, k, v, return_lse=True, backend="reference")
    outs, lses = _parts(q, k, v, cuts)
    out, lse = flashport.merge_attention_states(outs, lses)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)


def test_merge_ignores_empty_parts_and_their_garbage():
    q, k, v = torch.randn(1, 6, HQ, D), torch.randn(1, 20, HKV, D), torch.randn(1, 20, HKV, DV)
    outs, lses = _parts(q, k, v, [9])
    garbage = torch.full_like(outs[0], float("nan"))
    empty_lse = torch.full_like(lses[0], float("-inf"))
    out, lse = flashport.merge_attention_states([outs[0], garbage, outs[1]], [lses[0], empty_lse, lses[1]])
    whole, whole_lse = flashport.attention(q, k, v, return_lse=True, backend="reference")
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)


def test_merge_all_empty_rows_are_zero():
    q, k, v = torch.randn(1, 8, HQ, D), torch.randn(1, 8, HKV, D), torch.randn(1, 8, HKV, DV)
    # causal, 8 queries against 4 keys per part (bottom-right): rows 0..3 see no key in either part
    outs, lses = [], []
    for a, b in ((0, 4), (4, 8)):
        o, l = flashport.attention(q, k[:, a:b], v[:, a:b], causal=True, return_lse=True, backend="blockwise")
        outs.append(o)
        lses.append(l)
    outs[0][:, :4] = float("nan")          # rows with lse -inf in every part: their out is garbage
    out, lse = flashport.merge_attention_states(outs, lses)
    assert torch.isneginf(lse[..., :4]).all()
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isfinite(out).all()

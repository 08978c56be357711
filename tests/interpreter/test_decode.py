"""Interpreter tier: the Triton KV-cache kernel (dense + paged, split-KV) and the merge kernel,
against the `reference` backend under the tolerance rule (tests/conformance.py).

Caches are poisoned with NaN beyond every sequence's valid length (and in unused pages), so a
kernel that reads a key it must not read produces NaN and fails.  The reference runs on a clone
of the cache with the poison replaced by zeros.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import flashport
from conformance import assert_within_rule
from flashport.backend.reference import materialized_attention
from flashport.kernels.decode import kvcache_attention, kvcache_supports, valid_lengths
from flashport.kernels.merge import merge_partials, merge_states_triton
from flashport.kernels.splitkv import choose_config, choose_num_splits
from flashport.kvcache import append_kv, gather_pages
from flashport.merge import merge_states_torch
from flashport.kernels.attn_fwd import kvcache_forward
from flashport.spec import kvcache_spec

pytestmark = [
    pytest.mark.interpreter,
    # The interpreter turns the kernels' runtime loop bounds into ints through a deprecated NumPy path.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


@dataclass(frozen=True)
class KV:
    lens: tuple = (0, 17, 69)     # cache lengths before the append, one per batch entry
    cap: int = 70                 # capacity (dense S_cache, or max_blocks * page)
    sq: int = 1
    s_new: int = 1
    hq: int = 4
    hkv: int = 1
    d: int = 32
    dv: Optional[int] = None
    page: int = 0                 # 0 = dense cache
    causal: bool = True
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None
    scale: Optional[float] = None
    dtype: torch.dtype = torch.float32
    strided: bool = False
    num_splits: Optional[int] = 3
    block_m: Optional[int] = None
    block_n: Optional[int] = None
    prefill: bool = False         # the prefill kernel (attn_fwd.kvcache_forward) instead of the decode kernel

    @property
    def b(self):
        return len(self.lens)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def _strided(x):
    """Same values, non-contiguous (unit stride only in the last dim)."""
    big = torch.full((*x.shape[:-1], x.shape[-1] + 5), float("nan"), dtype=x.dtype)
    big[..., 2:2 + x.shape[-1]] = x
    return big[..., 2:2 + x.shape[-1]]


def make(case: KV, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = case.dv or case.d

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(case.dtype)

    q = rnd(case.b, case.sq, case.hq, case.d)
    k_full, v_full = rnd(case.b, case.cap, case.hkv, case.d), rnd(case.b, case.cap, case.hkv, dv)
    for b, n in enumerate(case.lens):          # poison everything past the valid length
        k_full[b, n:] = float("nan")
        v_full[b, n:] = float("nan")
    k_new = rnd(case.b, case.s_new, case.hkv, case.d) if case.s_new else None
    v_new = rnd(case.b, case.s_new, case.hkv, dv) if case.s_new else None
    block_table = None
    if case.page:
        n_pages = case.cap // case.page
        num_blocks = case.b * n_pages + 3      # spare blocks stay NaN and unreferenced
        perm = torch.randperm(num_blocks, generator=g)[: case.b * n_pages]
        block_table = perm.reshape(case.b, n_pages).to(torch.int32)
        k_cache = torch.full((num_blocks, case.page, case.hkv, case.d), float("nan"), dtype=case.dtype)
        v_cache = torch.full((num_blocks, case.page, case.hkv, dv), float("nan"), dtype=case.dtype)
        pos = torch.arange(case.cap)
        for b in range(case.b):
            blocks = block_table[b].long()[pos // case.page]
            k_cache[blocks, pos % case.page] = k_full[b]
            v_cache[blocks, pos % case.page] = v_full[b]
    else:
        k_cache, v_cache = k_full, v_full
        if case.strided:
            k_cache, v_cache = _strided(k_cache), _strided(v_cache)
    if case.strided:
        q = _strided(q)
    slopes = None
    if case.alibi == "head":
        slopes = torch.rand(case.hq, generator=g) * 0.5 + 0.05
    elif case.alibi == "batch_head":
        slopes = torch.rand(case.b, case.hq, generator=g) * 0.5 + 0.05
    lens = torch.tensor(case.lens, dtype=torch.int32)
    return q, k_cache, v_cache, k_new, v_new, lens, block_table, slopes


def _kw(case: KV, slopes):
    return dict(causal=case.causal, softmax_scale=case.scale, window_size=case.window, softcap=case.softcap,
                alibi_slopes=slopes)


def run_triton(case: KV, q, k_cache, v_cache, k_new, v_new, lens, block_table, slopes):
    """What flashport.attention_with_kvcache does, with the split / tile overrides of the case."""
    spec, inputs, (k, v, cache_seqlens) = kvcache_spec(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=block_table, return_lse=True,
        **_kw(case, slopes))
    assert kvcache_supports(spec) == []
    append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table)
    if case.prefill:
        return kvcache_forward(spec, inputs.q, inputs.k, inputs.v, valid_lengths(spec, inputs), inputs.block_table,
                               alibi=inputs.alibi_slopes)
    return kvcache_attention(spec, inputs, num_splits=case.num_splits, block_m=case.block_m,
                             block_n=case.block_n)


def expected_cache(cache, new, lens, block_table):
    """The cache after the in-place append, computed independently of flashport.kvcache."""
    cache = cache.clone()
    if new is None:
        return cache
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            pos = int(lens[b]) + t
            if block_table is None:
                cache[b, pos] = new[b, t]
            else:
                page = cache.shape[1]
                cache[int(block_table[b, pos // page]), pos % page] = new[b, t]
    return cache


def check(case: KV, seed=0, via_api=False):
    q, k_cache, v_cache, k_new, v_new, lens, bt, slopes = make(case, seed)
    k_ref, v_ref = k_cache.nan_to_num(0.0).double(), v_cache.nan_to_num(0.0).double()
    want_k = expected_cache(k_cache, k_new, lens, bt)
    want_v = expected_cache(v_cache, v_new, lens, bt)

    if via_api:
        out, lse = flashport.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                                    block_table=bt, return_lse=True, backend="triton",
                                                    **_kw(case, slopes))
    else:
        out, lse = run_triton(case, q, k_cache, v_cache, k_new, v_new, lens, bt, slopes)
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    assert out.shape == (case.b, case.sq, case.hq, case.dv or case.d) and lse.shape == (case.b, case.hq, case.sq)
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True, msg="in-place append of k")
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True, msg="in-place append of v")

    dbl = (lambda t: None if t is None else t.double())
    ref, ref_lse = flashport.attention_with_kvcache(
        q.double(), k_ref, v_ref, dbl(k_new), dbl(v_new), cache_seqlens=lens, block_table=bt, return_lse=True,
        backend="reference", **_kw(case, slopes))
    # Same-dtype math path over the appended (clean) cache, for the tolerance rule.
    k_dense = gather_pages(k_ref, bt) if bt is not None else k_ref
    v_dense = gather_pages(v_ref, bt) if bt is not None else v_ref
    left, right = case.window
    right = 0 if case.causal else right
    alibi = None if slopes is None else slopes.expand(case.b, case.hq)
    low, low_lse = materialized_attention(
        q, k_dense.to(case.dtype), v_dense.to(case.dtype), scale=case.scale or case.d ** -0.5,
        softcap=case.softcap, alibi=alibi, left=left, right=right, seqlens_k=lens + case.s_new,
        compute_dtype=case.dtype)
    assert_within_rule(f"out {case}", out, ref, low, case.dtype, 2)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"lse -inf pattern {case}"
    assert_within_rule(f"lse {case}", lse[finite], ref_lse[finite], low_lse[finite], case.dtype, 2)
    assert (out.float()[~finite.transpose(1, 2)] == 0).all(), "rows that see no key must be zeros"
    return out, lse


F16 = torch.float16
CASES = {
    # Sq = 1 decode, MQA, an empty cache before the append and one that ends full.
    "dense-mqa-decode": KV(),
    # Zero-length sequences (no append) see no key; GQA Hq=4/Hkv=2; odd head dims, Dv != D.
    "dense-gqa-f16-zero-len": KV(lens=(0, 33, 64), cap=64, s_new=0, hkv=2, d=40, dv=24, dtype=F16, num_splits=2),
    # Page 16 with BLOCK_N = 32: every tile straddles two pages of a shuffled table.
    "paged16-straddle": KV(lens=(15, 79, 40), cap=80, page=16, hkv=2, block_n=32),
    # A page (48) that BLOCK_N neither divides nor is divided by; Sq = 4 speculative verification.
    "paged48-verify-f16": KV(lens=(0, 50, 92), cap=96, page=48, sq=4, s_new=4, block_n=32, num_splits=2,
                             dtype=F16),
    # Larger pages, chunked prefill of 3 tokens, more splits than tiles for the short sequence.
    "paged128-chunk": KV(lens=(3, 125, 200), cap=256, page=128, sq=3, s_new=3, hkv=2, num_splits=4),
    "window-causal": KV(lens=(2, 30, 60), cap=64, sq=3, s_new=3, window=(8, 0), hkv=2, num_splits=2),
    "window-two-sided": KV(lens=(9, 40), cap=48, sq=2, s_new=0, causal=False, window=(5, 2)),
    "softcap-paged": KV(lens=(31, 64), cap=64, page=16, softcap=3.0, s_new=0, hkv=2),
    "alibi-head": KV(lens=(5, 40), cap=48, sq=2, s_new=2, alibi="head", scale=0.3),
    "alibi-batch-head-paged-f16": KV(lens=(20, 47), cap=64, page=32, alibi="batch_head", hkv=2, dtype=F16),
    "noncausal-sq5": KV(lens=(6, 26), cap=32, sq=5, s_new=2, causal=False, hkv=2, num_splits=2),
    # 36 packed rows in BLOCK_M = 16 blocks: each row block computes its own key range.
    "row-blocks-window": KV(lens=(0, 45), cap=64, sq=9, s_new=9, window=(6, 0), block_m=16, num_splits=2),
    # More query rows than keys without an append: the first rows see nothing.
    "sq-exceeds-len": KV(lens=(1, 0, 4), cap=16, sq=3, s_new=0, num_splits=1),
    "strided": KV(lens=(12, 30), cap=32, sq=2, s_new=1, strided=True, hkv=2, d=24),
    # No overrides: the split heuristic and the default tiles.
    "heuristic": KV(lens=(7, 100), cap=112, page=16, sq=2, s_new=1, hkv=2, num_splits=None),
}


# Chunked prefill and verification on the prefill kernel (tiles of 16 x 16 here): query rows spanning several Q tiles.
PREFILL_CASES = {
    "chunk-dense-gqa": KV(lens=(0, 23, 47), cap=96, sq=33, s_new=33, hkv=2),
    "chunk-paged16-f16": KV(lens=(5, 40), cap=96, page=16, sq=20, s_new=20, hkv=2, dtype=F16),
    # A page (48) that the 16-key tile divides, and one (24) that splits tiles across pages.
    "chunk-paged48": KV(lens=(0, 50, 70), cap=144, page=48, sq=17, s_new=17, hkv=1),
    "chunk-paged24-window": KV(lens=(9, 60), cap=96, page=24, sq=18, s_new=18, window=(10, 0), hkv=2),
    "chunk-softcap-alibi": KV(lens=(3, 30), cap=64, sq=19, s_new=19, softcap=2.0, alibi="batch_head", hkv=2),
    "chunk-noncausal-dv": KV(lens=(7, 26), cap=64, sq=16, s_new=5, causal=False, d=40, dv=24, hkv=2),
    "chunk-no-append-short-cache": KV(lens=(1, 0, 30), cap=32, sq=18, s_new=0, hkv=2),
    "chunk-strided": KV(lens=(12, 30), cap=64, sq=17, s_new=17, strided=True, hkv=2, d=24),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kvcache_kernel(name):
    check(CASES[name])


@pytest.mark.parametrize("name", list(CASES) + list(PREFILL_CASES))
def test_kvcache_on_the_prefill_kernel(name):
    check(PREFILL_CASES.get(name, CASES.get(name)).replace(prefill=True))


def test_splits_agree_with_one_split():
    """Splitting only changes the summation order: all split counts agree with one split closely."""
    base = KV(lens=(10, 60, 95), cap=96, page=16, hkv=2, s_new=1, num_splits=1, block_n=16)
    out1, lse1 = check(base)
    for splits in (2, 5, 7):
        out, lse = check(base.replace(num_splits=splits))
        torch.testing.assert_close(out, out1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, lse1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["paged16-straddle", "paged128-chunk", "window-causal", "row-blocks-window",
                                  "dense-gqa-f16-zero-len", "paged48-verify-f16"])
def test_fixed_chunks_conform(name, monkeypatch):
    """FLASHPORT_DECODE_FIXED_CHUNKS=1: every sequence in chunks of the capacity's share per split (short sequences
    leave their last splits empty); ragged lengths, pages that tiles straddle, windows, row blocks, empty sequences,
    several split counts, against the reference."""
    monkeypatch.setenv("FLASHPORT_DECODE_FIXED_CHUNKS", "1")
    case = CASES[name]
    for splits in {case.num_splits or 2, 3, 5}:
        check(case.replace(num_splits=splits))


def test_public_api_triton_backend():
    names = [b.name for b in flashport.backends()]
    if "triton" not in names:
        pytest.skip("the triton backend is not registered in this checkout yet")
    check(KV(lens=(0, 40, 63), cap=64, page=16, sq=2, s_new=1, hkv=2, num_splits=None), via_api=True)
    check(KV(lens=(3, 20), cap=24, s_new=0, dtype=F16, num_splits=None), via_api=True)


def test_many_queries_take_the_prefill_kernel(monkeypatch):
    """attention_with_kvcache with >= PREFILL_MIN_Q queries runs the prefill kernel, fewer the decode kernel."""
    from flashport.backend import triton as tb
    from flashport.kernels import attn_fwd, decode
    ran = []
    for mod, name in ((attn_fwd, "kvcache_forward"), (decode, "kvcache_attention")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **kw: ran.append(name) or real(*a, **kw))
    n = tb.PREFILL_MIN_Q
    check(KV(lens=(0, 40), cap=n + 64, page=16, sq=n, s_new=n, hkv=2, num_splits=None), via_api=True)
    check(KV(lens=(0, 40), cap=n + 64, page=16, sq=n - 1, s_new=n - 1, hkv=2, num_splits=None), via_api=True)
    assert ran == ["kvcache_forward", "kvcache_attention"]


def test_supports_reasons(monkeypatch):
    q = torch.randn(1, 1, 2, 16)
    kc = torch.randn(1, 8, 1, 16)
    spec, _, _ = kvcache_spec(q, kc, kc, None, None, cache_seqlens=None, block_table=None, causal=False,
                              softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              return_lse=False)
    assert kvcache_supports(spec) == []
    assert any("float64" in r for r in kvcache_supports(dataclasses.replace(spec, dtype=torch.float64)))
    assert any("head dim" in r for r in kvcache_supports(dataclasses.replace(spec, head_dim=320)))
    assert any("dropout" in r for r in kvcache_supports(dataclasses.replace(spec, dropout_p=0.1)))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert any("TRITON_INTERPRET" in r for r in kvcache_supports(spec))


def test_split_heuristic():
    # One GQA group over a long cache on a 132-SM GPU: split until the waves fill, >= 2 tiles per split.
    s = choose_num_splits(programs=8, n_tiles=128, sms=132)
    assert 16 <= s <= 64
    assert choose_num_splits(programs=8, n_tiles=6, sms=132) <= 3          # capped by the tiles
    assert choose_num_splits(programs=1024, n_tiles=128, sms=132) == 1     # the batch fills the GPU
    assert choose_num_splits(programs=4, n_tiles=1, sms=132) == 1
    assert choose_num_splits(programs=2, n_tiles=8, sms=2, min_tiles=1) > 1  # the interpreter splits too
    # Tiles always fit the shared memory they are chosen for, or no config is returned.
    cfg = choose_config(8, 256, 256, 4, 99 * 1024, interpreter=False)
    assert cfg is not None and cfg.smem_bytes(4) <= 99 * 1024
    assert choose_config(8, 256, 256, 4, 8 * 1024, interpreter=False) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_kernel_matches_torch(dtype):
    g = torch.Generator().manual_seed(1)
    b, sq, hq, dv, parts = 2, 3, 5, 40, 3
    outs = [torch.randn(b, sq, hq, dv, generator=g).to(dtype) for _ in range(parts)]
    lses = [torch.randn(b, hq, sq, generator=g) * 3 for _ in range(parts)]
    lses[1][0, 2, :] = float("-inf")           # an empty part: its garbage must not leak
    outs[1][0, :, 2] = float("nan")
    for lse in lses:                           # a row no part sees
        lse[1, 4, 1] = float("-inf")
    out, lse = merge_states_triton(outs, lses)
    ref, ref_lse = merge_states_torch(outs, lses)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    assert lse[1, 4, 1] == float("-inf") and (out[1, 1, 4] == 0).all()
    # A single part comes back unchanged, except rows it does not see (lse -inf): zeros.
    one, one_lse = merge_states_triton(outs[:1], lses[:1])
    seen = torch.isfinite(lses[0]).transpose(1, 2)[..., None]
    torch.testing.assert_close(one, torch.where(seen, outs[0], torch.zeros_like(outs[0])), rtol=0, atol=0)
    torch.testing.assert_close(one_lse, lses[0], rtol=0, atol=0)


def test_merge_kernel_many_parts_in_chunks():
    """A flash-decoding merge of 37 parts read 4 at a time (tile_elems lowered): the two-pass path
    (max over every chunk first) equals the PyTorch merge, with empty parts holding NaN."""
    g = torch.Generator().manual_seed(2)
    parts, b, sq, hq, dv = 37, 1, 2, 3, 16
    o_parts = torch.randn(parts, b, sq, hq, dv, generator=g)
    lse_parts = torch.randn(parts, b, hq, sq, generator=g) * 20      # spread: the max must be global
    lse_parts[5:30, 0, 1, :] = float("-inf")
    o_parts[5:30, 0, :, 1] = float("nan")
    out = torch.empty(b, sq, hq, dv)
    lse = torch.empty(b, hq, sq)
    merge_partials(o_parts, lse_parts, out, lse, tile_elems=4 * 16)
    ref, ref_lse = merge_states_torch(list(o_parts), list(lse_parts))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("paged", [False, True])
def test_whole_cache_valid_without_seqlens(paged):
    """cache_seqlens=None: every cache position is a key (capacity = Sk), here with a left window."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 4, 16, generator=g)
    k_cache, v_cache = torch.randn(2, 40, 2, 16, generator=g), torch.randn(2, 40, 2, 16, generator=g)
    table = None
    if paged:  # the same keys, in 16-token pages of a shuffled pool
        table = torch.tensor([[4, 0], [2, 5]], dtype=torch.int32)
        dense_k, dense_v = k_cache[:, :32], v_cache[:, :32]
        k_cache = torch.full((6, 16, 2, 16), float("nan"))
        v_cache = torch.full((6, 16, 2, 16), float("nan"))
        k_cache[table.long().flatten()] = dense_k.reshape(4, 16, 2, 16)
        v_cache[table.long().flatten()] = dense_v.reshape(4, 16, 2, 16)
    kw = dict(block_table=table, window_size=(5, -1), return_lse=True)
    out, lse = flashport.attention_with_kvcache(q, k_cache, v_cache, backend="triton", **kw)
    ref, ref_lse = flashport.attention_with_kvcache(q.double(), k_cache.nan_to_num(0).double(),
                                                    v_cache.nan_to_num(0).double(), backend="reference", **kw)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_empty_query_and_batch():
    kc = torch.randn(2, 8, 1, 16)
    out = flashport.attention_with_kvcache(torch.randn(2, 0, 2, 16), kc, kc, backend="triton")
    assert out.shape == (2, 0, 2, 16)
    out, lse = flashport.attention_with_kvcache(torch.randn(0, 1, 2, 16), kc[:0], kc[:0], backend="triton",
                                                return_lse=True)
    assert out.shape == (0, 1, 2, 16) and lse.shape == (0, 2, 1)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_strided_cache_seqlens_and_block_table(paged):
    """cache_seqlens / block_table views with a non-unit stride give the answer of contiguous copies."""
    b, hq, hkv, d, page = 2, 4, 2, 16, 4
    lens = torch.tensor([6, 0, 9, 0], dtype=torch.int32)[::2]                 # [6, 9], stride 2
    q = torch.randn(b, 2, hq, d)
    if paged:
        kc, vc = torch.randn(6, page, hkv, d), torch.randn(6, page, hkv, d)
        table = torch.tensor([[5, 0, 1], [2, 3, 4]], dtype=torch.int32).t().contiguous().t()  # strides (1, 2)
    else:
        kc, vc = torch.randn(b, 12, hkv, d), torch.randn(b, 12, hkv, d)
        table = None
    got = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True,
                                           backend="triton")
    want = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens.contiguous(), causal=True,
                                            block_table=None if table is None else table.contiguous(),
                                            backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tile_page_lookup_matches_per_key_lookup(monkeypatch):
    """BLOCK_N dividing the page switches to one block-table lookup per tile; the per-key lookup
    reads the same keys in the same order, so both forms agree bit for bit (NaN-poisoned pages
    outside the valid lengths catch a tile read from the wrong page)."""
    from flashport.kernels import decode
    case = KV(lens=(5, 47, 90), cap=96, page=32, hkv=2, sq=2, s_new=1, block_n=16, num_splits=3)
    out_tile, lse_tile = check(case)
    q, k_cache, v_cache, k_new, v_new, lens, bt, slopes = make(case)
    spec, inputs, _ = kvcache_spec(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=bt,
                                   return_lse=True, **_kw(case, slopes))
    assert decode.plan_for(spec, q.device, block_n=16).constexprs["TILE_IN_PAGE"]
    assert not decode.plan_for(spec, q.device, block_n=64).constexprs["TILE_IN_PAGE"]   # 64 does not divide 32
    monkeypatch.setattr(decode, "TILE_PAGE_LOOKUP", False)
    assert not decode.plan_for(spec, q.device, block_n=16).constexprs["TILE_IN_PAGE"]
    out_key, lse_key = check(case)
    assert torch.equal(out_tile, out_key) and torch.equal(lse_tile, lse_key)


def test_launch_plan_is_memoised_and_follows_the_tuning_constants(monkeypatch):
    """Repeated calls reuse one plan (same answer, cache hits); a retune of WAVES reaches the key."""
    from flashport.kernels import decode, splitkv
    case = KV(lens=(7, 100), cap=112, page=16, sq=2, s_new=0, hkv=2, num_splits=None)
    q, k_cache, v_cache, _, _, lens, bt, slopes = make(case)
    spec, inputs, _ = kvcache_spec(q, k_cache, v_cache, None, None, cache_seqlens=lens, block_table=bt,
                                   return_lse=True, **_kw(case, slopes))
    first = kvcache_attention(spec, inputs)
    hits = decode.launch_plan.cache_info().hits
    again = kvcache_attention(spec, inputs)
    assert decode.launch_plan.cache_info().hits == hits + 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert decode.plan_for(spec, q.device) is decode.plan_for(spec, q.device)
    monkeypatch.setattr(splitkv, "WAVES", 4)                   # 4 programs on 2 "SMs": split in two ...
    assert decode.plan_for(spec, q.device).num_splits == 2
    monkeypatch.setattr(splitkv, "WAVES", 1)                   # ... one wave is already full: no split
    assert decode.plan_for(spec, q.device).num_splits == 1
    # a dense cache follows WAVES_DENSE instead
    dense = KV(lens=(7, 100), cap=112, page=0, sq=2, s_new=0, hkv=2, num_splits=None)
    q, k_cache, v_cache, _, _, lens, bt, slopes = make(dense)
    dspec, _, _ = kvcache_spec(q, k_cache, v_cache, None, None, cache_seqlens=lens, block_table=bt,
                               return_lse=True, **_kw(dense, slopes))
    monkeypatch.setattr(splitkv, "WAVES_DENSE", 4)
    assert decode.plan_for(dspec, q.device).num_splits == 2
    monkeypatch.setattr(splitkv, "WAVES_DENSE", 1)
    assert decode.plan_for(dspec, q.device).num_splits == 1


def test_split_heuristic_waves_and_stage_override():
    # More waves never means fewer splits for a small grid; WAVES is read at call time.
    splits = [choose_num_splits(programs=8, n_tiles=512, sms=132, waves=w) for w in (1, 2, 4, 8)]
    assert splits == sorted(splits) and splits[0] < splits[-1]
    assert choose_num_splits(programs=8, n_tiles=512, sms=132) == choose_num_splits(8, 512, 132, waves=4)
    # A forced stage count is kept (not lowered to fit); without it the default is lowered instead.
    assert choose_config(4, 128, 128, 2, 227 * 1024, interpreter=False, num_stages=5).num_stages == 5
    assert choose_config(4, 128, 128, 2, 40 * 1024, interpreter=False, num_stages=5) is None
    assert choose_config(4, 128, 128, 2, 40 * 1024, interpreter=False).num_stages < 3


def test_paged_splits_stream_at_most_max_keys():
    """A paged cache's splits cover at most MAX_KEYS_PER_SPLIT keys of the capacity (the longest program of a ragged
    batch bounds the call); a dense cache and a forced split count keep their own answer."""
    from flashport.kernels import decode, splitkv

    def splits(b, sk, page, **kw):
        q = torch.zeros(b, 1, 64, 128, dtype=torch.bfloat16, device="meta")
        if page:
            kc = torch.zeros(b * sk // page, page, 8, 128, dtype=torch.bfloat16, device="meta")
            bt = torch.zeros(b, sk // page, dtype=torch.int32, device="meta")
        else:
            kc, bt = torch.zeros(b, sk, 8, 128, dtype=torch.bfloat16, device="meta"), None
        spec, _, _ = kvcache_spec(q, kc, kc, None, None, cache_seqlens=None, block_table=bt, causal=False,
                                  softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                  return_lse=False)
        return decode.launch_plan(spec, 132, 232448, False, False, waves=splitkv.waves_for(bool(page)), min_tiles=2,
                                  **kw).num_splits

    assert splits(64, 16384, 16, max_keys=1 << 30) == 1
    assert splits(64, 16384, 16) == 16384 // splitkv.MAX_KEYS_PER_SPLIT
    assert splits(64, 16384, 16, num_splits=3) == 3
    assert splits(64, 16384, 0) == splits(64, 16384, 0, max_keys=1 << 30)


def test_pdl_only_where_it_measured_faster():
    """Programmatic dependent launch of the merge: only with 2..PDL_MAX_SPLITS splits (the probe found it
    slower at 64 splits); never without a merge."""
    from flashport.kernels import decode
    from flashport.spec import kvcache_spec
    q = torch.zeros(1, 1, 4, 16)
    kc = torch.zeros(1, 4096, 1, 16)
    spec, _, _ = kvcache_spec(q, kc, kc, None, None, cache_seqlens=None, block_table=None, causal=False,
                              softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              return_lse=False)
    for splits, want in ((1, False), (2, True), (decode.PDL_MAX_SPLITS, True), (decode.PDL_MAX_SPLITS + 1, False)):
        plan = decode.launch_plan(spec, 132, 1 << 20, False, False, num_splits=splits, pdl=True)
        assert plan.pdl is want and plan.constexprs["LAUNCH_DEPENDENTS"] is want, splits

"""Programmable attention (issue [15]): score_mod, mask_mod, block masks and attn_bias on the CPU backends.

The oracle here is written independently of flashport.programmable: it loops over (b, h), builds the full
index grid with meshgrid and applies each mod to scalars-as-tensors, so a broadcasting mistake in the
library shows up as a mismatch.  Blockwise is held to the tolerance rule against the float64 reference, with
tiles small enough that every call crosses several of them."""
from __future__ import annotations

import pytest
import torch

import flashport
from flashport import mods
from flashport.backend import blockwise as bw
from flashport.backend.reference import materialized_attention
from flashport.block_mask import EMPTY, FULL, PARTIAL
from flashport.check import magnitude, rule_error
from flashport.programmable import build

S, B, HQ, HKV, D = 37, 2, 4, 2, 16


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(bw, "BLOCK_M", 8)
    monkeypatch.setattr(bw, "BLOCK_N", 16)


def _inputs(dtype=torch.float64, sq=S, sk=S, seed=0, hkv=HKV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, sq, HQ, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, sk, hkv, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, sk, hkv, D, generator=g).to(dtype).requires_grad_()
    do = torch.randn(B, sq, HQ, D, generator=g).to(dtype)
    return q, k, v, do


def _oracle(q, k, v, score_mod=None, mask_mod=None, bias=None, causal=False):
    """Per (b, h): s = scale q.k, score_mod on the meshgrid, + bias, mask, softmax; empty rows give zeros."""
    sq, sk, hq, hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    outs = torch.zeros(q.shape[0], sq, hq, v.shape[-1], dtype=torch.float64)
    lses = torch.full((q.shape[0], hq, sq), float("-inf"), dtype=torch.float64)
    outs, lses = outs.clone(), lses.clone()
    out_rows, lse_rows = [], []
    for b in range(q.shape[0]):
        ob, lb = [], []
        for h in range(hq):
            kv = h // (hq // hkv)
            s = (q[b, :, h].double() @ k[b, :, kv].double().T) / q.shape[-1] ** 0.5
            i, j = torch.meshgrid(torch.arange(sq), torch.arange(sk), indexing="ij")
            bt, ht = torch.tensor(b), torch.tensor(h)
            if score_mod is not None:
                s = score_mod(s, bt, ht, i, j).double()
            if bias is not None:
                s = s + bias.double().expand(q.shape[0], hq, sq, sk)[b, h]
            vis = torch.ones(sq, sk, dtype=torch.bool)
            if causal:
                vis &= j <= i + (sk - sq)
            if mask_mod is not None:
                vis &= mask_mod(bt, ht, i, j)
            s = s.masked_fill(~vis, float("-inf"))
            lse = torch.logsumexp(s, -1)
            p = torch.where(vis, torch.exp(s - lse[:, None].clamp_min(-1e300)), torch.zeros_like(s))
            ob.append(p @ v[b, :, kv].double())
            lb.append(lse)
        out_rows.append(torch.stack(ob, 1))
        lse_rows.append(torch.stack(lb, 0))
    return torch.stack(out_rows), torch.stack(lse_rows)


def _grads(out, lse, do, tensors):
    loss = (out.double() * do.double()).sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()
    return torch.autograd.grad(loss, tensors, allow_unused=True, materialize_grads=True)


TABLE = torch.randn(HQ, 9, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
DOCS = torch.tensor([0] * 10 + [1] * 3 + [2] * 24)
CASES = {
    "alibi-score": dict(score_mod=mods.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64))),
    "softcap-score": dict(score_mod=mods.tanh_softcap(2.0)),
    "document-mask": dict(mask_mod=mods.document(DOCS)),
    "prefix-lm": dict(mask_mod=mods.prefix_lm(11)),
    "window-sinks": dict(mask_mod=mods.sliding_window(6, sinks=3)),
    "block-sparse": dict(mask_mod=mods.block_sparse(5, 5, block_size=8, density=0.4)),
    "rel-table+causal": dict(score_mod=mods.relative_position(TABLE), causal=True),
    "bias+mask": dict(bias=torch.randn(1, HQ, 1, S, dtype=torch.float64), mask_mod=mods.causal),
    "empty-rows": dict(mask_mod=lambda b, h, i, j: (i >= 20) & (j <= i)),   # rows 0..19 see nothing
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_the_independent_oracle(name):
    c = dict(CASES[name])
    bias = c.pop("bias", None)
    q, k, v, do = _inputs()
    out, lse = flashport.attention(q, k, v, backend="reference", return_lse=True, attn_bias=bias, **c)
    ref_out, ref_lse = _oracle(q, k, v, bias=bias, **c)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse.double(), ref_lse.float().double(), rtol=0, atol=1e-5)
    g = _grads(out, lse, do, (q, k, v))
    gr = _grads(ref_out, ref_lse, do, (q, k, v))
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_within_the_tolerance_rule(name, dtype, small_tiles):
    c = dict(CASES[name])
    bias = c.pop("bias", None)
    q, k, v, do = _inputs(dtype)
    out, lse = flashport.attention(q, k, v, backend="blockwise", return_lse=True, attn_bias=bias, **c)
    assert torch.isfinite(out).all()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = flashport.attention(q64, k64, v64, backend="reference", return_lse=True, attn_bias=bias, **c)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))        # the same rows see nothing
    spec_kw = dict(scale=D ** -0.5, left=-1, right=0 if c.get("causal") else -1)
    prog = build(c.get("score_mod"), c.get("mask_mod"), None, bias, batch=B, heads_q=HQ, sq=S, sk=S, device="cpu")
    lowp, _ = materialized_attention(q, k, v, compute_dtype=dtype, prog=prog, **spec_kw)
    err, bound = rule_error(out, ref, lowp, dtype, 2.0)
    assert err <= bound, (err, bound)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    math = torch.autograd.grad(lowp, (q, k, v), do)
    mag = magnitude(q, k, v, do)
    for n, a, b, m in zip("qkv", got, want, math):
        assert torch.isfinite(a).all(), n
        err, bound = rule_error(a, b, m, dtype, 3.0, mag)
        assert err <= bound, (n, err, bound)


def test_rows_with_no_visible_key_give_zeros_and_zero_gradients(small_tiles):
    q, k, v, do = _inputs(torch.float32)
    mask = CASES["empty-rows"]["mask_mod"]
    table = torch.zeros(HQ, 9, requires_grad=True)
    for be in ("reference", "blockwise"):
        out, lse = flashport.attention(q, k, v, backend=be, return_lse=True, mask_mod=mask,
                                       score_mod=mods.relative_position(table))
        assert (out[:, :20] == 0).all() and torch.isneginf(lse[:, :, :20]).all()
        dq, dk, dv, dt = torch.autograd.grad(out, (q, k, v, table), do)
        assert (dq[:, :20] == 0).all() and torch.isfinite(dq).all() and torch.isfinite(dt).all()


@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_captured_table_and_bias_receive_their_gradients(backend, small_tiles):
    q, k, v, do = _inputs()
    table = TABLE.clone().requires_grad_()
    bias = torch.randn(HQ, 1, S, dtype=torch.float64, requires_grad=True)       # broadcast over B and rows
    out = flashport.attention(q, k, v, backend=backend, causal=True, score_mod=mods.relative_position(table),
                              attn_bias=bias)
    g = torch.autograd.grad(out, (q, k, v, table, bias), do)
    ref_out, _ = _oracle(q, k, v, score_mod=mods.relative_position(table), bias=bias, causal=True)
    want = torch.autograd.grad(ref_out, (q, k, v, table, bias), do)
    assert g[4].shape == bias.shape
    for a, b in zip(g, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


class _RelBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.param = torch.nn.Parameter(torch.randn(HQ, 9, dtype=torch.float64))

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.param[h, (q_idx - kv_idx).clamp(-4, 4) + 4]


@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_captures_found_through_modules_and_non_leaf_tensors(backend, small_tiles):
    q, k, v, do = _inputs()
    mod = _RelBias()
    param = torch.randn(HQ, 9, dtype=torch.float64, requires_grad=True)
    table = param * 2.0                      # not a leaf: its gradient must flow on into `param`
    for score_mod, leaf in ((mod, mod.param), (mods.relative_position(table), param)):
        out = flashport.attention(q, k, v, backend=backend, score_mod=score_mod)
        (got,) = torch.autograd.grad(out, (leaf,), do, retain_graph=True)
        ref_out, _ = _oracle(q, k, v, score_mod=score_mod)
        (want,) = torch.autograd.grad(ref_out, (leaf,), do, retain_graph=True)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_plain_causal_mask_mod_equals_causal_true(small_tiles):
    q, k, v, _ = _inputs(torch.float32)
    a = flashport.attention(q, k, v, backend="blockwise", mask_mod=mods.causal)
    b = flashport.attention(q, k, v, backend="blockwise", causal=True)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_ready_made_mods_equal_the_built_in_features(small_tiles):
    q, k, v, _ = _inputs(torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    pairs = [
        (dict(score_mod=mods.alibi(slopes)), dict(alibi_slopes=slopes)),
        (dict(score_mod=mods.tanh_softcap(3.0)), dict(softcap=3.0)),
        (dict(mask_mod=mods.sliding_window(5)), dict(window_size=(5, 0))),
    ]
    for mod_kw, builtin_kw in pairs:
        a = flashport.attention(q, k, v, backend="blockwise", **mod_kw)
        b = flashport.attention(q, k, v, backend="blockwise", **builtin_kw)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_document_mask_equals_varlen():
    q, k, v, _ = _inputs(torch.float64)
    out = flashport.attention(q[:1], k[:1], v[:1], backend="reference", mask_mod=mods.document(DOCS))
    cu = torch.tensor([0, 10, 13, 37], dtype=torch.int32)
    ref = flashport.attention_varlen(q[0], k[0], v[0], cu, cu, 24, 24, causal=True, backend="reference")
    torch.testing.assert_close(out[0], ref, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- block masks
def test_create_block_mask_classifies_every_tile():
    mask = mods.sliding_window(20, sinks=4)
    bm = flashport.create_block_mask(mask, None, None, 100, 90, block_size=16)
    assert bm.shape == (1, 1, 7, 6)
    i, j = torch.meshgrid(torch.arange(100), torch.arange(90), indexing="ij")
    dense = mask(torch.tensor(0), torch.tensor(0), i, j)
    for t in range(7):
        for c in range(6):
            tile = dense[t * 16:(t + 1) * 16, c * 16:(c + 1) * 16]
            want = FULL if tile.all() else PARTIAL if tile.any() else EMPTY
            assert bm.state[0, 0, t, c] == want, (t, c)
    assert 0 < bm.sparsity() < 1


def test_block_mask_per_head_and_batch():
    def mask(b, h, i, j):
        return (j <= i) & ((h + b) % 2 == 0)       # odd (b + h) sees nothing
    bm = flashport.create_block_mask(mask, 2, HQ, S, S, block_size=8)
    assert bm.shape == (2, HQ, 5, 5)
    assert (bm.state[0, 1] == EMPTY).all() and (bm.state[0, 0] != EMPTY).any()
    q, k, v, _ = _inputs()
    out = flashport.attention(q, k, v, backend="blockwise", block_mask=bm)
    ref, _ = _oracle(q, k, v, mask_mod=mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert (out[0, :, 1] == 0).all()


def test_empty_tiles_are_never_evaluated():
    seen = []

    def score_mod(score, b, h, q_idx, kv_idx):
        seen.append(int((kv_idx - q_idx).max()))
        return score

    bm = flashport.create_block_mask(mods.causal, None, None, 64, 64, block_size=16)
    q, k, v, do = _inputs(sq=64, sk=64)
    out = flashport.attention(q, k, v, backend="blockwise", score_mod=score_mod, block_mask=bm)
    out.backward(do)
    # the probe call sees 0; a tile above the diagonal's tiles would reach kv - q >= 16 + 1
    assert seen and max(seen) <= 15


def test_torch_block_mask_is_accepted():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    tbm = flex.create_block_mask(lambda b, h, i, j: i >= j, None, None, 64, 64, device="cpu", BLOCK_SIZE=16,
                                 _compile=False)
    q, k, v, _ = _inputs(sq=64, sk=64)
    out = flashport.attention(q, k, v, backend="blockwise", block_mask=tbm)
    ref = flashport.attention(q, k, v, backend="reference", causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- selection and bad input
def test_auto_serves_mods_with_a_backend_that_declares_them():
    q, k, v, _ = _inputs(torch.float32)
    flashport.reset_stats()
    flashport.attention(q, k, v, score_mod=mods.tanh_softcap(5.0))
    used = [n for n, s in flashport.stats().items() if s["calls"]]
    assert used == ["blockwise"]


def test_auto_passes_over_a_backend_that_refuses_the_inputs(monkeypatch):
    # Whether a mod compiles shows only in the call's inputs: auto asks the backend it chose, and takes the next plan
    # in its order where that backend refuses (sdpa-cpu serves mask_mod ahead of blockwise on a CPU).
    q, k, v, _ = _inputs(torch.float64)
    flashport.reset_stats()
    flashport.attention(q, k, v, mask_mod=mods.sliding_window(3, sinks=1))
    assert [n for n, s in flashport.stats().items() if s["calls"]] == ["sdpa-cpu"]
    asked = []
    monkeypatch.setattr(flashport.dispatch.get("sdpa-cpu"), "input_reasons",
                        lambda spec, inputs: asked.append(inputs.prog.mask_mod) or ["pretend: this mod does not compile"])
    flashport.reset_stats()
    out = flashport.attention(q, k, v, mask_mod=mods.sliding_window(3, sinks=1))
    assert asked and [n for n, s in flashport.stats().items() if s["calls"]] == ["blockwise"]
    ref = flashport.attention(q, k, v, backend="reference", mask_mod=mods.sliding_window(3, sinks=1))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # a named backend is never passed over: it serves or says why (input_reasons are auto's)
    flashport.attention(q, k, v, mask_mod=mods.sliding_window(3, sinks=1), backend="sdpa-cpu")


def test_auto_names_every_input_refusal_when_none_accepts(monkeypatch):
    q, k, v, _ = _inputs(torch.float64)
    for name in ("sdpa-cpu", "blockwise"):
        monkeypatch.setattr(flashport.dispatch.get(name), "input_reasons", lambda spec, inputs, n=name: [f"{n} says no"])
    with pytest.raises(flashport.UnsupportedError, match="(?s)sdpa-cpu says no.*blockwise says no"):
        flashport.attention(q, k, v, mask_mod=mods.sliding_window(3, sinks=1))


def test_a_backend_without_mods_refuses_with_the_reason():
    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(flashport.UnsupportedError, match="score_mod"):
        flashport.attention(q, k, v, score_mod=mods.tanh_softcap(5.0), backend="sdpa-cpu")


def test_bad_programmable_input_names_the_argument():
    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="attn_bias"):
        flashport.attention(q, k, v, attn_bias=torch.zeros(3, S, S))
    with pytest.raises(TypeError, match="attn_bias"):
        flashport.attention(q, k, v, attn_bias=torch.zeros(S, S, dtype=torch.int32))
    with pytest.raises(TypeError, match="score_mod"):
        flashport.attention(q, k, v, score_mod=3)
    with pytest.raises(ValueError, match="block_mask"):
        flashport.attention(q, k, v, block_mask=flashport.create_block_mask(mods.causal, None, None, 16, 16))
    bm = flashport.create_block_mask(mods.causal, None, None, S, S)
    with pytest.raises(ValueError, match="mask_mod"):
        flashport.attention(q, k, v, block_mask=bm, mask_mod=mods.prefix_lm(3))
    with pytest.raises(TypeError, match="block_mask"):
        flashport.attention(q, k, v, block_mask="causal")


@pytest.mark.parametrize("backend", [None, "reference", "blockwise", "sdpa-cpu"])
@pytest.mark.parametrize("kw, name, got", [
    (dict(mask_mod=lambda b, h, i, j: True), "mask_mod", "got bool"),
    (dict(mask_mod=lambda b, h, i, j: None), "mask_mod", "got NoneType"),
    (dict(mask_mod=lambda b, h, i, j: torch.where(i >= j, 0.0, float("-inf"))), "mask_mod", "float32 tensor"),
    (dict(score_mod=lambda s, b, h, i, j: 1.0), "score_mod", "got float"),
    (dict(score_mod=lambda s, b, h, i, j: i - j), "score_mod", "int64 tensor"),
])
def test_a_mod_returning_the_wrong_kind_of_value_is_a_type_error(backend, kw, name, got):
    """An additive 0 / -inf mask from mask_mod would otherwise read as visible wherever it is nonzero."""
    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(TypeError, match=f"{name} must return .*{got}"):
        flashport.attention(q, k, v, backend=backend, **kw)
    if name == "mask_mod":
        with pytest.raises(TypeError, match=f"mask_mod must return .*{got}"):
            flashport.create_block_mask(kw["mask_mod"], None, None, S, S)


def test_bad_create_block_mask_arguments_name_the_argument():
    for bad, err, name in (((-1, None), ValueError, "B"), ((0, None), ValueError, "B"), ((None, -2), ValueError, "H"),
                           ((1.5, None), TypeError, "B"), (("2", None), TypeError, "B"), ((True, None), TypeError, "B")):
        with pytest.raises(err, match=f"^{name} "):
            flashport.create_block_mask(mods.causal, *bad, S, S)
    for block_size in ((2,), "2", 2.0, None, (2, 0), (2, 2.5)):
        with pytest.raises((TypeError, ValueError), match="^block_size "):
            flashport.create_block_mask(mods.causal, None, None, S, S, block_size=block_size)
    with pytest.raises(ValueError, match="^device "):
        flashport.create_block_mask(mods.causal, None, None, S, S, device="bogus")
    with pytest.raises(TypeError, match="^Sq "):
        flashport.create_block_mask(mods.causal, None, None, 4.0, S)


# ----------------------------------------------------------------------------- varlen
@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_varlen_mods_equal_per_sequence_calls(backend, small_tiles):
    lens = [5, 0, 17, 9]
    cu = torch.tensor([0, 5, 5, 22, 31], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(33, HQ, D, generator=g, dtype=torch.float64, requires_grad=True)   # 2 rows past cu[-1]
    k = torch.randn(31, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(31, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    table = torch.randn(HQ, 9, generator=g, dtype=torch.float64, requires_grad=True)
    seq_bias = torch.randn(4, dtype=torch.float64, requires_grad=True)    # depends on b: the sequence index

    def score_mod(score, b, h, i, j):
        return mods.relative_position(table)(score, b, h, i, j) + seq_bias[b]
    mask = mods.sliding_window(6, sinks=1)
    out = flashport.attention_varlen(q, k, v, cu, cu, 17, 17, backend=backend, score_mod=score_mod, mask_mod=mask)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, table, seq_bias), do)
    assert (out[31:] == 0).all()
    parts, start = [], 0
    for b, n in enumerate(lens):
        if n:
            sl = slice(start, start + n)

            def mod_b(score, bb, h, i, j, b=b):      # the dense call's b is 0: pin the sequence's index
                return mods.relative_position(table)(score, bb, h, i, j) + seq_bias[b]
            parts.append(_oracle(q[None, sl], k[None, sl], v[None, sl], score_mod=mod_b, mask_mod=mask)[0][0])
        start += n
    ref = torch.cat(parts + [torch.zeros(2, HQ, D, dtype=torch.float64)])
    want = torch.autograd.grad(ref, (q, k, v, table, seq_bias), do)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_varlen_takes_no_block_mask_or_bias():
    q = torch.randn(8, HQ, D)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="block_mask|attn_bias"):
        flashport.attention_varlen(q, q[:, :HKV], q[:, :HKV], cu, cu, 8, 8, attn_bias=torch.zeros(8, 8))


@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_score_mod_masking_with_minus_inf_gives_empty_rows_not_nan(backend, small_tiles):
    q, k, v, do = _inputs()

    def score_mod(score, b, h, i, j):      # masks by score: rows 0..2 keep no key
        return torch.where(j <= i - 3, score, torch.full_like(score, float("-inf")))
    out, lse = flashport.attention(q, k, v, score_mod=score_mod, backend=backend, return_lse=True)
    assert (out[:, :3] == 0).all() and torch.isneginf(lse[:, :, :3]).all()
    ref, _ = _oracle(q, k, v, mask_mod=lambda b, h, i, j: j <= i - 3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g in torch.autograd.grad(out, (q, k, v), do):
        assert torch.isfinite(g).all()


# ----------------------------------------------------------------------------- block masks that are built-in rules
def _rule(sq, sk, left, right):
    from flashport.masks import Visibility
    return torch.broadcast_to(Visibility(sq, sk, left, right).sees(torch.arange(sq)[:, None],
                                                                   torch.arange(sk)[None, :]), (sq, sk))


@pytest.mark.parametrize("sq, sk", [(64, 64), (37, 100), (100, 37), (1, 5), (5, 1), (48, 16)])
@pytest.mark.parametrize("block_size", [8, 16, (4, 32), (32, 8)])
def test_block_mask_band_is_the_rule_it_shows(sq, sk, block_size):
    """Every window written as a mask_mod (in absolute positions, as users write them) is found, and the rule
    found shows exactly the mask's pairs; bounds that never bind come back unbounded."""
    for left, right in [(-1, -1), (-1, 0), (3, 0), (0, 0), (5, 7), (-1, 4), (2, -1), (40, 1)]:
        dense = _rule(sq, sk, left, right)
        bm = flashport.create_block_mask(lambda b, h, i, j: dense[i, j], None, None, sq, sk, block_size=block_size)
        band = bm.band(B, HQ)
        if not dense.any():
            assert band is None
            continue
        assert band is not None, (left, right)
        assert torch.equal(_rule(sq, sk, *band), dense), (left, right, band)


def test_block_mask_band_refuses_what_is_no_window():
    """Sinks, prefix-LM, documents, a mask that differs per head or batch entry, a strictly-below-diagonal mask
    (right = -1 would mean unbounded) and a hole inside a row: no rule."""
    docs = torch.repeat_interleave(torch.arange(4), 16)
    for mask in (mods.sliding_window(8, sinks=2), mods.prefix_lm(16), mods.document(docs),
                 lambda b, h, i, j: (j <= i) & (j >= i - h), lambda b, h, i, j: j <= i + b,
                 lambda b, h, i, j: j < i, lambda b, h, i, j: (j <= i) & (j != i - 3)):
        bm = flashport.create_block_mask(mask, None, None, 64, 64, block_size=16)
        assert bm.band(B, HQ) is None
    assert flashport.create_block_mask(mods.causal, None, None, 64, 64, block_size=16).band(B, HQ) == (-1, 0)
    assert flashport.create_block_mask(mods.sliding_window(10), None, None, 64, 64).band(1, 1) == (10, 0)


def test_mask_only_band_runs_the_builtin_rule():
    """backend=None runs a causal / windowed block mask as causal=True / window_size (bit for bit the same
    call), exact against the reference with the mods; a named backend and a call with a score_mod keep the mods."""
    from flashport.spec import dense_spec
    q, k, v, do = _inputs(torch.float32, sq=40, sk=64)
    opts = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, deterministic=False, return_lse=False)
    for mask, window in ((lambda b, h, i, j: j <= i + 24, (-1, 0)), (lambda b, h, i, j: (j <= i + 24) & (j >= i + 19),
                                                                      (5, 0))):
        bm = flashport.create_block_mask(mask, None, None, 40, 64, block_size=16)
        spec, inputs = dense_spec(q, k, v, block_mask=bm, builtin_rules=True, **opts)
        assert (spec.mods, spec.window_left, spec.window_right, inputs.prog) == ((), *window, None)
        assert dense_spec(q, k, v, block_mask=bm, **opts)[0].mods == ("mask_mod", "block_mask")
        assert dense_spec(q, k, v, block_mask=bm, score_mod=lambda s, b, h, i, j: s, builtin_rules=True,
                          **opts)[0].mods == ("score_mod", "mask_mod", "block_mask")
        out = flashport.attention(q, k, v, block_mask=bm)
        assert torch.equal(out, flashport.attention(q, k, v, window_size=window))
        grads = torch.autograd.grad(out, (q, k, v), do)
        ref = flashport.attention(q, k, v, block_mask=bm, backend="reference")
        for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), do)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # a window the call already has intersects with the mask's: each bound is the tighter one
    bm = flashport.create_block_mask(mods.causal, None, None, 40, 40, block_size=16)
    q, k, v, _ = _inputs(torch.float32, sq=40, sk=40)
    spec, _ = dense_spec(q, k, v, block_mask=bm, builtin_rules=True, **{**opts, "window_size": (7, 3)})
    assert (spec.window_left, spec.window_right) == (7, 0)


def _assert_as_reference(q, k, v, do, out, lse, **kw):
    """A backend=None call's (out, lse) and the gradients of out * do + lse (through the lse too) against the
    reference call with the same keywords (float32 inputs, whose rounding the tolerances allow)."""
    ref, ref_lse = flashport.attention(q, k, v, return_lse=True, backend="reference", **kw)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-5)
    got = torch.autograd.grad((out * do).sum() + lse.sum(), (q, k, v))
    want = torch.autograd.grad((ref * do).sum() + ref_lse.sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _doc_mask(ids, causal):
    """ids: [B, S] document ids (non-decreasing per entry)."""
    return lambda b, h, i, j: (ids[b, i] == ids[b, j]) & ((j <= i) | (not causal))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [8, (4, 16)])
def test_block_mask_documents_are_found(causal, block_size):
    """Random packings (documents of 1 token, one document per entry, entries packed differently): the
    boundaries come back as varlen's cu_seqlens over the B * S rows; masks that are not documents give None."""
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        lens = [torch.randint(1, 12, (12,), generator=g) for _ in range(2)]
        ids = torch.stack([torch.repeat_interleave(torch.arange(12), n)[:40] for n in lens])
        bm = flashport.create_block_mask(_doc_mask(ids, causal), 2, None, 40, 40, block_size=block_size)
        cu, max_len, per_entry, got_causal = bm.documents(2, HQ)
        want = [b * 40 + i for b in range(2) for i in range(40) if i == 0 or ids[b, i] != ids[b, i - 1]]
        assert cu.tolist() == want + [80] and cu.dtype == torch.int32
        assert per_entry.tolist() == [int(torch.unique(ids[b]).numel()) for b in range(2)]
        assert max_len == int((cu[1:] - cu[:-1]).max()) and got_causal == causal
        assert bm.band(2, HQ) is None or len(want) == 2   # one document per entry is a band
    docs = torch.repeat_interleave(torch.arange(4), 10)
    for mask in (mods.prefix_lm(8), mods.sliding_window(5, sinks=2),
                 lambda b, h, i, j: (docs[i] == docs[j]) & (j <= i) & (j >= i - 3),          # a window inside
                 lambda b, h, i, j: (docs[i] == docs[j]) & ((j <= i) | (h == 1)),             # per-head rules
                 lambda b, h, i, j: (docs[i] == docs[j]) & (j != i)):                         # a hole
        assert flashport.create_block_mask(mask, None, None, 40, 40, block_size=8).documents(2, HQ) is None


def test_documents_run_as_varlen(monkeypatch):
    """backend=None runs a document block mask as attention_varlen over the packed rows (the call the spy
    sees), exact against the reference with the mods, with the call's window, softcap and per-entry ALiBi;
    dropout and a named backend keep the dense call."""
    import flashport.api as api
    seen = []
    real = api.attention_varlen

    def spy(*a, **kw):
        seen.append(a[3].tolist())
        return real(*a, **kw)
    monkeypatch.setattr(api, "attention_varlen", spy)
    ids = torch.stack([torch.repeat_interleave(torch.arange(4), torch.tensor([5, 14, 2, 19])),
                       torch.repeat_interleave(torch.arange(3), torch.tensor([20, 1, 19]))])
    q, k, v, do = _inputs(torch.float32, sq=40, sk=40)
    for causal in (True, False):
        bm = flashport.create_block_mask(_doc_mask(ids, causal), 2, None, 40, 40, block_size=8)
        for kw in ({}, dict(window_size=(6, 3)), dict(softcap=4.0),
                   dict(alibi_slopes=torch.rand(2, HQ, generator=torch.Generator().manual_seed(1)))):
            seen.clear()
            out, lse = flashport.attention(q, k, v, block_mask=bm, return_lse=True, **kw)
            assert seen == [[0, 5, 19, 21, 40, 60, 61, 80]], kw
            _assert_as_reference(q, k, v, do, out, lse, block_mask=bm, **kw)
    seen.clear()
    flashport.attention(q, k, v, block_mask=bm, dropout_p=0.1)
    flashport.attention(q, k, v, block_mask=bm, backend="blockwise")
    assert seen == []


def test_declared_documents_run_as_varlen_without_a_block_mask(monkeypatch):
    """mask_mod=mods.document(ids) alone (no block mask) runs as the same varlen call its block mask would, bitwise,
    for [S] and [B, S] ids, causal or not, with the call's window; ids that come back after another document
    (not packed), Sq != Sk, and ids on another device keep the mask_mod.  All exact against the reference."""
    import flashport.api as api
    seen = []
    real = api.attention_varlen
    monkeypatch.setattr(api, "attention_varlen", lambda *a, **kw: seen.append(a[3].tolist()) or real(*a, **kw))
    per_entry = torch.stack([torch.repeat_interleave(torch.arange(4), torch.tensor([5, 14, 2, 19])),
                             torch.repeat_interleave(torch.arange(3), torch.tensor([20, 1, 19]))])
    shared = torch.repeat_interleave(torch.arange(3), torch.tensor([7, 30, 3]))
    q, k, v, do = _inputs(torch.float32, sq=40, sk=40)
    for ids, cu in ((per_entry, [0, 5, 19, 21, 40, 60, 61, 80]), (shared, [0, 7, 37, 40, 47, 77, 80])):
        for causal in (True, False):
            for kw in ({}, dict(window_size=(6, 3))):
                seen.clear()
                out, lse = flashport.attention(q, k, v, mask_mod=mods.document(ids, causal), return_lse=True, **kw)
                assert seen == [cu], (ids.dim(), causal, kw)
                bm = flashport.create_block_mask(mods.document(ids, causal), 2, None, 40, 40, block_size=8)
                assert torch.equal(out, flashport.attention(q, k, v, block_mask=bm, **kw))
                _assert_as_reference(q, k, v, do, out, lse, mask_mod=mods.document(ids, causal), **kw)
    seen.clear()
    scattered = torch.tensor([0, 1, 0] + [2] * 37)
    out, lse = flashport.attention(q, k, v, mask_mod=mods.document(scattered), return_lse=True)
    _assert_as_reference(q, k, v, do, out, lse, mask_mod=mods.document(scattered))
    q2, k2, v2, _ = _inputs(torch.float32, sq=24, sk=40)
    flashport.attention(q2, k2, v2, mask_mod=mods.document(shared))
    assert seen == []
    from flashport.programmable import _documents_of_ids   # ids on another device than the call's
    assert _documents_of_ids(shared, True, 2, 40, torch.device("meta")) is None
    assert _documents_of_ids(shared, True, 2, 40, torch.device("cpu"))[0].tolist() == [0, 7, 37, 40, 47, 77, 80]


def test_declared_documents_are_read_once_per_ids_version(monkeypatch):
    """The run counts of mods.document's ids (a sync on a GPU) are read once while the ids tensor lives unchanged;
    an in-place edit of the ids (its version counter) is read again, and the call follows the new documents."""
    import flashport.programmable as programmable
    reads = []
    real = programmable._read_documents
    monkeypatch.setattr(programmable, "_read_documents", lambda *a: reads.append(1) or real(*a))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([7, 30, 3]))
    q, k, v, do = _inputs(torch.float32, sq=40, sk=40)
    mod = mods.document(ids)
    first = flashport.attention(q, k, v, mask_mod=mod)
    assert torch.equal(first, flashport.attention(q, k, v, mask_mod=mod)) and len(reads) == 1
    ids[20:] = 5                        # now documents of 7, 13 and 20 positions
    out, lse = flashport.attention(q, k, v, mask_mod=mod, return_lse=True)
    assert len(reads) == 2 and not torch.equal(out, first)
    _assert_as_reference(q, k, v, do, out, lse, mask_mod=mod)
    key = id(ids)
    del mod, ids
    assert key not in programmable._FOUND_DOCUMENTS     # kept no longer than the ids live


def test_block_mask_prefix_is_found():
    """Prefix-LM block masks give P (P = 1 is causal, a band; P = S sees everything, a band); a prefix that
    differs per head, a hole, a window after the prefix, or Sq != Sk give None."""
    for p in (2, 5, 13, 31, 39):
        for bs in (8, (4, 16), (16, 4)):
            bm = flashport.create_block_mask(mods.prefix_lm(p), None, None, 40, 40, block_size=bs)
            assert (bm.prefix(B, HQ), bm.band(B, HQ), bm.documents(B, HQ)) == (p, None, None)
    assert flashport.create_block_mask(mods.prefix_lm(1), None, None, 40, 40).band(B, HQ) == (-1, 0)
    for mask in (lambda b, h, i, j: (j < 8 + h) | (j <= i), lambda b, h, i, j: ((j < 8) | (j <= i)) & (j != 3),
                 lambda b, h, i, j: (j < 8) | ((j <= i) & (j >= i - 5))):
        assert flashport.create_block_mask(mask, None, None, 40, 40, block_size=8).prefix(B, HQ) is None
    assert flashport.create_block_mask(mods.prefix_lm(8), None, None, 40, 30, block_size=8).prefix(B, HQ) is None


def test_prefix_runs_as_two_builtin_calls(monkeypatch):
    """backend=None runs a prefix-LM block mask as two built-in calls (the prefix unmasked, the rest causal over
    every key), exact against the reference with the mods with softcap and per-entry ALiBi, gradients through the
    returned lse included; a call with its own window keeps the mods."""
    import flashport.api as api
    seen = []
    real = api._prefix_as_two_calls
    monkeypatch.setattr(api, "_prefix_as_two_calls", lambda q, k, v, p, *a: seen.append(p) or real(q, k, v, p, *a))
    q, k, v, do = _inputs(torch.float32, sq=40, sk=40)
    bm = flashport.create_block_mask(mods.prefix_lm(11), None, None, 40, 40, block_size=8)
    for kw in ({}, dict(softcap=4.0), dict(alibi_slopes=torch.rand(2, HQ, generator=torch.Generator().manual_seed(1)))):
        seen.clear()
        out, lse = flashport.attention(q, k, v, block_mask=bm, return_lse=True, **kw)
        assert seen == [11]
        _assert_as_reference(q, k, v, do, out, lse, block_mask=bm, **kw)
    seen.clear()
    flashport.attention(q, k, v, block_mask=bm, window_size=(20, 20))
    assert seen == []


@pytest.mark.parametrize("sq, sk", [(40, 40), (40, 64), (64, 40), (1, 9), (9, 1)])
def test_declared_rules_are_the_masks_they_declare(sq, sk):
    """The ready-made mods that declare a built-in rule (mods._rule) show, under the rule backend=None runs them
    as, exactly the pairs their mask_mod shows; where no built-in rule can say the mask, none is taken."""
    from flashport.programmable import builtin_prefix, builtin_window
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    for mod in (mods.causal, mods.sliding_window(0), mods.sliding_window(5), mods.sliding_window(100),
                mods.prefix_lm(1), mods.prefix_lm(7), mods.prefix_lm(40)):
        prog = build(None, mod, None, None, batch=1, heads_q=1, sq=sq, sk=sk, device="cpu")
        dense = torch.broadcast_to(mod(0, 0, i, j), (sq, sk))
        window = builtin_window(prog, (-1, -1), 1, 1, sq, sk)
        prefix = builtin_prefix(prog, 1, 1, sq, sk)
        if window is not None:
            assert torch.equal(_rule(sq, sk, *window), dense)
        if prefix is not None:
            assert torch.equal(torch.broadcast_to((j < prefix) | (j <= i), (sq, sk)), dense)
        kind, *args = mod.builtin_rule
        if sq == sk:   # every band is a built-in window; a prefix only strictly inside the sequence
            assert (window is not None or prefix is not None) == (kind == "band" or 1 < args[0] < sq)
        if sq < sk and mod is mods.causal:   # top-left causal over more keys is no bottom-right rule
            assert window is None
    # a sliding window with sinks is no window: it declares its sinks (two calls, test_sinks_run_as_...)
    sinks = build(None, mods.sliding_window(5, sinks=2), None, None, batch=1, heads_q=1, sq=sq, sk=sk, device="cpu")
    assert mods.sliding_window(5, sinks=2).builtin_rule == ("sinks", 5, 2)
    assert builtin_window(sinks, (-1, -1), 1, 1, sq, sk) is None and builtin_prefix(sinks, 1, 1, sq, sk) is None


def test_declared_rules_run_as_builtin_calls():
    """backend=None runs mask_mod=mods.causal / sliding_window / prefix_lm (no block mask) as the built-in call, bit for
    bit; a named backend evaluates the mod."""
    from flashport.spec import dense_spec
    q, k, v, _ = _inputs(torch.float32, sq=40, sk=40)
    opts = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, deterministic=False, return_lse=False)
    for mod, builtin in ((mods.causal, dict(causal=True)), (mods.sliding_window(6), dict(window_size=(6, 0)))):
        spec, inputs = dense_spec(q, k, v, mask_mod=mod, builtin_rules=True, **opts)
        assert spec.mods == () and inputs.prog is None
        assert torch.equal(flashport.attention(q, k, v, mask_mod=mod), flashport.attention(q, k, v, **builtin))
        assert dense_spec(q, k, v, mask_mod=mod, **opts)[0].mods == ("mask_mod",)
    out = flashport.attention(q, k, v, mask_mod=mods.prefix_lm(9))
    want = torch.cat([flashport.attention(q[:, :9], k[:, :9], v[:, :9]),
                      flashport.attention(q[:, 9:], k, v, causal=True)], 1)
    assert torch.equal(out, want)


def test_declared_alibi_runs_as_the_builtin_alibi():
    """score_mod=mods.alibi(slopes) runs as alibi_slopes=slopes (bit for bit the built-in call, with a declared or
    block-mask rule beside it), exact against the reference; not where the built-in cannot say it: Sq != Sk, slopes
    that need a gradient, a call with slopes of its own."""
    from flashport.spec import dense_spec
    q, k, v, do = _inputs(torch.float32, sq=40, sk=40)
    slopes = torch.rand(HQ, generator=torch.Generator().manual_seed(2))
    opts = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, deterministic=False, return_lse=False)
    spec, inputs = dense_spec(q, k, v, score_mod=mods.alibi(slopes), mask_mod=mods.causal, builtin_rules=True, **opts)
    assert (spec.mods, spec.alibi, spec.window_right, inputs.prog) == ((), "head", 0, None)
    assert inputs.alibi_slopes is slopes
    bm = flashport.create_block_mask(mods.causal, None, None, 40, 40, block_size=8)
    out = flashport.attention(q, k, v, score_mod=mods.alibi(slopes), block_mask=bm)
    assert torch.equal(out, flashport.attention(q, k, v, alibi_slopes=slopes, causal=True))
    ref = flashport.attention(q, k, v, score_mod=mods.alibi(slopes), block_mask=bm, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    q2, k2, v2, _ = _inputs(torch.float32, sq=24, sk=40)
    kept = [dense_spec(q2, k2, v2, score_mod=mods.alibi(slopes), builtin_rules=True, **opts)[0],
            dense_spec(q, k, v, score_mod=mods.alibi(slopes.clone().requires_grad_()), builtin_rules=True, **opts)[0],
            dense_spec(q, k, v, score_mod=mods.alibi(slopes), builtin_rules=True,
                       **{**opts, "alibi_slopes": slopes})[0]]
    assert [s.mods for s in kept] == [("score_mod",)] * 3


def test_sinks_run_as_a_window_and_a_merged_sink_call(monkeypatch):
    """mask_mod=mods.sliding_window(w, sinks=n) (with or without the block mask built from it) runs as the window
    plus the sink keys it does not reach, merged by lse: exact against the reference (outputs, lse, gradients),
    over windows that reach every sink, none, and all but some; float64 and ALiBi calls keep the mods."""
    import flashport.api as api
    seen = []
    real = api._sinks_as_two_calls
    monkeypatch.setattr(api, "_sinks_as_two_calls", lambda q, k, v, w, n, *a: seen.append((w, n)) or
                        real(q, k, v, w, n, *a))
    for s, w, n in ((40, 8, 3), (40, 37, 4), (40, 39, 2), (7, 3, 9)):
        q, k, v, do = _inputs(torch.float32, sq=s, sk=s)
        mod = mods.sliding_window(w, sinks=n)
        for kw in (dict(mask_mod=mod), dict(block_mask=flashport.create_block_mask(mod, None, None, s, s, block_size=8)),
                   dict(mask_mod=mod, causal=True, softcap=4.0)):
            seen.clear()
            out, lse = flashport.attention(q, k, v, return_lse=True, **kw)
            bm = kw.get("block_mask")
            # a window that reaches back to the sinks is a causal band: its block mask runs as the window instead
            assert seen == ([] if bm is not None and bm.band(B, HQ) is not None else [(w, n)])
            _assert_as_reference(q, k, v, do, out, lse, **kw)
    seen.clear()
    q, k, v, _ = _inputs(torch.float64, sq=40, sk=40)
    flashport.attention(q, k, v, mask_mod=mods.sliding_window(8, sinks=2))
    flashport.attention(q.float(), k.float(), v.float(), mask_mod=mods.sliding_window(8, sinks=2),
                        alibi_slopes=torch.rand(HQ))
    assert seen == []


def test_rewrites_are_counted_per_rule():
    """flashport.rewrites() counts the programmable calls backend=None ran as built-in calls, per rule; a named
    backend's call and a mod that is no rule count nothing; reset_stats clears them."""
    flashport.reset_stats()
    q, k, v, _ = _inputs(torch.float32, sq=40, sk=40)
    docs = torch.repeat_interleave(torch.arange(4), 10)
    calls = [dict(mask_mod=mods.causal), dict(block_mask=flashport.create_block_mask(mods.document(docs), None, None,
                                                                                      40, 40, block_size=8)),
             dict(mask_mod=mods.prefix_lm(9)), dict(mask_mod=mods.sliding_window(5, sinks=2)),
             dict(score_mod=mods.alibi(torch.rand(HQ)), mask_mod=mods.causal),
             dict(mask_mod=mods.causal, backend="blockwise"), dict(score_mod=mods.tanh_softcap(3.0))]
    for kw in calls:
        flashport.attention(q, k, v, **kw)
    assert flashport.rewrites() == {"window": 2, "documents": 1, "prefix": 1, "sinks": 1, "alibi": 1}
    flashport.reset_stats()
    assert set(flashport.rewrites().values()) == {0}

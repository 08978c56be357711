"""Issue [15]: the Triton kernels run score_mod / mask_mod compiled by kernels/mod_codegen.py (Triton's interpreter,
fp32 and fp16).  Every ready-made mod the compiler accepts is held to the tolerance rule against the float64
reference (output, lse, dq / dk / dv), rows that see no key included; new shapes generate no new function; mods
outside the compiler's whitelist are refused with a reason naming what is wrong."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

import flashport  # noqa: E402
from flashport import mods  # noqa: E402
from flashport.backend.reference import materialized_attention  # noqa: E402
from flashport.check import magnitude, rule_error  # noqa: E402
from flashport.programmable import build  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

# S = 37 crosses the interpreter's 16-row tiles with a ragged last one; GQA 2 / 1 (the interpreter runs one program
# at a time: every batch entry and head costs seconds over the file)
B, S, HQ, HKV, D = 1, 37, 2, 1, 16
_g = torch.Generator().manual_seed(15)
SLOPES = torch.rand(HQ, generator=_g) * 0.5 + 0.05
TABLE = torch.randn(HQ, 9, generator=_g)
DOCS = torch.tensor([0] * 10 + [1] * 3 + [2] * 24)

CASES = {
    "causal": dict(mask_mod=mods.causal),
    "window-sinks": dict(mask_mod=mods.sliding_window(6, sinks=3)),
    "prefix-lm": dict(mask_mod=mods.prefix_lm(11)),
    "document": dict(mask_mod=mods.document(DOCS)),
    "alibi": dict(score_mod=mods.alibi(SLOPES)),
    "tanh-softcap": dict(score_mod=mods.tanh_softcap(2.0)),
    "rel-table+causal": dict(score_mod=mods.relative_position(TABLE), causal=True),
    # rows 0..19 see no key: zeros, lse -inf, zero gradients
    "empty-rows+rel-table": dict(mask_mod=lambda b, h, i, j: (i >= 20) & (j <= i + h % 2),
                                 score_mod=mods.relative_position(TABLE)),
    # the pipeline's order: built-in softcap and ALiBi come before the score_mod, the window and mask_mod after
    "builtins+mods": dict(score_mod=mods.relative_position(TABLE), mask_mod=mods.document(DOCS), softcap=4.0,
                          alibi_slopes=SLOPES, window_size=(9, 2)),
    # block masks: tiles equal to the kernels' (16), smaller (8: a kernel tile straddles blocks), per head and
    # oblong (32 x 8); their empty tiles are skipped
    "block-mask-causal": dict(block_mask=flashport.create_block_mask(mods.causal, None, None, S, S, block_size=16)),
    "block-mask-window+rel-table": dict(block_mask=flashport.create_block_mask(mods.sliding_window(6, sinks=2), None,
                                                                               None, S, S, block_size=8),
                                        score_mod=mods.relative_position(TABLE)),
    "block-mask-per-head": dict(block_mask=flashport.create_block_mask(
        lambda b, h, i, j: ((j <= i) & (h == 0)) | ((j >= i) & (h == 1)), 1, HQ, S, S, block_size=(32, 8))),
}


def _inputs(dtype, b=B, s=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, HQ, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, s, HKV, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, s, HKV, D, generator=g).to(dtype).requires_grad_()
    do = torch.randn(b, s, HQ, D, generator=g).to(dtype)
    return q, k, v, do


def _math_path(q, k, v, kw, dtype):
    """The same-dtype materialised math path of the tolerance rule, with the same mods."""
    prog = build(kw.get("score_mod"), kw.get("mask_mod"), kw.get("block_mask"), kw.get("attn_bias"), batch=B,
                 heads_q=HQ, sq=S, sk=S, device="cpu")
    left, right = kw.get("window_size", (-1, -1))
    slopes = kw.get("alibi_slopes")
    return materialized_attention(q, k, v, scale=D ** -0.5, softcap=kw.get("softcap", 0.0),
                                  alibi=None if slopes is None else slopes.expand(B, -1), left=left,
                                  right=0 if kw.get("causal") else right, compute_dtype=dtype, prog=prog)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_mods_within_the_tolerance_rule(name, dtype):
    kw = CASES[name]
    q, k, v, do = _inputs(dtype)
    out, lse = flashport.attention(q, k, v, backend="triton", return_lse=True, **kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = flashport.attention(q64, k64, v64, backend="reference", return_lse=True, **kw)
    low, low_lse = _math_path(q, k, v, kw, dtype)
    err, bound = rule_error(out, ref, low, dtype, 2.0)
    assert err <= bound, ("out", err, bound)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key differ from the reference"
    err, bound = rule_error(lse[seen], ref_lse[seen], low_lse[seen], dtype, 2.0)
    assert err <= bound, ("lse", err, bound)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    math = torch.autograd.grad(low, (q, k, v), do)
    mag = magnitude(q, k, v, do)
    for n, a, b, m in zip(("dq", "dk", "dv"), got, want, math):
        err, bound = rule_error(a, b, m, dtype, 3.0, mag)
        assert err <= bound, (n, err, bound)
    if name.startswith("empty-rows"):
        assert (out[:, :20] == 0).all() and torch.isneginf(lse[:, :, :20]).all()
        assert (got[0][:, :20] == 0).all()


def test_varlen_mods_see_the_sequence_index_and_positions():
    """b is the sequence's index and q_idx / kv_idx positions within it, as in the dense call of each sequence."""
    cu = torch.tensor([0, 5, 5, 22, 31], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(31, h, D, generator=g) for h in (HQ, HKV, HKV))
    seq_bias = torch.tensor([0.5, -1.0, 2.0, 0.25])     # per sequence: b is the sequence's index

    def score_mod(score, b, h, i, j):
        return mods.relative_position(TABLE)(score, b, h, i, j) + seq_bias[b]
    kw = dict(score_mod=score_mod, mask_mod=mods.sliding_window(6, sinks=1))
    out = flashport.attention_varlen(q, k, v, cu, cu, 17, 17, backend="triton", **kw)
    ref = flashport.attention_varlen(q.double(), k.double(), v.double(), cu, cu, 17, 17, backend="reference", **kw)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)


def _fresh_generated_functions(monkeypatch):
    """Forget the process's generated functions and traces (a file cache of its own), so a first call generates."""
    from flashport.kernels import mod_codegen
    monkeypatch.setattr(mod_codegen, "_loaded", {})
    monkeypatch.setattr(mod_codegen, "_memo", type(mod_codegen._memo)())
    monkeypatch.setattr(mod_codegen, "stats", type(mod_codegen.stats)())
    return mod_codegen


def test_new_batch_length_and_values_generate_no_new_function(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHPORT_CACHE_DIR", str(tmp_path))
    mc = _fresh_generated_functions(monkeypatch)
    calls = [(1, 17, torch.randn(HQ, 9)), (2, 33, torch.randn(HQ, 9)), (1, 5, torch.randn(HQ, 9))]
    counts = []
    for b, s, table in calls:      # new closures over new tables each call: the same code, other values
        q, k, v, do = _inputs(torch.float32, b=b, s=s)
        docs = torch.randint(0, 3, (s,)).sort()[0]
        out = flashport.attention(q, k, v, backend="triton", score_mod=mods.relative_position(table),
                                  mask_mod=mods.document(docs))
        out.backward(do)
        counts.append(mc.stats["generated"])
    assert counts[0] == 3, counts            # score, its derivative and the mask, generated once
    assert counts[1:] == [3, 3], counts      # then every call reuses them
    assert len(list((tmp_path / "mods").glob("*.py"))) == 3


def test_a_new_attn_bias_each_call_traces_nothing_and_is_not_kept(monkeypatch, tmp_path):
    """The score function reads a stand-in of the bias's rank, dtype and size-1 dimensions; each call puts its own
    bias there: new biases (other B and S, new values) trace and generate nothing, and no cache holds them."""
    import gc
    import weakref
    monkeypatch.setenv("FLASHPORT_CACHE_DIR", str(tmp_path))
    mc = _fresh_generated_functions(monkeypatch)
    traces, real = [], mc._trace
    monkeypatch.setattr(mc, "_trace", lambda *a, **kw: traces.append(1) or real(*a, **kw))
    gone = []
    for b, s in ((1, 17), (2, 33), (1, 5)):
        q, k, v, do = _inputs(torch.float32, b=b, s=s)
        bias = torch.randn(1, HQ, s, s).requires_grad_()
        out = flashport.attention(q, k, v, backend="triton", attn_bias=bias)
        (dbias,) = torch.autograd.grad(out, bias, do)
        q64, k64, v64 = (t.detach().double() for t in (q, k, v))
        b64 = bias.detach().double().requires_grad_()
        ref = flashport.attention(q64, k64, v64, backend="reference", attn_bias=b64)
        (want,) = torch.autograd.grad(ref, b64, do.double())
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)
        torch.testing.assert_close(dbias.double(), want, rtol=0, atol=2e-5)
        gone.append(weakref.ref(bias))
        del bias, out, dbias
    gc.collect()
    assert len(traces) == 3 and mc.stats["generated"] == 3, (len(traces), mc.stats)   # score, d score, d bias
    assert all(r() is None for r in gone), "a cache keeps a caller's attn_bias alive"


def _unsorted_rank(score, b, h, i, j):
    return score + torch.sort(SLOPES)[0][h]


def _branches_on_the_keys(score, b, h, i, j):
    if bool((j < 1000).all()):      # a Python branch on tensor data: runs eagerly, cannot become a kernel
        return score
    return score - 1.0


@pytest.mark.parametrize("score_mod, why", [(_unsorted_rank, "score_mod.*aten.sort"),
                                            (_branches_on_the_keys, "score_mod.*control flow"),
                                            (lambda s, b, h, i, j: s + TABLE[h].sum(), "score_mod.*slices")],
                         ids=["sort", "branch", "slice"])
def test_a_mod_outside_the_compiler_is_refused_with_the_reason(score_mod, why):
    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(flashport.UnsupportedError, match=why):
        flashport.attention(q, k, v, backend="triton", score_mod=score_mod)
    out = flashport.attention(q, k, v, backend="blockwise", score_mod=score_mod)   # the mod itself is fine
    assert torch.isfinite(out).all()


def test_the_kernels_skip_the_tiles_the_live_table_marks_empty(monkeypatch):
    """With every kernel tile marked empty, nothing is visited: zeros and lse -inf, where the mask has visible keys."""
    from flashport.kernels import block_skip
    real = block_skip.live_tiles
    monkeypatch.setattr(block_skip, "live_tiles", lambda bm, *a: torch.zeros_like(real(bm, *a)))
    q, k, v, _ = _inputs(torch.float32)
    bm = flashport.create_block_mask(mods.causal, None, None, S, S, block_size=16)
    out, lse = flashport.attention(q, k, v, backend="triton", block_mask=bm, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert torch.isfinite(flashport.attention(q, k, v, backend="reference", block_mask=bm, return_lse=True)[1]).all()


@pytest.mark.parametrize("tiles", [(16, 16), (16, 32), (64, 16), (8, 24)], ids=str)
@pytest.mark.parametrize("blocks", [(16, 16), (8, 8), (32, 8)], ids=str)
def test_live_tiles_mark_empty_partial_and_full_kernel_tiles(blocks, tiles):
    from flashport.kernels.block_skip import live_tiles
    sq, sk = 53, 70
    bm = flashport.create_block_mask(lambda b, h, i, j: (j <= i) & ((i - j) < 9) | (j == 60), None, HQ, sq, sk,
                                     block_size=blocks)
    got = live_tiles(bm, sq, sk, *tiles)
    qb, kb = blocks
    i, j = torch.meshgrid(torch.arange(sq), torch.arange(sk), indexing="ij")
    for h in range(HQ):
        block_live = bm.state[0, h][i // qb, j // kb] != 0          # per element: its block is not empty
        block_full = bm.state[0, h][i // qb, j // kb] == 2          # per element: its block is FULL
        for t in range(got.shape[2]):
            for u in range(got.shape[3]):
                tile = (slice(t * tiles[0], (t + 1) * tiles[0]), slice(u * tiles[1], (u + 1) * tiles[1]))
                want = 0 if not block_live[tile].any() else 2 if block_full[tile].all() else 1
                assert int(got[0, h, t, u]) == want, (h, t, u)
    causal = live_tiles(flashport.create_block_mask(mods.causal, None, None, 128, 128, block_size=blocks), 128, 128,
                        *tiles)
    assert (causal == 2).any() and (causal == 1).any() and (causal == 0).any()   # below, on and above the diagonal


def _scaled_rel(table, scale):
    """Two captured tensors, one multiplying the score (a derivative other than 1) and one added."""
    rel = mods.relative_position(table)
    return lambda s, b, h, i, j: rel(s * scale[h], b, h, i, j)


# Calls whose captured tensors or attn_bias require grad: kw(table, scale, bias, key_bias) -> the call's keywords
GRAD_CASES = {
    "rel-table+causal": lambda t, c, *_: dict(score_mod=mods.relative_position(t), causal=True),
    "empty-rows+rel-table": lambda t, c, *_: dict(mask_mod=lambda b, h, i, j: (i >= 20) & (j <= i + h % 2),
                                                  score_mod=mods.relative_position(t)),
    "builtins+two-tables": lambda t, c, *_: dict(score_mod=_scaled_rel(t, c), mask_mod=mods.document(DOCS),
                                                 softcap=4.0, alibi_slopes=SLOPES, window_size=(9, 2)),
    "block-mask+rel-table": lambda t, c, *_: dict(block_mask=flashport.create_block_mask(
        mods.sliding_window(6, sinks=2), None, None, S, S, block_size=8), score_mod=mods.relative_position(t)),
    # attn_bias: a full [B, Hq, S, S] one after a score_mod, and one broadcast over batch, heads and queries
    "bias+rel-table+causal": lambda t, c, bias, *_: dict(score_mod=mods.relative_position(t), attn_bias=bias,
                                                         causal=True),
    "key-bias+document": lambda t, c, bias, kb, qb: dict(attn_bias=kb, mask_mod=mods.document(DOCS)),
    # a gradient index that varies with the query only (the cases above: per element, per key, per tile, per diagonal)
    "query-bias+window": lambda t, c, bias, kb, qb: dict(attn_bias=qb, window_size=(5, 3)),
}
SCALE = torch.rand(HQ, generator=_g) + 0.5
BIAS = torch.randn(B, HQ, S, S, generator=_g)
KEY_BIAS = torch.randn(S, generator=_g)
QUERY_BIAS = torch.randn(S, 1, generator=_g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_into_captured_tensors(name, dtype):
    """The dK/dV kernel adds each captured tensor's gradient (atomics): within the rule against float64, where the
    tables' gradients are judged like dq / dk / dv (the math path runs the same mods in the inputs' dtype)."""
    q, k, v, do = _inputs(dtype)
    leaves = tuple(t.clone().requires_grad_() for t in (TABLE, SCALE, BIAS, KEY_BIAS, QUERY_BIAS))
    leaves64 = tuple(t.detach().double().requires_grad_() for t in leaves)
    kw, kw64 = GRAD_CASES[name](*leaves), GRAD_CASES[name](*leaves64)
    out = flashport.attention(q, k, v, backend="triton", **kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = flashport.attention(q64, k64, v64, backend="reference", **kw64)
    prog = build(kw.get("score_mod"), kw.get("mask_mod"), kw.get("block_mask"), kw.get("attn_bias"), batch=B,
                 heads_q=HQ, sq=S, sk=S, device="cpu")
    used = [n for n, t in enumerate(leaves) if any(t is c for c in prog.differentiable)]
    assert used, "the case reads no table"
    low, _ = _math_path(q, k, v, kw, dtype)
    got = torch.autograd.grad(out, (q, k, v, *(leaves[n] for n in used)), do)
    want = torch.autograd.grad(ref, (q64, k64, v64, *(leaves64[n] for n in used)), do.double())
    math = torch.autograd.grad(low, (q, k, v, *(leaves[n] for n in used)), do)
    mag = magnitude(q, k, v, do)
    for n, (a, b, m) in enumerate(zip(got, want, math)):
        err, bound = rule_error(a, b, m, dtype, 3.0, mag)
        assert err <= bound, (("dq", "dk", "dv")[n] if n < 3 else ("dtable", "dscale", "dbias", "dkey_bias", "dquery_bias")[used[n - 3]],
                              err, bound)
        assert a.dtype == (q.dtype if n < 3 else torch.float32) and a.shape == (got[n].shape)


def test_captured_gradients_are_refused_with_deterministic():
    q, k, v, _ = _inputs(torch.float32)
    table = TABLE.clone().requires_grad_()
    with pytest.raises(flashport.UnsupportedError, match="atomics"):
        flashport.attention(q, k, v, backend="triton", score_mod=mods.relative_position(table), deterministic=True)
    with torch.no_grad():   # inference needs no gradient into the table: served, deterministic or not
        out = flashport.attention(q, k, v, backend="triton", score_mod=mods.relative_position(table),
                                  deterministic=True)
        ref = flashport.attention(q, k, v, backend="reference", score_mod=mods.relative_position(table))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_auto_ranks_the_interpreted_kernels_last_for_programmable_calls():
    # on a GPU the compiled mods come first (input_reasons refuses one that does not compile); under the
    # interpreter they are the slowest path
    assert not flashport.dispatch.get("triton").prefers(
        flashport.spec.dense_spec(*_inputs(torch.float32)[:3], causal=False, softmax_scale=None, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False,
                                  return_lse=False, mask_mod=mods.causal)[0], "fwd")


# ----------------------------------------------------------------------------- the generated functions alone
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

N = 16
TAB64 = torch.randn(HQ, N, generator=_g, dtype=torch.float64)
LAYOUT = torch.rand(2, 2, generator=_g) < 0.5
SCORE_MODS = {
    "where-sigmoid": lambda s, b, h, i, j: torch.where(i - j > 2, s * 2, s.sigmoid()),
    "floor-div-mod": lambda s, b, h, i, j: s + ((i - j) // 3).float() + ((i - j) % 5).float() + (i - j) / 4,
    "clamp-exp-log": lambda s, b, h, i, j: torch.clamp(s, -0.5, 0.5) + torch.exp(s) - torch.log(s.abs() + 1),
    "pow-sqrt": lambda s, b, h, i, j: s ** 2 + torch.sqrt(s.abs()) - s.abs() ** 0.5 * 0.5,
    "table64-wraps": lambda s, b, h, i, j: s + TAB64[h, j - i],          # j - i < 0 counts from the end
    "logic": lambda s, b, h, i, j: torch.where(((i > j) & ~(j == 3)) | (i == 0) ^ (b == 1), s,
                                               torch.full_like(s, -1.0)),
    "sign-casts": lambda s, b, h, i, j: s * torch.sign(s) + (i > j).to(torch.float32) + s.half().float(),
    "lifted-literal": lambda s, b, h, i, j: torch.maximum(s - torch.tensor(2.5), torch.minimum(s, s * 0.5)),
    "relu-tanh": lambda s, b, h, i, j: torch.relu(s) + torch.tanh(s * 0.3) * h,
}
MASK_MODS = {
    "checker": lambda b, h, i, j: (i // 4 + j // 4) % 2 == 0,
    "layout": lambda b, h, i, j: LAYOUT[i // 8, j // 8] | (i == j),
    "logical": lambda b, h, i, j: torch.logical_and(i >= j, torch.logical_not(j == h)),
}


@triton.jit
def _eval_score(S, Out, Grad, b, h, cap, FN: tl.constexpr, GRAD: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)[:, None]
    j = tl.arange(0, N)[None, :]
    s = tl.load(S + i * N + j)
    tl.store(Out + i * N + j, FN(s, b, h, i, j, cap))
    tl.store(Grad + i * N + j, GRAD(s, b, h, i, j, cap))


@triton.jit
def _eval_mask(Out, b, h, cap, FN: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)[:, None]
    j = tl.arange(0, N)[None, :]
    tl.store(Out + i * N + j, (FN(b, h, i, j, cap) | (i < 0)).to(tl.int8))


def _grid():
    i, j = torch.meshgrid(torch.arange(N), torch.arange(N), indexing="ij")
    return torch.tensor(1), torch.tensor(1), i, j


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_a_generated_score_mod_and_its_derivative_equal_the_eager_mod(name):
    from flashport.kernels.mod_codegen import compile_mods
    fn = SCORE_MODS[name]
    c = compile_mods(fn, None, "cpu")
    assert not isinstance(c, str), c
    s = torch.randn(N, N, generator=torch.Generator().manual_seed(1))
    out, grad = torch.empty(N, N), torch.empty(N, N)
    _eval_score[(1,)](s, out, grad, 1, 1, c.cap(), FN=c.score, GRAD=c.score_grad, N=N)
    x = s.clone().requires_grad_()
    want = fn(x, *_grid())
    (dwant,) = torch.autograd.grad(want, x, torch.ones_like(want))
    torch.testing.assert_close(out, want.float().detach(), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(grad, dwant.float(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_a_generated_mask_mod_equals_the_eager_mod(name):
    from flashport.kernels.mod_codegen import compile_mods
    fn = MASK_MODS[name]
    c = compile_mods(None, fn, "cpu")
    assert not isinstance(c, str), c
    out = torch.empty(N, N, dtype=torch.int8)
    _eval_mask[(1,)](out, 1, 1, c.cap(), FN=c.mask, N=N)
    assert torch.equal(out.bool(), fn(*_grid()))


_REBOUND = torch.zeros(HQ)


def test_a_rebound_global_or_closure_tensor_is_read_not_a_stale_copy():
    """The compile memo holds per mod object only while what it reads is the same object: a global or a closure
    variable rebound to a new tensor must reach the kernel (in-place changes reach it through the same pointer)."""
    global _REBOUND
    q, k, v, _ = _inputs(torch.float32)

    def by_global(score, b, h, i, j):
        return score + _REBOUND[h] * (i - j)
    table = torch.zeros(HQ, 9)

    def by_closure(score, b, h, i, j):
        return score + table[h, (i - j).clamp(-4, 4) + 4]
    for mod in (by_global, by_closure):
        first = flashport.attention(q, k, v, backend="triton", score_mod=mod)
        _REBOUND = torch.full((HQ,), 0.5)
        table = torch.randn(HQ, 9)
        out = flashport.attention(q, k, v, backend="triton", score_mod=mod)
        ref = flashport.attention(q, k, v, backend="reference", score_mod=mod)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        assert not torch.allclose(out, first)
        _REBOUND.mul_(3.0)                     # in place: the same tensor, new values
        torch.testing.assert_close(flashport.attention(q, k, v, backend="triton", score_mod=by_global),
                                   flashport.attention(q, k, v, backend="reference", score_mod=by_global), rtol=0,
                                   atol=1e-5)


def test_programmable_dq_launches_with_8_warps_where_the_table_gives_4_for_128_rows():
    from flashport.kernels.attn_bwd import dq_config_with_mods
    from flashport.kernels.common import KernelArgs
    from flashport.kernels.mod_codegen import compile_mods
    from flashport.kernels.tuning import KernelConfig
    q, k, v, _ = _inputs(torch.float32)
    spec = flashport.spec.dense_spec(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]
    plain = KernelArgs(spec, q, k, v)
    with_mask = KernelArgs(spec, q, k, v, mods=compile_mods(None, mods.causal, "cpu"))
    wide, narrow = KernelConfig(128, 64, 4, 3), KernelConfig(64, 64, 4, 3)
    assert dq_config_with_mods(wide, plain) == wide                       # the plain kernels: the table's choice
    assert dq_config_with_mods(wide, with_mask).num_warps == 8
    assert dq_config_with_mods(narrow, with_mask) == narrow


class _Scale:
    def __init__(self, a):
        self.a = a

    def __call__(self, score, b, h, i, j):
        return score * self.a


def test_python_values_a_mod_reads_changed_in_place_reach_the_kernel():
    """A trace bakes the Python values a mod reads, so the memo compares them by value: a captured list's entry, a
    module's attribute read through `self`, a callable object's attribute and a mutable default, each changed in
    place on the same mod object, give the new answer (they gave the old trace's before mod_state)."""
    q, k, v, _ = _inputs(torch.float32)
    cfg = [2]

    class Owner(torch.nn.Module):
        window = 3

        def mod(self):
            return lambda b, h, i, j: (i >= j) & (i - j <= self.window)

    owner = Owner()

    def by_default(b, h, i, j, w=[4]):
        return (i >= j) & (i - j <= w[0])
    cases = [(dict(mask_mod=lambda b, h, i, j: (i >= j) & (i - j <= cfg[0])), lambda: cfg.__setitem__(0, 9)),
             (dict(mask_mod=owner.mod()), lambda: setattr(owner, "window", 11)),
             (dict(score_mod=_Scale(0.5)), None),
             (dict(mask_mod=by_default), lambda: by_default.__defaults__[0].__setitem__(0, 7))]
    cases[2] = (cases[2][0], lambda: setattr(cases[2][0]["score_mod"], "a", 3.0))
    for kw, change in cases:
        first = flashport.attention(q, k, v, backend="triton", **kw)
        change()
        out = flashport.attention(q, k, v, backend="triton", **kw)
        torch.testing.assert_close(out, flashport.attention(q, k, v, backend="reference", **kw), rtol=0, atol=1e-5)
        assert not torch.allclose(out, first), kw

"""The public contract: malformed input raises ValueError/TypeError naming the argument, backend
selection is strict, empty and non-contiguous inputs work, lse has the documented shape and dtype."""
import pytest
import torch

import flashport
from flashport.dispatch import UnsupportedError

B, SQ, SK, HQ, HKV, D = 2, 5, 7, 4, 2, 8
I32 = torch.int32


def qkv(**over):
    t = dict(q=torch.randn(B, SQ, HQ, D), k=torch.randn(B, SK, HKV, D), v=torch.randn(B, SK, HKV, D))
    t.update(over)
    return t


def attn(**kw):
    t = qkv(**{n: kw.pop(n) for n in ("q", "k", "v") if n in kw})
    return flashport.attention(t["q"], t["k"], t["v"], **kw)


def varlen(cu_q=None, cu_k=None, mq=3, mk=4, **kw):
    q, k, v = torch.randn(6, HQ, D), torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    cu_q = torch.tensor([0, 3, 6], dtype=I32) if cu_q is None else cu_q
    cu_k = torch.tensor([0, 4, 8], dtype=I32) if cu_k is None else cu_k
    return flashport.attention_varlen(kw.pop("q", q), kw.pop("k", k), kw.pop("v", v), cu_q, cu_k, mq, mk, **kw)


def cache(**kw):
    args = dict(q=torch.randn(B, 1, HQ, D), k_cache=torch.zeros(B, 8, HKV, D), v_cache=torch.zeros(B, 8, HKV, D))
    args.update(kw)
    return flashport.attention_with_kvcache(**args)


def paged(**kw):
    args = dict(q=torch.randn(B, 1, HQ, D), k_cache=torch.zeros(6, 4, HKV, D), v_cache=torch.zeros(6, 4, HKV, D),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32), cache_seqlens=torch.tensor([1, 2], dtype=I32))
    args.update(kw)
    return flashport.attention_with_kvcache(**args)


NEW = dict(k=torch.randn(B, 2, HKV, D), v=torch.randn(B, 2, HKV, D))

# (id, call, exception, a word the message must contain)
MALFORMED = [
    ("q-rank", lambda: attn(q=torch.randn(SQ, HQ, D)), ValueError, "q"),
    ("k-rank", lambda: attn(k=torch.randn(B, SK, HKV, D, 1)), ValueError, "k"),
    ("q-not-tensor", lambda: attn(q=[[1.0]]), TypeError, "q"),
    ("batch-mismatch", lambda: attn(k=torch.randn(B + 1, SK, HKV, D), v=torch.randn(B + 1, SK, HKV, D)),
     ValueError, "batch"),
    ("k-v-seq-mismatch", lambda: attn(v=torch.randn(B, SK + 1, HKV, D)), ValueError, "sequence"),
    ("head-dim-mismatch", lambda: attn(k=torch.randn(B, SK, HKV, D + 1)), ValueError, "head dim"),
    ("v-heads-mismatch", lambda: attn(v=torch.randn(B, SK, HKV + 1, D)), ValueError, "heads"),
    ("hq-not-multiple", lambda: attn(k=torch.randn(B, SK, 3, D), v=torch.randn(B, SK, 3, D)), ValueError, "heads"),
    ("int-dtype", lambda: attn(q=torch.ones(B, SQ, HQ, D, dtype=torch.int32)), TypeError, "q"),
    ("mixed-dtype", lambda: attn(k=torch.randn(B, SK, HKV, D, dtype=torch.float16)), TypeError, "dtype"),
    ("window-not-pair", lambda: attn(window_size=(3,)), ValueError, "window_size"),
    ("window-below-minus-one", lambda: attn(window_size=(-2, 0)), ValueError, "window_size"),
    ("window-float", lambda: attn(window_size=(1.5, 0)), TypeError, "window_size"),
    ("causal-contradicts-window", lambda: attn(causal=True, window_size=(4, 3)), ValueError, "causal"),
    ("causal-not-bool", lambda: attn(causal=1), TypeError, "causal"),
    ("negative-softcap", lambda: attn(softcap=-1.0), ValueError, "softcap"),
    ("nan-scale", lambda: attn(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("dropout-one", lambda: attn(dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout-negative", lambda: attn(dropout_p=-0.1), ValueError, "dropout_p"),
    ("alibi-shape", lambda: attn(alibi_slopes=torch.rand(HQ + 1)), ValueError, "alibi_slopes"),
    ("alibi-dtype", lambda: attn(alibi_slopes=torch.rand(HQ, dtype=torch.float64)), TypeError, "alibi_slopes"),
    ("cu-seqlens-int64", lambda: varlen(cu_q=torch.tensor([0, 3, 6])), TypeError, "cu_seqlens_q"),
    ("cu-seqlens-decreasing", lambda: varlen(cu_k=torch.tensor([0, 5, 4], dtype=I32)), ValueError, "cu_seqlens_k"),
    ("cu-seqlens-not-zero-start", lambda: varlen(cu_q=torch.tensor([1, 3, 6], dtype=I32)), ValueError, "cu_seqlens_q"),
    ("cu-seqlens-past-total", lambda: varlen(cu_k=torch.tensor([0, 4, 9], dtype=I32), mk=5), ValueError,
     "cu_seqlens_k"),
    ("cu-seqlens-batch-mismatch", lambda: varlen(cu_k=torch.tensor([0, 8], dtype=I32), mk=8), ValueError,
     "cu_seqlens_k"),
    ("max-seqlen-too-small", lambda: varlen(mq=2), ValueError, "max_seqlen_q"),
    ("max-seqlen-not-int", lambda: varlen(mk=4.0), TypeError, "max_seqlen_k"),
    ("varlen-q-rank", lambda: varlen(q=torch.randn(1, 6, HQ, D)), ValueError, "q"),
    ("cache-too-small", lambda: cache(**NEW, cache_seqlens=torch.tensor([7, 0], dtype=I32)), ValueError, "cache"),
    ("cache-seqlens-beyond-capacity", lambda: cache(cache_seqlens=torch.tensor([9, 0], dtype=I32)), ValueError,
     "cache_seqlens"),
    ("cache-seqlens-dtype", lambda: cache(cache_seqlens=torch.tensor([1, 0])), TypeError, "cache_seqlens"),
    ("cache-seqlens-shape", lambda: cache(cache_seqlens=torch.tensor([1], dtype=I32)), ValueError, "cache_seqlens"),
    ("k-without-v", lambda: cache(k=NEW["k"], cache_seqlens=torch.tensor([1, 0], dtype=I32)), ValueError, "k and v"),
    ("new-kv-without-seqlens", lambda: cache(**NEW), ValueError, "cache_seqlens"),
    ("new-k-wrong-heads", lambda: cache(k=torch.randn(B, 2, HKV + 1, D), v=torch.randn(B, 2, HKV + 1, D),
                                        cache_seqlens=torch.tensor([1, 0], dtype=I32)), ValueError, "k"),
    ("cache-batch-mismatch", lambda: cache(k_cache=torch.zeros(B + 1, 8, HKV, D),
                                           v_cache=torch.zeros(B + 1, 8, HKV, D)), ValueError, "k_cache"),
    ("block-table-out-of-range", lambda: paged(block_table=torch.tensor([[0, 1], [2, 6]], dtype=I32)), ValueError,
     "block_table"),
    ("block-table-negative", lambda: paged(block_table=torch.tensor([[0, -1], [2, 3]], dtype=I32)), ValueError,
     "block_table"),
    ("block-table-dtype", lambda: paged(block_table=torch.tensor([[0, 1], [2, 3]])), TypeError, "block_table"),
    ("block-table-batch", lambda: paged(block_table=torch.tensor([[0, 1]], dtype=I32)), ValueError, "block_table"),
    ("paged-seqlens-beyond-capacity", lambda: paged(cache_seqlens=torch.tensor([1, 9], dtype=I32)), ValueError,
     "cache_seqlens"),
    ("merge-lse-dtype", lambda: flashport.merge_attention_states([torch.zeros(1, 2, 2, 4)],
                                                                 [torch.zeros(1, 2, 2, dtype=torch.float64)]),
     TypeError, "lses"),
    ("merge-lse-shape", lambda: flashport.merge_attention_states([torch.zeros(1, 2, 2, 4)], [torch.zeros(1, 2, 3)]),
     ValueError, "lses"),
    ("merge-length", lambda: flashport.merge_attention_states([torch.zeros(1, 2, 2, 4)], []), ValueError, "lses"),
    ("backend-not-str", lambda: attn(backend=3), TypeError, "backend"),
]


def test_enough_malformed_cases():
    assert len(MALFORMED) >= 25


@pytest.mark.parametrize("name,call,exc,word", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_input_names_the_argument(name, call, exc, word):
    with pytest.raises(exc) as info:
        call()
    assert not isinstance(info.value, UnsupportedError), "malformed input must not look like a backend refusal"
    assert word in str(info.value), f"{name}: message {str(info.value)!r} does not name {word!r}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mismatch needs a second device")
def test_device_mismatch():
    with pytest.raises(ValueError, match="device"):
        attn(k=torch.randn(B, SK, HKV, D, device="cuda"), v=torch.randn(B, SK, HKV, D, device="cuda"))


# ----------------------------------------------------------------------------- backends and selection
def test_backends_info():
    infos = flashport.backends()
    assert all(isinstance(b, flashport.BackendInfo) for b in infos)
    names = [b.name for b in infos]
    assert {"reference", "blockwise"} <= set(names)
    assert names.index("blockwise") < names.index("reference")
    for b in infos:
        assert isinstance(b.reasons, list) and isinstance(b.capabilities, dict)
        assert b.available == (not b.reasons)
    with pytest.raises(Exception):
        infos[0].name = "x"  # frozen


def test_reference_is_never_chosen_automatically(monkeypatch):
    from flashport import dispatch
    monkeypatch.delenv("FLASHPORT_BACKEND", raising=False)
    for name in [n for n in dispatch._REGISTRY if n != "reference"]:  # take every other backend away
        monkeypatch.setattr(dispatch._REGISTRY[name], "availability", lambda: ["disabled by test"])
    with pytest.raises(UnsupportedError) as info:
        attn()
    assert "blockwise" in str(info.value) and "disabled by test" in str(info.value)
    attn(backend="reference")  # but it serves when named


def test_use_backend_and_env_are_strict(monkeypatch):
    from flashport import dispatch
    with pytest.raises(UnsupportedError, match="unknown backend"):
        with flashport.use_backend("no-such"):
            pass
    monkeypatch.setenv("FLASHPORT_BACKEND", "no-such")
    with pytest.raises(UnsupportedError, match="unknown backend"):
        attn()
    monkeypatch.setenv("FLASHPORT_BACKEND", "blockwise")
    monkeypatch.setattr(dispatch._REGISTRY["blockwise"], "supports", lambda spec, role=None: ["pretend reason"])
    with pytest.raises(UnsupportedError, match="pretend reason"):  # no silent fallback to another backend
        attn()
    monkeypatch.delenv("FLASHPORT_BACKEND")
    with flashport.use_backend("blockwise"):
        with pytest.raises(UnsupportedError, match="pretend reason"):
            attn()
    with pytest.raises(UnsupportedError, match="pretend reason"):
        attn(backend="blockwise")


def test_named_backend_is_the_one_that_runs(monkeypatch):
    from flashport import dispatch
    calls = []
    real = dispatch._REGISTRY["reference"].run
    monkeypatch.setattr(dispatch._REGISTRY["reference"], "run", lambda s, i: calls.append(1) or real(s, i))
    with flashport.use_backend("reference"):
        attn()
    monkeypatch.setenv("FLASHPORT_BACKEND", "reference")
    attn()
    assert len(calls) == 2


def test_version():
    assert isinstance(flashport.__version__, str) and flashport.__version__


# ----------------------------------------------------------------------------- shapes and odd inputs
@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_lse_shape_and_dtype(backend):
    for dtype in (torch.float32, torch.bfloat16):
        t = {n: x.to(dtype) for n, x in qkv().items()}
        out, lse = flashport.attention(**t, return_lse=True, backend=backend)
        assert out.dtype == dtype and out.shape == (B, SQ, HQ, D)
        assert lse.dtype == torch.float32 and lse.shape == (B, HQ, SQ)
    assert isinstance(flashport.attention(**qkv(), backend=backend), torch.Tensor)


@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_empty_inputs(backend):
    out, lse = attn(q=torch.randn(B, 0, HQ, D), return_lse=True, backend=backend)
    assert out.shape == (B, 0, HQ, D) and lse.shape == (B, HQ, 0)
    out, lse = attn(k=torch.randn(B, 0, HKV, D), v=torch.randn(B, 0, HKV, D), return_lse=True, backend=backend)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    z = torch.zeros(B + 1, dtype=I32)
    out = flashport.attention_varlen(torch.randn(0, HQ, D), torch.randn(0, HKV, D), torch.randn(0, HKV, D), z, z,
                                     0, 0, backend=backend)
    assert out.shape == (0, HQ, D)


@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_non_contiguous_inputs(backend):
    base = torch.randn(B, HQ, SQ, 3 * D)
    q = base[..., 1:1 + D].transpose(1, 2)                # [B, SQ, HQ, D] with odd strides
    k = torch.randn(SK, B, HKV, D).transpose(0, 1)        # batch stride smaller than sequence stride
    v = torch.randn(B, SK, HKV, 2 * D)[..., ::2]          # last-dim stride 2: copied, still correct
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    got = flashport.attention(q, k, v, causal=True, backend=backend)
    want = flashport.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_env_var_is_read_at_each_call(monkeypatch):
    monkeypatch.setenv("FLASHPORT_BACKEND", "no-such")
    with pytest.raises(UnsupportedError):
        attn()
    monkeypatch.setenv("FLASHPORT_BACKEND", "reference")
    assert torch.isfinite(attn()).all()


@pytest.mark.parametrize("backend", ["reference", "blockwise"])
def test_gradients_only_for_q_k_v(backend):
    # DESIGN: "gradients for q, k, v (and none for the rest)": ALiBi slopes that happen to require
    # grad (e.g. a learnable parameter) must not receive one.
    t = {n: x.requires_grad_() for n, x in qkv().items()}
    slopes = torch.rand(B, HQ, requires_grad=True)
    flashport.attention(**t, alibi_slopes=slopes, causal=True, backend=backend).sum().backward()
    assert all(x.grad is not None for x in t.values())
    assert slopes.grad is None


def test_numpy_integers_are_ints():
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    want = varlen(mq=3, mk=4, window_size=(2, 0), backend="reference")
    torch.manual_seed(0)
    got = varlen(mq=np.int64(3), mk=np.int32(4), window_size=(np.int64(2), 0), backend="reference")
    assert torch.equal(got, want)
    kc, vc = torch.randn(B, 8, HKV, D), torch.randn(B, 8, HKV, D)
    q = torch.randn(B, 1, HQ, D)
    want = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=3, backend="reference")
    got = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=np.int64(3), backend="reference")
    assert torch.equal(got, want)


@pytest.mark.usefixtures("without_sdpa_cpu")   # the refusal is blockwise's; sdpa-cpu would serve the call
def test_auto_refusal_lists_every_backend(monkeypatch):
    from flashport import dispatch
    monkeypatch.delenv("FLASHPORT_BACKEND", raising=False)
    monkeypatch.setattr(dispatch._REGISTRY["blockwise"], "supports", lambda spec, role=None: ["pretend reason"])
    with pytest.raises(UnsupportedError) as info:
        attn()
    for name in dispatch._REGISTRY:  # those skipped by the auto policy too, each with why
        assert f"- {name}:" in str(info.value), name
    assert "pretend reason" in str(info.value)

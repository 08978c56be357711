"""Backend `sdpa-cpu` (PyTorch's CPU flash kernel through its aten ops) under the tolerance rule, forward, lse and
backward, including flashport's bottom-right causal rule where it differs from the kernel's top-left one; what
it refuses and why; that auto picks it on CPU only where it serves; that it mixes with blockwise through
(out, lse); that SDPA's hook never calls it; and the fuzzer on it."""
import pytest
import torch

import flashport
from conformance import Case, check_dense
from flashport import dispatch, mods
from flashport.spec import dense_spec

NAME = "sdpa-cpu"

SERVED = [
    Case(),                                                            # GQA 4/2, Sq == Sk
    Case(b=1, sq=1, sk=1, hq=1, hkv=1, d=16),
    Case(b=1, sq=3, sk=113, hq=2, hkv=1, d=40, causal=True),           # Sq < Sk: two parts merged by lse
    Case(b=2, sq=113, sk=3, hq=2, hkv=2, d=80, causal=True),           # Sq > Sk: rows that see no key
    Case(b=1, sq=127, sk=257, hq=4, hkv=1, d=64),                      # MQA, non-causal Sq != Sk
    Case(b=2, sq=17, sk=33, hq=4, hkv=2, d=48, noncontig=True, causal=True),
    Case(b=1, sq=29, sk=29, hq=2, hkv=2, d=96, scale=0.15, causal=True),
    # windows: row bands of BAND_M with an additive mask (a 1-row band below), rows and keys nobody sees included
    Case(b=2, sq=40, sk=40, hq=4, hkv=2, d=32, window=(5, 0)),
    Case(b=1, sq=37, sk=70, hq=2, hkv=1, d=16, window=(3, 2)),
    Case(b=1, sq=70, sk=21, hq=2, hkv=2, d=16, window=(4, 1)),         # Sq > Sk: rows that see no key
    Case(b=1, sq=33, sk=33, hq=2, hkv=2, d=16, window=(-1, 6)),        # right bound only
    # ALiBi (float32 / float64 inputs): the bias in the same bands' masks
    Case(b=2, sq=30, sk=45, hq=4, hkv=2, d=16, alibi="batch_head", causal=True),
    Case(b=1, sq=50, sk=20, hq=2, hkv=1, d=16, alibi="head", window=(6, 2)),
]


@pytest.mark.parametrize("case", SERVED, ids=str)
def test_served_cases_fp32(case):
    check_dense(NAME, case)                      # return_lse=True with grads: the lse gradient path too


@pytest.mark.parametrize("case", SERVED[2:4], ids=str)
def test_float64_stays_float64(case):
    # The rule's math path is the reference itself in float64, so the bound is bare noise; ask for fp64 accuracy
    # instead (a float32 step anywhere, e.g. in the merge of the Sq < Sk parts, would give ~1e-7).
    q, k, v = (torch.randn(1, s, h, case.d, dtype=torch.float64, requires_grad=True)
               for s, h in ((case.sq, case.hq), (case.sk, case.hkv), (case.sk, case.hkv)))
    got = flashport.attention(q, k, v, causal=True, backend=NAME)
    want = flashport.attention(q, k, v, causal=True, backend="reference")
    assert (got - want).abs().max() < 1e-12
    g = torch.autograd.grad(got, (q, k, v), torch.ones_like(got))
    w = torch.autograd.grad(want, (q, k, v), torch.ones_like(got))
    assert max((a - b).abs().max() for a, b in zip(g, w)) < 1e-11


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [SERVED[0], SERVED[2], SERVED[3]], ids=str)
def test_served_cases_low_precision(case, dtype):
    check_dense(NAME, case.replace(dtype=dtype))


def _spec(**kw):
    dt = kw.pop("dtype", torch.float32)
    q, k, v = (torch.randn(1, 8, 2, d, dtype=dt) for d in (16, 16, kw.pop("dv", 16)))
    args = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, deterministic=False, return_lse=False)
    args.update(kw)
    return dense_spec(q, k, v, **args)[0]


@pytest.mark.parametrize("kw,why", [(dict(softcap=5.0), "softcap"),
                                    (dict(dropout_p=0.1), "dropout"),
                                    (dict(dv=8), "Dv != D"), (dict(softmax_scale=-0.2), "softmax_scale")])
def test_refusals_say_why_and_auto_goes_to_blockwise(kw, why):
    spec = _spec(**kw)
    assert any(why in r for r in dispatch.get(NAME).supports(spec))
    assert dispatch.select(spec).fwd.name == "blockwise"


def test_auto_picks_it_on_cpu_for_what_it_serves():
    assert dispatch.select(_spec()).name == NAME
    assert dispatch.select(_spec(causal=True, return_lse=True)).name == NAME
    assert dispatch.get(NAME).caps.sdpa_flash_devices == ("cpu",)
    assert NAME in [b.name for b in flashport.backends() if b.available]


def test_peaked_softmax_backward_goes_to_blockwise():
    # softmax_scale 1.6 / sqrt(D): the kernel's forward is served, its gradients would break the rule
    spec = _spec(softmax_scale=0.4, causal=True)
    assert dispatch.get(NAME).supports(spec) == []
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    spec = dense_spec(q, k, v, causal=True, softmax_scale=0.4, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      dropout_p=0.0, deterministic=False, return_lse=False)[0]
    assert dispatch.select(spec).name == f"{NAME}/blockwise"
    check_dense(None, Case(b=1, sq=29, sk=29, hq=2, hkv=2, d=96, scale=0.37, causal=True))


@pytest.mark.parametrize("plan", [f"blockwise/{NAME}", f"{NAME}/blockwise"])
def test_mixes_with_blockwise_through_out_and_lse(plan):
    check_dense(plan, Case(b=1, sq=5, sk=23, hq=4, hkv=2, d=32, causal=True))


def test_deterministic_backward_is_bitwise():
    q, k, v = (torch.randn(2, 300, h, 32, requires_grad=True) for h in (4, 2, 2))
    runs = []
    for _ in range(3):
        out = flashport.attention(q, k, v, causal=True, deterministic=True, backend=NAME)
        runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))


def test_fuzzer_hits_it_hundreds_of_times():
    from flashport.fuzz import run_fuzz
    results, summary = run_fuzz(n=3000, seed=14, device="cpu", size="small", backend=NAME, entries=("attention",),
                                dtypes=("float32", "float16", "bfloat16"), verbose=False, workers=1,
                                out=lambda *a: None)
    bad = [(r["index"], r["note"], r["worst"]) for r in results if r["status"] not in ("PASS", "SKIP")]
    assert not bad, bad
    served = summary["by_variant"].get(f"backend:{NAME}", {}).get("cases", 0)
    assert served >= 300, summary["status"]


# ----------------------------------------------------------------------------- varlen: one kernel call per sequence
@pytest.mark.parametrize("lens_q,lens_k,causal", [
    ([5, 17, 3], [5, 17, 3], False),
    ([0, 1, 9, 0, 20], [4, 1, 0, 0, 33], True),        # zero-length sequences, length 1, no keys
    ([7, 30, 2], [19, 11, 40], True),                  # Sq < Sk (merged parts) and Sq > Sk (rows without keys)
], ids=str)
def test_varlen_matches_per_sequence_dense_with_gradients(lens_q, lens_k, causal):
    from test_varlen import packed, per_sequence, run_varlen
    q, k, v = packed(lens_q, lens_k, hq=4, hkv=2, pad_q=3, pad_k=5, seed=2)
    tq, tk = sum(lens_q), sum(lens_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dispatch.clear_cache()
    out, lse = run_varlen(NAME, *leaves, lens_q, lens_k, causal=causal)
    ref_leaves = [t[:n].double().requires_grad_() for t, n in zip((q, k, v), (tq, tk, tk))]
    ref, ref_lse = per_sequence(*ref_leaves, lens_q, lens_k, causal=causal)
    torch.testing.assert_close(out[:tq], ref.float(), rtol=1e-4, atol=1e-5)
    assert torch.equal(out[tq:], torch.zeros_like(out[tq:])) and torch.isneginf(lse[:, tq:]).all()
    assert torch.equal(torch.isneginf(lse[:, :tq]), torch.isneginf(ref_lse))
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    got = torch.autograd.grad(out, leaves, do)
    want = torch.autograd.grad(ref, ref_leaves, do[:tq].double())
    for g, w, n in zip(got, want, (tq, tk, tk)):
        torch.testing.assert_close(g[:n], w.float(), rtol=1e-4, atol=1e-5)
        assert not g[n:].any(), "padding must get zero gradient"


def test_auto_takes_it_for_varlen_on_cpu():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    from flashport.spec import varlen_spec
    spec = varlen_spec(q, q, q, cu, cu, 6, 6, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]
    assert dispatch.select(spec).name == NAME


@pytest.mark.parametrize("band,split_min", [(8, 512), (256, 512), (8, 2), (16, 4)])
def test_windows_in_several_bands(band, split_min, monkeypatch):
    """The banded path at a band height that splits the rows (8) and one that does not (256), each band in one masked
    part or (small split_min) in masked edges around an unmasked middle merged by lse."""
    from flashport.backend import sdpa_cpu_bands
    monkeypatch.setattr(sdpa_cpu_bands, "BAND_M", band)
    monkeypatch.setattr(sdpa_cpu_bands, "SPLIT_MIN", split_min)
    for case in SERVED[-6:]:
        check_dense(NAME, case)


# ----------------------------------------------------------------------------- KV cache: one kernel call per sequence
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("sq,window", [(1, (-1, -1)), (5, (-1, 0)), (6, (3, 0))], ids=["decode", "causal", "window"])
def test_kvcache_matches_reference_per_sequence(paged, sq, window):
    """Ragged valid lengths (0 keys, fewer keys than queries under causal: rows that see nothing, a full cache),
    dense or paged (pages in shuffled order), bottom-right aligned to each sequence's own length."""
    g = torch.Generator().manual_seed(3)
    lens, cap, page, hq, hkv, d = [0, 3, 17, 32], 32, 8, 4, 2, 16
    q = torch.randn(len(lens), sq, hq, d, generator=g)
    if paged:
        kc, vc = (torch.randn(len(lens) * cap // page, page, hkv, d, generator=g) for _ in range(2))
        table = torch.randperm(kc.shape[0], generator=g).reshape(len(lens), -1).to(torch.int32)
    else:
        kc, vc = (torch.randn(len(lens), cap, hkv, d, generator=g) for _ in range(2))
        table = None
    seqlens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(cache_seqlens=seqlens, block_table=table, window_size=window, return_lse=True)
    flashport.reset_stats()
    out, lse = flashport.attention_with_kvcache(q, kc, vc, **kw)          # backend=None on a CPU
    assert [n for n, s in flashport.stats().items() if s["calls"]] == [NAME]
    ref, ref_lse = flashport.attention_with_kvcache(q.double(), kc.double(), vc.double(), backend="reference", **kw)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    torch.testing.assert_close(lse[~torch.isneginf(lse)], ref_lse[~torch.isneginf(ref_lse)].float(), rtol=1e-5, atol=1e-5)
    assert not out[0].any()   # no valid key: zeros


# ----------------------------------------------------------------------------- mask_mod, block masks, attn_bias
def _mask_cases(b, s, h):
    g = torch.Generator().manual_seed(5)
    docs = torch.randint(0, 4, (b, s), generator=g).sort(-1).values
    return {
        "document": dict(mask_mod=mods.document(docs)),
        "prefix_lm": dict(mask_mod=mods.prefix_lm(9)),
        "window_sinks": dict(mask_mod=mods.sliding_window(6, sinks=2)),
        "per_head_rows_without_keys": dict(mask_mod=lambda b, h, i, j: (i % (h + 2) != 0) & (j <= i)),
        "block_sparse": dict(block_mask=flashport.create_block_mask(mods.block_sparse(s // 8, s // 8, 8, seed=1),
                                                                   None, None, s, s, block_size=8)),
        "window_and_mask": dict(mask_mod=mods.document(docs, causal=False), window_size=(7, 3)),
        "attn_bias": dict(attn_bias=torch.randn(h, s, s, generator=g)),
        "attn_bias_key_only": dict(attn_bias=torch.randn(s, generator=g), causal=True),
        "attn_bias_batch_rows": dict(attn_bias=torch.randn(b, 1, s, 1, generator=g), window_size=(5, 5)),
    }


@pytest.mark.parametrize("name", list(_mask_cases(2, 40, 4)))
def test_masks_and_bias_in_bands_match_reference(name, monkeypatch):
    """Bands of 8 rows (BAND_M shrunk) so that keys are trimmed per band and rows that see nothing fall inside
    bands; out, lse and the gradients (attn_bias calls: inference, the kernel's backward gives no bias gradient)."""
    from flashport.backend import sdpa_cpu_bands
    monkeypatch.setattr(sdpa_cpu_bands, "BAND_M", 8)
    kw = _mask_cases(2, 40, 4)[name]
    g = torch.Generator().manual_seed(6)
    q64, k64, v64 = (torch.randn(2, 40, 4, 16, dtype=torch.float64, generator=g) for _ in range(3))
    grads = "attn_bias" not in kw
    q, k, v = (t.float().requires_grad_(grads) for t in (q64, k64, v64))
    ref_in = [t.requires_grad_(grads) for t in (q64, k64, v64)]
    flashport.reset_stats()
    out, lse = flashport.attention(q, k, v, return_lse=True, **kw)
    assert [n for n, s in flashport.stats().items() if s["calls"]] == [NAME]
    ref_kw = {key: (x.double() if isinstance(x, torch.Tensor) else x) for key, x in kw.items()}
    ref, ref_lse = flashport.attention(*ref_in, return_lse=True, backend="reference", **ref_kw)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    seen = ~torch.isneginf(ref_lse)
    torch.testing.assert_close(lse[seen], ref_lse[seen].float(), rtol=1e-5, atol=1e-5)
    if grads:
        do = torch.randn(out.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), do.float()), torch.autograd.grad(ref, ref_in, do)):
            torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-5)


def test_what_the_kernel_cannot_take_goes_elsewhere_with_the_reason():
    q = torch.randn(1, 16, 2, 8, requires_grad=True)
    with pytest.raises(flashport.UnsupportedError, match="attn_bias in a call that needs grads"):
        flashport.attention(q, q, q, attn_bias=torch.zeros(16, 16), backend=NAME)
    flashport.reset_stats()
    flashport.attention(q, q, q, attn_bias=torch.zeros(16, 16, requires_grad=True)).sum().backward()
    assert [n for n, s in flashport.stats().items() if s["calls"]] == ["blockwise"]


def test_mods_fuzzer_hits_it_hundreds_of_times():
    from flashport.fuzz import mods as fuzz_mods
    results = [fuzz_mods.run(fuzz_mods.draw(11, i), NAME, "cpu") for i in range(3000)]
    fails = [(i, r["problems"]) for i, r in enumerate(results) if r["status"] == "FAIL"]
    assert not fails, fails[:5]
    assert sum(r["status"] == "PASS" for r in results) >= 100   # mask_mod / block masks / inference attn_bias


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("extra", ["alibi", "attn_bias", "window"])
def test_half_precision_runs_in_float32_where_it_must_or_should(dtype, extra):
    """float16 on float32 copies (no native float16 on this CPU), bf16 too with a bias (a float32 mask), the results
    rounded once: as close to a float64 reference as the inputs' dtype allows (one rounding of out and grads)."""
    from flashport.backend import sdpa_cpu
    assert sdpa_cpu._kernel_dtype(torch.float16, False) == (torch.float16 if sdpa_cpu._native_fp16() else torch.float32)
    assert sdpa_cpu._kernel_dtype(torch.bfloat16, False) == torch.bfloat16
    assert sdpa_cpu._kernel_dtype(torch.bfloat16, True) == torch.float32
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 300, 4, 32, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    kw = {"alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]), causal=True),
          "attn_bias": dict(attn_bias=4 * torch.randn(4, 300, 300, generator=g)), "window": dict(window_size=(40, 0))}
    kw = kw[extra]
    grads = extra != "attn_bias"
    leaves = [t.clone().requires_grad_(grads) for t in (q, k, v)]
    flashport.reset_stats()
    out, lse = flashport.attention(*leaves, return_lse=True, **kw)
    assert [n for n, s in flashport.stats().items() if s["calls"]] == [NAME] and out.dtype == dtype
    refs = [t.double().requires_grad_(grads) for t in (q, k, v)]
    ref, ref_lse = flashport.attention(*refs, return_lse=True, backend="reference",
                                       **{key: (x.double() if key == "attn_bias" else x) for key, x in kw.items()})
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    in_fp32 = sdpa_cpu._kernel_dtype(dtype, extra != "window") == torch.float32   # else bf16's own kernel
    torch.testing.assert_close(lse, ref_lse, **(dict(rtol=1e-5, atol=1e-5) if in_fp32 else dict(rtol=1e-3, atol=1e-3)))
    if grads:
        do = torch.randn(out.shape, generator=g, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(out, leaves, do.to(dtype)), torch.autograd.grad(ref, refs, do)):
            torch.testing.assert_close(a.double(), b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal,hkv", [(False, 4), (True, 4), (True, 2)], ids=["dense", "causal", "causal-gqa"])
def test_native_autograd_path_gives_the_general_paths_gradients(dtype, causal, hkv, monkeypatch):
    # The common training call runs the aten op under PyTorch's own derivative formula (SdpaCpuBackend.run): the
    # same kernels as the Python autograd node's, so bitwise the same results, and its backward is still counted.
    from flashport.backend import sdpa_cpu
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 24, 4, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 24, hkv, 16, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(2, 24, 4, 16, generator=g).to(dtype)

    def run():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashport.attention(*x, causal=causal, backend=NAME)
        out.backward(do)
        return out.detach(), *(t.grad for t in x)

    flashport.reset_stats()
    native = run()
    row = flashport.stats()[NAME]
    assert row["forward"] == 1 and row["backward"] == 1 and row["flops"] > 0
    asked = []
    real = sdpa_cpu._native_autograd
    monkeypatch.setattr(sdpa_cpu, "_native_autograd", lambda spec, inputs: asked.append(real(spec, inputs)) or False)
    general = run()
    assert asked == [True]   # the call was one the native path serves
    for a, b in zip(native, general):
        assert torch.equal(a, b)


def test_native_autograd_path_is_not_taken_where_it_would_differ():
    from flashport.backend import sdpa_cpu
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    k = torch.randn(1, 12, 2, 16, requires_grad=True)

    def native(**kw):
        spec, inputs = dense_spec(q, k, k, **{**dict(causal=False, softmax_scale=None, window_size=(-1, -1),
                                                    softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                                                    deterministic=False, return_lse=False), **kw})
        return sdpa_cpu._native_autograd(spec, inputs)

    assert native()
    assert not native(causal=True)            # Sq < Sk: bottom-right, two kernel calls merged
    assert not native(return_lse=True)        # the op's lse has no gradient
    assert not native(window_size=(3, 0))     # bands
    assert not native(alibi_slopes=torch.ones(2))
    with torch.autograd.profiler.profile():   # the general path brackets the backward in its range
        assert not native()

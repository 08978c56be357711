"""Hardening (CPU tier): inputs at the edges of their ranges and broken environments must give a right
answer or a clean error, never a wrong answer, NaN, a hang or a traceback.

- window bounds near 2**63 (index arithmetic wrapped around), softmax_scale / softcap outside float32's
  safe range (NaN), max_seqlen far past the packed total (launch grids), aliased KV caches (corruption);
- backend="" (was "auto"), a malformed tuning table, CLI typos, concurrent JSON writers, Triton versions
  and a Triton without the private launcher API.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import random
import sys
import threading
import warnings

import pytest
import torch

import flashport
from flashport.overlap import overlaps
from flashport.spec import dense_spec, varlen_spec

BIG = 2 ** 63 - 1
BACKENDS = ["reference", "blockwise"]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    from flashport.backend import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_M", 4)
    monkeypatch.setattr(blockwise, "BLOCK_N", 8)


def _qkv(b=2, sq=9, sk=13, hq=4, hkv=2, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def _opts(**kw):
    base = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, deterministic=False, return_lse=False)
    return {**base, **kw}


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


# ----------------------------------------------------------------------------- 1. huge window bounds
@pytest.mark.parametrize("backend", BACKENDS)
def test_window_near_2_63_is_unbounded(backend):
    q, k, v = _qkv()
    want, want_lse = flashport.attention(q, k, v, return_lse=True, backend=backend)
    got, got_lse = flashport.attention(q, k, v, window_size=(BIG, BIG), return_lse=True, backend=backend)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [(2 ** 62, 0), (BIG, 0)])
def test_huge_left_bound_with_right_zero_is_causal(backend, window):
    q, k, v = _qkv()
    want = flashport.attention(q, k, v, causal=True, backend=backend)
    assert torch.equal(flashport.attention(q, k, v, window_size=window, backend=backend), want)
    assert torch.equal(flashport.attention(q, k, v, causal=True, window_size=window, backend=backend), want)


def test_window_bounds_fold_to_minus_one_from_the_longest_distance():
    q, k, v = _qkv(sq=9, sk=13)
    span = 9 + 13
    spec = dense_spec(q, k, v, **_opts(window_size=(span, span)))[0]
    assert (spec.window_left, spec.window_right) == (-1, -1) and not spec.is_local
    spec = dense_spec(q, k, v, **_opts(window_size=(span - 1, 3)))[0]
    assert (spec.window_left, spec.window_right) == (span - 1, 3)   # below the span: kept as given
    spec = dense_spec(q, k, v, **_opts(causal=True, window_size=(BIG, -1)))[0]
    assert (spec.window_left, spec.window_right) == (-1, 0) and spec.causal


def test_kept_bounds_below_the_span_already_see_every_key():
    """The fold is exact: the largest bounds still kept (just below Sq + Sk) hide nothing either."""
    q, k, v = _qkv(sq=9, sk=13)
    want = flashport.attention(q, k, v, backend="reference")
    assert torch.equal(flashport.attention(q, k, v, window_size=(21, 21), backend="reference"), want)


def test_causal_contradiction_is_checked_on_the_raw_value():
    q, k, v = _qkv()
    for right in (BIG, 2 ** 62, 5):
        with pytest.raises(ValueError, match="causal"):
            flashport.attention(q, k, v, causal=True, window_size=(-1, right), backend="reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_window_varlen_and_kvcache(backend):
    lens_q, lens_k = [5, 0, 9], [7, 3, 12]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(n), 2, 16, generator=g) for n in (lens_q, lens_k, lens_k))
    args = (q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
    for window, kw in (((BIG, 0), dict(causal=True)), ((BIG, BIG), dict())):
        want = flashport.attention_varlen(*args, backend=backend, **kw)
        assert torch.equal(flashport.attention_varlen(*args, window_size=window, backend=backend), want)
    kc, vc = torch.randn(2, 20, 2, 16, generator=g), torch.randn(2, 20, 2, 16, generator=g)
    qd = torch.randn(2, 3, 2, 16, generator=g)
    lens = torch.tensor([4, 17], dtype=torch.int32)
    for window, kw in (((BIG, 0), dict(causal=True)), ((BIG, BIG), dict())):
        want = flashport.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens, backend=backend, **kw)
        got = flashport.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens, window_size=window, backend=backend)
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------- 2. scale and softcap range
@pytest.mark.parametrize("kw, name", [(dict(softmax_scale=1e-320), "softmax_scale"),
                                      (dict(softmax_scale=1e38), "softmax_scale"),
                                      (dict(softmax_scale=-1e38), "softmax_scale"),
                                      (dict(softcap=1e300), "softcap"), (dict(softcap=1e-50), "softcap")])
def test_scale_and_softcap_outside_the_float32_range_raise(kw, name):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"{name}.*2\*\*-60, 2\*\*60"):
        flashport.attention(q, k, v, backend="reference", **kw)
    with pytest.raises(ValueError, match=name):
        flashport.attention_with_kvcache(q, k, v, backend="reference", **kw)


@pytest.mark.parametrize("kw", [dict(softmax_scale=2.0 ** -60), dict(softmax_scale=-(2.0 ** -60)),
                                dict(softmax_scale=2.0 ** 60), dict(softmax_scale=-(2.0 ** 60)),
                                dict(softmax_scale=0.0), dict(softmax_scale=-0.0),
                                dict(softcap=2.0 ** -60), dict(softcap=2.0 ** 60),
                                dict(softmax_scale=2.0 ** 60, softcap=2.0 ** -60),
                                dict(softmax_scale=2.0 ** -60, softcap=2.0 ** 60),
                                dict(softmax_scale=-(2.0 ** 60), softcap=2.0 ** 60)])
def test_boundary_scale_and_softcap_are_accepted_and_finite(kw):
    # |q.k| < 4 keeps float32's tanh off its saturation (where fp32 ties what fp64 still orders, and a
    # 2**60 scale turns that rounding into a different argmax): the comparison measures the backend.
    q, k, v = (0.25 * t for t in _qkv())
    ref, ref_lse = flashport.attention(q, k, v, return_lse=True, backend="reference", **kw)
    got, lse = flashport.attention(q, k, v, return_lse=True, backend="blockwise", **kw)
    assert torch.isfinite(got).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- 3. huge max_seqlen
@pytest.mark.parametrize("backend", BACKENDS)
def test_max_seqlen_far_beyond_the_total_is_clamped(backend):
    lens_q, lens_k = [5, 11, 0], [8, 3, 6]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens_q) + 2, 4, 16, generator=g)     # 2 padding rows past cu_seqlens_q[-1]
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=g) for _ in range(2))
    cq, ck = _cu(lens_q), _cu(lens_k)
    spec = varlen_spec(q, k, v, cq, ck, 2 ** 40, 2 ** 40, **_opts())[0]
    assert (spec.seqlen_q, spec.seqlen_k) == (q.shape[0], k.shape[0])
    for kw in (dict(), dict(causal=True, window_size=(4, 0))):
        want = flashport.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), backend=backend, **kw)
        got = flashport.attention_varlen(q, k, v, cq, ck, 2 ** 40, 2 ** 40, backend=backend, **kw)
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------- 4. aliased caches
def _brute_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    def addresses(t):
        if t.numel() == 0:
            return set()
        n = t.untyped_storage().nbytes() // t.element_size()
        idx = torch.arange(n).as_strided(t.shape, t.stride(), t.storage_offset())
        base = t.untyped_storage().data_ptr()
        return {base + e * t.element_size() + byte for e in idx.flatten().tolist() for byte in range(t.element_size())}
    return bool(addresses(a) & addresses(b))


def test_overlap_is_exact_on_random_strided_views():
    rng = random.Random(0)
    buf = torch.empty(512)
    checked = 0
    while checked < 400:
        views = []
        for _ in range(2):
            nd = rng.randint(1, 4)
            shape = [rng.randint(1, 4) for _ in range(nd)]
            stride = [rng.choice([0, 1, 2, 3, 5, 8, 12, 16, 24, 40]) for _ in range(nd)]
            off = rng.randint(0, 40)
            if off + sum((n - 1) * s for n, s in zip(shape, stride)) < buf.numel():
                views.append(buf.as_strided(shape, stride, off))
        if len(views) == 2:
            assert overlaps(*views) == _brute_overlap(*views), [(v.shape, v.stride(), v.storage_offset())
                                                                for v in views]
            checked += 1


def test_overlap_layouts():
    kv = torch.empty(3, 7, 2, 4, 16)
    assert not overlaps(kv[:, :, 0], kv[:, :, 1])            # interleaved: one storage, no shared element
    assert overlaps(kv[:, :, 0], kv[:, :, 0]) and overlaps(kv[:, 2:3, 0], kv[:, :, 0])
    assert not overlaps(torch.empty(4, 5), torch.empty(4, 5))
    x = torch.zeros(8)
    assert overlaps(x[:4], x.view(torch.int16)[7:8]) and not overlaps(x[:4], x.view(torch.int16)[8:9])
    assert not overlaps(x[:0], x)


def _append_args(kc, vc, kn, vn):
    b = kn.shape[0]
    q = torch.randn(b, kn.shape[1], 4, kc.shape[-1])
    return dict(q=q, k_cache=kc, v_cache=vc, k=kn, v=vn, cache_seqlens=torch.tensor([2] * b, dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_interleaved_kv_cache_is_accepted_and_right(backend):
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 10, 2, 2, 16, generator=g)
    kn, vn = torch.randn(2, 3, 2, 16, generator=g), torch.randn(2, 3, 2, 16, generator=g)
    kc_sep, vc_sep = kv[:, :, 0].clone(), kv[:, :, 1].clone()
    args = _append_args(kv[:, :, 0], kv[:, :, 1], kn, vn)
    got = flashport.attention_with_kvcache(**args, causal=True, backend=backend)
    want = flashport.attention_with_kvcache(**{**args, "k_cache": kc_sep, "v_cache": vc_sep}, causal=True,
                                            backend=backend)
    assert torch.equal(got, want)
    assert torch.equal(kv[:, :, 0], kc_sep) and torch.equal(kv[:, :, 1], vc_sep)   # each cache got its own


def test_interleaved_paged_cache_is_accepted():
    kv = torch.randn(6, 4, 2, 2, 16)
    kc_sep, vc_sep = kv[:, :, 0].clone(), kv[:, :, 1].clone()
    table = torch.tensor([[0, 2], [5, 1]], dtype=torch.int32)
    args = _append_args(kv[:, :, 0], kv[:, :, 1], torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16))
    got = flashport.attention_with_kvcache(**args, block_table=table, backend="reference")
    want = flashport.attention_with_kvcache(**{**args, "k_cache": kc_sep, "v_cache": vc_sep}, block_table=table,
                                            backend="reference")
    assert torch.equal(got, want)


def _aliased_cases():
    buf = torch.randn(2, 12, 2, 16)
    kv = torch.randn(2, 10, 2, 2, 16)
    kn = torch.randn(2, 3, 2, 16)
    return {
        "same tensor": (buf[:, :10], buf[:, :10], kn, kn.clone(), "k_cache and v_cache overlap"),
        "shifted views": (buf[:, :10], buf[:, 2:], kn, kn.clone(), "k_cache and v_cache overlap"),
        "k into k_cache": (kv[:, :, 0], kv[:, :, 1], kv[:, 5:8, 0], kn, r"k \(new tokens\) overlaps k_cache"),
        "v into k_cache": (kv[:, :, 0], kv[:, :, 1], kn, kv[:, 5:8, 0], r"v \(new tokens\) overlaps k_cache"),
        "v into v_cache": (kv[:, :, 0], kv[:, :, 1], kn, kv[:, :3, 1], r"v \(new tokens\) overlaps v_cache"),
        "expanded k_cache": (buf[:1, :10].expand(2, 10, 2, 16), buf[1:, :10].clone().expand(2, 10, 2, 16).clone(),
                             kn, kn.clone(), r"k_cache is expanded \(stride 0 in dimension 0\)"),
        "expanded heads": (buf[:, :10].clone(), buf[:, :10, :1].expand(2, 10, 2, 16), kn, kn.clone(),
                           r"v_cache is expanded \(stride 0 in dimension 2\)"),
    }


@pytest.mark.parametrize("case", list(_aliased_cases()))
def test_aliased_caches_and_appends_raise(case):
    kc, vc, kn, vn, msg = _aliased_cases()[case]
    before = (kc.clone(), vc.clone())
    with pytest.raises(ValueError, match=msg):
        flashport.attention_with_kvcache(**_append_args(kc, vc, kn, vn), backend="reference")
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])   # nothing written


def test_bad_values_are_named_in_their_errors():
    """cache_seqlens below 0 names the value (it read as a capacity overflow), a NumPy bool names its type (it
    read "must be a bool, got bool"), integer outputs to merge_attention_states are a TypeError."""
    np = pytest.importorskip("numpy")
    kc, vc = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    q = torch.randn(2, 1, 4, 16)
    with pytest.raises(ValueError, match="cache_seqlens must be non-negative, got min -1"):
        flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([-1, 0], dtype=torch.int32))
    with pytest.raises(TypeError, match="causal must be a Python bool, got numpy.bool"):
        flashport.attention(q, kc, vc, causal=np.bool_(True))
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        flashport.attention(q, kc, vc, alibi_slopes=torch.tensor([0.5, float("nan"), 0.1, 0.2]))
    with pytest.raises(TypeError, match=r"outs\[0\] must be a floating tensor"):
        flashport.merge_attention_states([torch.ones(1, 2, 4, 16, dtype=torch.int64)] * 2,
                                         [torch.zeros(1, 4, 2)] * 2)


def test_one_tensor_as_both_caches_without_an_append_is_fine():
    """Only the append writes, so reading one tensor as K and V (no k/v) stays legal."""
    kc = torch.randn(2, 10, 2, 16)
    q = torch.randn(2, 1, 4, 16)
    got = flashport.attention_with_kvcache(q, kc, kc, backend="reference")
    assert torch.equal(got, flashport.attention_with_kvcache(q, kc, kc.clone(), backend="reference"))


# ----------------------------------------------------------------------------- 5. empty backend name
def test_empty_backend_name_is_unknown(monkeypatch):
    monkeypatch.delenv("FLASHPORT_BACKEND", raising=False)
    q, k, v = _qkv()
    with pytest.raises(flashport.UnsupportedError, match=r"unknown backend ''.*reference"):
        flashport.attention(q, k, v, backend="")
    with pytest.raises(flashport.UnsupportedError, match=r"unknown backend ''"):
        with flashport.use_backend(""):
            pass
    monkeypatch.setenv("FLASHPORT_BACKEND", "")
    with pytest.raises(flashport.UnsupportedError, match=r"unknown backend ''.*blockwise"):
        flashport.attention(q, k, v)
    monkeypatch.delenv("FLASHPORT_BACKEND")
    assert flashport.attention(q, k, v).shape == q.shape   # None / unset: auto


# ----------------------------------------------------------------------------- 6. malformed tuning table
def _load(tmp_path, content):
    from flashport.kernels import tuning
    path = tmp_path / "table.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = tuning._load_table(path)
    return table, [str(w.message) for w in caught], path


GOOD = dict(block_m=64, block_n=32, num_warps=4, num_stages=2)


def test_tuning_table_skips_each_bad_entry_with_one_warning(tmp_path):
    from flashport.kernels.tuning import KernelConfig
    bad = {
        "str block": {**GOOD, "block_m": "64"}, "float block": {**GOOD, "block_n": 64.0},
        "missing": {k: v for k, v in GOOD.items() if k != "num_stages"}, "not a dict": [64, 32, 4, 2],
        "zero warps": {**GOOD, "num_warps": 0}, "negative stages": {**GOOD, "num_stages": -1},
        "odd block": {**GOOD, "block_m": 48}, "tiny block": {**GOOD, "block_n": 8},
        "bool warps": {**GOOD, "num_warps": True}, "str split": {**GOOD, "split": "yes"},
        "extra field": {**GOOD, "evil": "__import__('os')"}, "null": None,
    }
    table, msgs, path = _load(tmp_path, {"entries": {"ok": {**GOOD, "split": True}, **bad}})
    assert table == {"ok": KernelConfig(64, 32, 4, 2, True)}
    assert len(msgs) == 1 and str(path) in msgs[0] and "skipped 12 invalid entries" in msgs[0]
    assert all(repr(key) in msgs[0] for key in bad) and "'ok'" not in msgs[0]


@pytest.mark.parametrize("content", ["[1, 2]", '{"entries": [1]}', '{"entries": "x"}', "not json {",
                                     "[" * 100000, b"\xff\xfe".decode("latin-1"), "null"])
def test_tuning_table_with_a_bad_shape_is_empty_and_warns(tmp_path, content):
    table, msgs, path = _load(tmp_path, content)
    assert table == {} and len(msgs) == 1 and str(path) in msgs[0]


def test_tuning_table_missing_or_valid_loads_quietly(tmp_path):
    from flashport.kernels import tuning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning._load_table(tmp_path / "absent.json") == {}
        table, msgs, _ = _load(tmp_path, {"entries": {"a": GOOD}})
    assert len(table) == 1 and msgs == []


# ----------------------------------------------------------------------------- 7. the CLI
@pytest.mark.parametrize("argv, words", [
    (["check", "--dtype", "float8"], ["--dtype", "float8", "float16", "bfloat16"]),
    (["check", "--dtype", "float32,half"], ["--dtype", "'half'", "float64"]),
    (["check", "--backend", "nope"], ["--backend", "nope", "reference", "blockwise"]),
    (["check", "--frontend", "jax", "--match", "("], ["--match", "not a regular expression"]),
    (["check", "--fuzz", "1", "--log", "/nonexistent/dir/x.jsonl"], ["--log", "/nonexistent/dir"]),
    (["bench", "--quick", "--heads", "0"], ["--heads", "must be >= 1"]),
    (["bench", "--match", "["], ["--match", "not a regular expression"]),
    (["tune", "--rounds", "0"], ["--rounds", "must be >= 1"]),
    (["check", "--backend", "reference", "--backend", ""], ["--backend", "''"]),
    (["check", "--device", "tpu"], ["--device", "tpu", "cpu"]),
    (["check", "--device", "cuda:99"], ["--device", "cuda:99", "cpu"]),
    (["bench", "--device", "bogus"], ["--device", "bogus", "cpu"]),
    (["check", "--fuzz", "-3"], ["--fuzz"]),
])
def test_cli_rejects_bad_options_in_one_line(argv, words, capsys, monkeypatch):
    from flashport import check
    from flashport.cli import main
    monkeypatch.setattr(check, "run_check", lambda *a, **k: pytest.fail("ran despite a bad option"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and all(w in last for w in words), err


def test_bench_out_is_checked_before_measuring(tmp_path, capsys, monkeypatch):
    import flashport.bench as bench
    from flashport.cli import main
    calls = []
    monkeypatch.setattr(bench, "run", lambda args: calls.append(args.out) or 0)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--quick", "--out", str(blocker / "sub")])
    assert e.value.code == 2 and calls == []
    assert "--out" in capsys.readouterr().err
    out = tmp_path / "new" / "dir"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    assert calls == [str(out)] and out.is_dir() and list(out.iterdir()) == []   # the probe file is gone


def test_check_fuzz_calls_flashport_fuzz(monkeypatch, tmp_path):
    from flashport.cli import main
    seen = {}
    fake = type(sys)("flashport.fuzz")
    fake.main = lambda **kw: seen.update(kw) or 7
    monkeypatch.setitem(sys.modules, "flashport.fuzz", fake)
    log = str(tmp_path / "fuzz.jsonl")
    argv = ["check", "--fuzz", "5", "--seed", "3", "--log", log, "--dtype", "float32,float64",
            "--backend", "blockwise", "--backend", "reference", "--device", "cpu"]
    assert main(argv) == 7
    assert seen == dict(n=5, seed=3, device="cpu", dtypes=[torch.float32, torch.float64], backend="blockwise",
                        log=log)
    seen.clear()
    assert main(["check", "--fuzz", "2"]) == 7
    assert seen == dict(n=2, seed=0, device=None, dtypes=None, backend=None, log=None)


def test_flashport_fuzz_main_takes_the_cli_keywords():
    fuzz = pytest.importorskip("flashport.fuzz")
    inspect.signature(fuzz.main).bind(n=1, seed=0, device=None, dtypes=None, backend=None, log=None)


# ----------------------------------------------------------------------------- 8. concurrent JSON writers
def test_concurrent_json_writers_do_not_collide(tmp_path):
    from flashport.bench.report import write_json
    path = str(tmp_path / "bench.json")
    errors = []
    start = threading.Barrier(8)

    def writer(n):
        start.wait()
        for i in range(25):
            try:
                write_json({"writer": n, "i": i, "pad": "x" * 20000}, path)
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(repr(e))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    doc = json.loads(open(path).read())
    assert doc["pad"] == "x" * 20000 and 0 <= doc["writer"] < 8
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]   # no temporary file left behind


# ----------------------------------------------------------------------------- 9. Triton versions, launcher
@pytest.fixture
def triton_backend():
    from flashport.backend import triton as tb
    return tb


@pytest.mark.parametrize("version", ["3.2.0", "3.7.0", "3.60.1", "4.0", "unknown"])
def test_untested_triton_is_refused_with_a_reason(triton_backend, monkeypatch, version):
    monkeypatch.setattr(triton_backend, "_triton_version", lambda: version)
    monkeypatch.delenv("FLASHPORT_ALLOW_UNTESTED_TRITON", raising=False)
    reasons = triton_backend.TritonBackend().availability()
    assert reasons == [f"triton {version} is untested (flashport's kernels are tested on 3.6.x); "
                       f"FLASHPORT_ALLOW_UNTESTED_TRITON=1 to try it"]
    info = {b.name: b for b in flashport.backends()}["triton"]
    assert not info.available and info.reasons == reasons
    q, k, v = _qkv()
    with pytest.raises(flashport.UnsupportedError, match="untested"):
        flashport.attention(q, k, v, backend="triton")
    monkeypatch.setenv("FLASHPORT_ALLOW_UNTESTED_TRITON", "1")
    assert not any("untested" in r for r in triton_backend.TritonBackend().availability())


@pytest.mark.parametrize("version", ["3.6.0", "3.6.1", "3.6.0+git1234abcd"])
def test_tested_triton_passes_the_version_gate(triton_backend, monkeypatch, version):
    monkeypatch.setattr(triton_backend, "_triton_version", lambda: version)
    assert not any("untested" in r for r in triton_backend.TritonBackend().availability())


def test_one_definition_of_the_tested_triton(triton_backend):
    pytest.importorskip("triton")
    from flashport.kernels import attn_bwd_hopper, attn_fwd_hopper, versions
    assert versions.TESTED_TRITON == ("3.6",)
    for mod in (triton_backend, attn_fwd_hopper, attn_bwd_hopper):
        assert "TESTED_TRITON" not in vars(mod) and mod.is_tested is versions.is_tested, mod.__name__


class _Kernel:
    def __init__(self, log, fields=True):
        self.log = log
        if fields:
            self.function, self.packed_metadata = "fn", ("packed",)

    def run(self, *a):
        self.log.append("direct")


class _Jit:
    arg_names = ["t", "STAGES"]

    def __init__(self, fields=True):
        self.log, self.fields = [], fields

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append("jit")
            return _Kernel(self.log, self.fields)
        return launch


def _fresh_launch_module(monkeypatch, knobs_importable: bool):
    """A private copy of flashport/kernels/launch.py imported with or without `from triton import knobs`."""
    pytest.importorskip("triton")
    import triton
    if not knobs_importable:
        monkeypatch.delattr(triton, "knobs", raising=False)
        monkeypatch.setitem(sys.modules, "triton.knobs", None)   # the import now raises ImportError
    from flashport.kernels import launch as real
    spec = importlib.util.spec_from_file_location("_launch_copy", real.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1, raising=False)
    return mod


def test_launcher_without_knobs_falls_back_to_the_jit(monkeypatch):
    mod = _fresh_launch_module(monkeypatch, knobs_importable=False)
    assert mod.knobs is None and mod.DIRECT is False
    jit = _Jit()
    direct = mod.DirectLauncher(jit)
    t = torch.zeros(16)
    for _ in range(3):
        direct((1,), (t,), dict(STAGES=2))   # no NameError: the plain kernel[grid](...) launch each time
    assert jit.log == ["jit", "jit", "jit"]


def test_launcher_with_a_kernel_lacking_private_fields_stays_on_the_jit(monkeypatch):
    mod = _fresh_launch_module(monkeypatch, knobs_importable=True)
    assert mod.DIRECT is True
    jit = _Jit(fields=False)
    direct = mod.DirectLauncher(jit)
    t = torch.zeros(16)
    for _ in range(3):
        direct((1,), (t,), dict(STAGES=2))
    assert jit.log == ["jit", "jit", "jit"]
    jit = _Jit()
    direct = mod.DirectLauncher(jit)
    for _ in range(3):
        direct((1,), (t,), dict(STAGES=2))
    assert jit.log == ["jit", "direct", "direct"]

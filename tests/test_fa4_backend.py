"""The optional `fa4` backend (issue [14]) on the CPU: unavailable with the reason when flash-attn-4 is absent,
its declared capabilities, auto never taking it by static priority, and its argument mapping -- layout,
bottom-right windows, softcap, scale, lse, varlen tails -- through a stand-in `flash_attn.cute` that follows FA4's
own conventions (read from its interface.py) with flashport's reference math."""
import dataclasses
import sys
import types

import pytest
import torch

import flashport
from flashport import capabilities, dispatch, table
from flashport.backend import fa4
from flashport.backend.reference import materialized_attention
from flashport.spec import dense_spec, kvcache_spec

KW = dict(softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
          deterministic=False, return_lse=False)
TILE = 4   # rows the stand-in reads past each sequence's end, as FA4's tile loads do


def _rnd(g, *shape, dtype=torch.float16, grad=False):
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)


# ----------------------------------------------------------------------------- a stand-in for flash_attn.cute
def _fa4_window(causal, window):
    """FA4's _resolve_causal_local_window, then flashport's (-1 unbounded).  FA4 drops negative bounds only when
    both are negative: a lone negative bound would be a real (empty-making) bound there, so it is an error here."""
    left, right = window
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    assert (left is None or left >= 0) and (right is None or right >= 0), f"FA4 reads {window} as real bounds"
    return -1 if left is None else left, -1 if right is None else right


def _check_layout(q, k, v):
    assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype
    assert q.shape[-1] == k.shape[-1] and k.shape[:-1] == v.shape[:-1] and q.shape[-2] % k.shape[-2] == 0


def _overshoot(x, end):
    """0 * the rows a tile reads past a sequence ending at `end`: NaN there comes through, as on the GPU."""
    return 0.0 * x[end:end + TILE].float().sum()


def _segments(cu_q, cu_k, n):
    if cu_q is None:
        return [(slice(b, b + 1), slice(b, b + 1), None, None) for b in range(n)]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]), cq[i + 1], ck[i + 1]) for i in range(len(cq) - 1)]


def _math(q, k, v, scale, softcap, causal, window, packed):
    q, k, v = (t[None] if packed else t for t in (q, k, v))
    left, right = _fa4_window(causal, window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, lse = materialized_attention(q, k, v, scale=scale, softcap=softcap, left=left, right=right,
                                    compute_dtype=torch.float32)
    return (o[0], lse[0]) if packed else (o, lse)


def _make_fake(calls):
    def forward(q, k, v, cu_q, cu_k, softmax_scale, causal, window_size, softcap, return_lse):
        _check_layout(q, k, v)
        packed = cu_q is not None
        out = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=q.dtype)   # FA4: torch.empty
        lse = torch.full((q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1]), float("nan"))
        for sq, sk, q_end, k_end in _segments(cu_q, cu_k, q.shape[0]):
            o, l = _math(q[sq], k[sk], v[sk], softmax_scale, softcap, causal, window_size, packed)
            if packed:
                o = o + _overshoot(k, k_end) + _overshoot(v, k_end)
                out[sq], lse[:, sq] = o.to(q.dtype), l
            else:
                out[sq], lse[sq] = o, l
        return (out, lse) if return_lse else out

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                        deterministic=False, return_lse=False):
        assert q.dim() == 4, "FA4 dense layout is [B, S, H, D]"
        calls.append(dict(fn="fwd", softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, return_lse=return_lse))
        return forward(q, k, v, None, None, softmax_scale, causal, window_size, softcap, return_lse)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                               softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                               deterministic=False, return_lse=False):
        assert q.dim() == 3 and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
        calls.append(dict(fn="varlen", softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
        return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap, return_lse)

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, deterministic=False,
                        dlse=None):
        _check_layout(q, k, v)
        assert lse.dtype == torch.float32 and (dlse is None or dlse.shape == lse.shape)
        calls.append(dict(fn="bwd", window=(window_size_left, window_size_right), causal=causal,
                          deterministic=deterministic, dlse=dlse is not None))
        packed = cu_seqlens_q is not None
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))        # FA4: torch.empty
        if not packed:
            dk.zero_(), dv.zero_()
        for sq, sk, q_end, k_end in _segments(cu_seqlens_q, cu_seqlens_k, q.shape[0]):
            with torch.enable_grad():   # the backend calls FA4 under no_grad; the stand-in recomputes by autograd
                leaves = [t[s].detach().float().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk))]
                o, l = _math(*leaves, softmax_scale, softcap, causal, (window_size_left, window_size_right), packed)
                dl = torch.zeros_like(l) if dlse is None else (dlse[:, sq] if packed else dlse[sq])
                g = torch.autograd.grad((o, l), leaves, (dout[sq].float(), dl))
            if packed:
                dk[sk], dv[sk] = 0, 0   # FA4 accumulates over sequences sharing no keys: overwrite is fine
                poison = _overshoot(q, q_end) + _overshoot(dout, q_end) + _overshoot(k, k_end) + _overshoot(v, k_end)
                g = [x + poison for x in g]
            dq[sq], dk[sk], dv[sk] = (x.to(q.dtype) for x in g)
        return dq, dk, dv

    interface = types.ModuleType("flash_attn.cute.interface")
    interface.flash_attn_func, interface.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    interface._flash_attn_bwd = _flash_attn_bwd
    cute = types.ModuleType("flash_attn.cute")
    cute.interface, cute.__version__ = interface, "4.0.0-fake"
    cute.flash_attn_func, cute.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    pkg = types.ModuleType("flash_attn")
    pkg.cute = cute
    return {"flash_attn": pkg, "flash_attn.cute": cute, "flash_attn.cute.interface": interface}


@pytest.fixture
def fake_fa4(monkeypatch):
    """flash_attn.cute is the stand-in, and the device gate is open on the CPU: -> the list of FA4 calls made."""
    calls = []
    for name, mod in _make_fake(calls).items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(fa4, "_device_reasons", lambda: [])
    backend = dispatch.get("fa4")
    monkeypatch.setattr(backend, "caps", dataclasses.replace(backend.caps, devices=("cuda", "cpu")))
    fa4._api.cache_clear()
    dispatch.clear_cache()
    yield calls
    fa4._api.cache_clear()


@pytest.fixture
def no_fa4(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)   # import flash_attn.cute raises ImportError
    fa4._api.cache_clear()
    yield
    fa4._api.cache_clear()


# ----------------------------------------------------------------------------- absent
@pytest.mark.usefixtures("no_fa4")
def test_listed_unavailable_with_the_reason_when_not_installed():
    info = {b.name: b for b in flashport.backends()}["fa4"]
    assert not info.available and info.reasons == ["flash-attn-4 not installed: pip install flashport[fa4]"]
    assert info.capabilities["kinds"] == ["dense", "varlen"] and info.capabilities["alibi"] is False
    assert fa4.version() is None


@pytest.mark.usefixtures("no_fa4")
def test_named_fa4_raises_with_the_reason():
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float16) for _ in range(3))
    with pytest.raises(flashport.UnsupportedError, match=r"flash-attn-4 not installed: pip install flashport\[fa4\]"):
        flashport.attention(q, k, v, backend="fa4")
    with flashport.use_backend("fa4/reference"), pytest.raises(flashport.UnsupportedError, match="not installed"):
        flashport.attention(q, k, v)


def test_import_flashport_does_not_import_flash_attn():
    import subprocess
    code = "import sys, flashport; flashport.backends(); print(any(m.startswith('flash_attn') for m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr[-2000:]


# ----------------------------------------------------------------------------- the declaration
def _spec(d=16, dv=None, hq=4, hkv=2, dtype=torch.float16, **kw):
    g = torch.Generator().manual_seed(0)
    q, k, v = _rnd(g, 2, 7, hq, d, dtype=dtype), _rnd(g, 2, 9, hkv, d, dtype=dtype), _rnd(g, 2, 9, hkv, dv or d,
                                                                                            dtype=dtype)
    return dense_spec(q, k, v, **{**KW, "causal": False, **kw})[0]


def _why(spec, role="fwd"):
    return capabilities.reasons(fa4.Fa4Backend.caps, spec, role)


def test_declared_capabilities_serve_what_fa4_serves():
    on_cpu = ["device 'cpu' (serves cuda)"]   # all that stands between these calls and FA4 on a CPU
    assert _why(_spec(d=128, causal=True, softcap=30.0, return_lse=True)) == on_cpu
    assert _why(_spec(d=64, hq=8, hkv=1, window_size=(5, 3), dtype=torch.bfloat16)) == on_cpu
    assert _why(_spec(d=256, window_size=(7, -1)), "bwd") == on_cpu
    caps = fa4.Fa4Backend.caps
    assert caps.saved_state == "lse" and caps.min_capability == (9, 0) and caps.exact
    assert set(caps.head_dims) == {16, 32, 48, 64, 96, 128, 256}


@pytest.mark.parametrize("kw,why", [   # what FA4 4.0.0b36 got wrong on an H100 (results/issue14_h100_s15)
    (dict(d=80), "head dim 80/80"),
    (dict(d=72), "head dim 72/72"),
    (dict(d=40), "head dim 40/40"),
    (dict(d=128, dv=64), "Dv != D"),
    (dict(d=64, deterministic=True), "deterministic"),
])
def test_declared_capabilities_refuse_what_failed_on_the_gpu(kw, why):
    assert any(why in r for r in _why(_spec(**kw), "bwd"))


def _own(sq, sk, **kw):
    g = torch.Generator().manual_seed(0)
    q, k = _rnd(g, 1, sq, 2, 64), _rnd(g, 1, sk, 2, 64)
    spec = dense_spec(q, k, k, **{**KW, "causal": False, **kw})[0]
    return [r for r in fa4.Fa4Backend().own_reasons(spec, "fwd") if "no key" in r or "no row" in r]


def test_rows_without_keys_and_keys_without_rows_are_refused():
    assert _own(64, 64, causal=True) == [] and _own(32, 64, causal=True) == [] and _own(64, 64) == []
    assert _own(64, 64, window_size=(8, 0)) == [] and _own(40, 32) == []
    assert "a row that sees no key" in _own(65, 64, causal=True)[0]            # bottom-right: row 0 sees nothing
    assert "a row that sees no key" in _own(96, 16, window_size=(0, 0))[0]
    assert "a key that no row sees" in _own(16, 96, causal=True, window_size=(1, 0))[0]


def test_a_scale_that_is_not_positive_is_refused():   # the H200 fuzz's case 202 (results/issue14_h200_s16)
    assert fa4.Fa4Backend().own_reasons(_spec(d=96, softmax_scale=0.3), "fwd") == []
    for scale in (-0.112, 0.0):
        assert any("softmax_scale <= 0" in r for r in fa4.Fa4Backend().own_reasons(_spec(d=96, softmax_scale=scale),
                                                                                   "fwd"))


@pytest.mark.parametrize("kw,why", [
    (dict(alibi_slopes=torch.rand(4)), "ALiBi"),
    (dict(dropout_p=0.1), "dropout"),
    (dict(dtype=torch.float32), "dtype float32"),
    (dict(d=12), "head dim 12/12"),
    (dict(d=264), "head dim"),
])
def test_declared_capabilities_refuse_what_fa4_lacks(kw, why):
    assert any(why in r for r in _why(_spec(**kw)))


def test_kvcache_calls_are_left_to_flashports_kernels():
    g = torch.Generator().manual_seed(0)
    q, kc, vc = _rnd(g, 2, 1, 4, 64), _rnd(g, 2, 32, 2, 64), _rnd(g, 2, 32, 2, 64)
    spec = kvcache_spec(q, kc, vc, None, None, cache_seqlens=torch.tensor([3, 9], dtype=torch.int32),
                        block_table=None, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, return_lse=False)[0]
    assert any("kvcache calls" in r for r in _why(spec))


def test_a_changed_private_backward_refuses_the_backward_only(fake_fa4, monkeypatch):
    interface = sys.modules["flash_attn.cute.interface"]
    monkeypatch.setattr(interface, "_flash_attn_bwd", lambda q, k, v, out, dout, lse: None)
    fa4._api.cache_clear()
    b = dispatch.get("fa4")
    spec = _spec(d=64)
    assert b.availability() == [] and b.own_reasons(spec, "fwd") == []
    assert any("_flash_attn_bwd lacks window_size_left" in r for r in b.own_reasons(spec, "bwd"))


# ----------------------------------------------------------------------------- selection
def test_auto_never_takes_fa4_by_static_priority(fake_fa4, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHPORT_CACHE_DIR", str(tmp_path))
    spec = _spec(d=16, causal=True)
    assert dispatch.get("fa4").supports(spec) == []                  # it could serve the call ...
    assert "fa4" not in dispatch.select(spec).name                      # ... static priority never takes it
    monkeypatch.setenv("FLASHPORT_DISABLE", "sdpa-cpu,blockwise")
    with pytest.raises(flashport.UnsupportedError, match="fa4: chosen automatically only where the selection table"):
        dispatch.select(spec)                                           # not even as the last one standing
    monkeypatch.delenv("FLASHPORT_DISABLE")
    table.save(table.user_path("cpu"), "cpu", {table.bucket(spec): {"fwd": {"fa4": 1.0, "blockwise": 2.0,
                                                                             "sdpa-cpu": 3.0}, "bwd": {}}})
    assert dispatch.select(spec).name == "fa4"                          # measured fastest: taken
    assert dispatch.select(spec, "fa4").name == "fa4"


# ----------------------------------------------------------------------------- the mapping, through the stand-in
DENSE = [
    dict(sq=5, sk=9, causal=True),
    dict(sq=9, sk=11, window_size=(3, 0)),
    dict(sq=11, sk=7, window_size=(2, -1)),               # one bound only: -1 must reach FA4 as None
    dict(sq=6, sk=10, window_size=(-1, 4)),
    dict(sq=8, sk=8, softcap=5.0, softmax_scale=0.3),
    dict(sq=3, sk=13, hq=4, hkv=1, d=32),
]


@pytest.mark.parametrize("case", DENSE, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_dense_mapping_matches_the_reference(fake_fa4, case):
    case = dict(case)
    sq, sk, hq, hkv = case.pop("sq"), case.pop("sk"), case.pop("hq", 2), case.pop("hkv", 2)
    d, dv = case.pop("d", 16), case.pop("dv", None)
    g = torch.Generator().manual_seed(1)
    base = [_rnd(g, 2, sq, hq, d), _rnd(g, 2, sk, hkv, d), _rnd(g, 2, sk, hkv, dv or d)]
    do, dl = _rnd(g, 2, sq, hq, dv or d), torch.randn(2, hq, sq, generator=g)
    res = {}
    for name in ("fa4", "reference", "fa4/reference", "reference/fa4"):
        leaves = [t.detach().clone().requires_grad_() for t in base]
        out, lse = flashport.attention(*leaves, return_lse=True, backend=name, **case)
        grads = torch.autograd.grad((out, lse), leaves, (do, torch.where(torch.isinf(lse), 0.0, dl)))
        res[name] = (out, lse, *grads)
    for name in ("fa4", "fa4/reference", "reference/fa4"):
        for got, want in zip(res[name], res["reference"]):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            torch.testing.assert_close(got.float(), want.float(), atol=4e-3, rtol=4e-3)
    fwd = next(c for c in fake_fa4 if c["fn"] == "fwd")
    causal = case.get("causal", False)
    want_window = fa4.fa4_window(_spec(**({"causal": True} if causal else {"window_size": case.get("window_size",
                                                                                                     (-1, -1))})))
    assert fwd["causal"] is False and fwd["window_size"] == want_window and fwd["return_lse"] is True
    assert fwd["softmax_scale"] == pytest.approx(case.get("softmax_scale", d ** -0.5))
    assert fwd["softcap"] == case.get("softcap", 0.0)
    bwd = [c for c in fake_fa4 if c["fn"] == "bwd"]
    assert bwd and all(c["window"] == want_window and c["dlse"] for c in bwd)
    assert all(c["deterministic"] == case.get("deterministic", False) for c in bwd)
    if causal:
        assert want_window == (None, 0)


def test_varlen_mapping_zeroes_tails_and_never_reads_past_the_last_sequence(fake_fa4):
    g = torch.Generator().manual_seed(2)
    lens_q, lens_k, tail = [5, 0, 9, 3], [7, 4, 9, 2], 6
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    tq, tk = int(cu_q[-1]) + tail, int(cu_k[-1]) + tail
    base = [_rnd(g, tq, 4, 16), _rnd(g, tk, 2, 16), _rnd(g, tk, 2, 16)]
    for t, n in zip(base, (int(cu_q[-1]), int(cu_k[-1]), int(cu_k[-1]))):
        t[n:] = float("nan")                                            # padding the contract says is never read
    do = _rnd(g, tq, 4, 16)
    do[int(cu_q[-1]):] = float("nan")
    res = {}
    for name in ("fa4", "reference"):
        leaves = [t.detach().clone().requires_grad_() for t in base]
        out, lse = flashport.attention_varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                              window_size=(4, -1), return_lse=True, backend=name)
        grads = torch.autograd.grad(out, leaves, do)
        res[name] = (out, lse, *grads)
    n = int(cu_q[-1])
    out, lse, dq, dk, dv = res["fa4"]
    assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isneginf(lse[:, n:]).all()
    assert not torch.isnan(lse).any() and all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    assert not dq[n:].any() and not dk[int(cu_k[-1]):].any() and not dv[int(cu_k[-1]):].any()
    for got, want in zip(res["fa4"], res["reference"]):
        torch.testing.assert_close(got.float(), want.float(), atol=4e-3, rtol=4e-3)
    call = next(c for c in fake_fa4 if c["fn"] == "varlen")
    assert call["window_size"] == (4, 0) and call["max_seqlen_q"] == max(lens_q) and call["max_seqlen_k"] == max(lens_k)


def test_varlen_tensors_packed_tight_go_to_fa4_uncopied_and_cu_is_read_once(fake_fa4, monkeypatch):
    """cu_seqlens[-1] == the packed rows (the usual layout): no zero-tailed copies, no masking passes, the same
    results as the reference; cu[-1] is read on the host once per cu tensor and version, not per call."""
    g = torch.Generator().manual_seed(3)
    lens = [5, 0, 9, 3]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    base = [_rnd(g, n, 4, 16), _rnd(g, n, 2, 16), _rnd(g, n, 2, 16)]
    do = _rnd(g, n, 4, 16)
    copies, reads = [], []
    real_tail = fa4._finite_tail
    monkeypatch.setattr(fa4, "_finite_tail", lambda x, c: copies.append(x.shape) or real_tail(x, c))
    monkeypatch.setattr(fa4, "int", lambda x: reads.append(1) or int(x), raising=False)   # the host reads of cu[-1]
    fa4._PACKED.clear()
    res = {}
    for name in ("fa4", "reference", "fa4"):
        leaves = [t.detach().clone().requires_grad_() for t in base]
        out, lse = flashport.attention_varlen(*leaves, cu, cu, max(lens), max(lens), causal=True, return_lse=True,
                                              backend=name)
        res.setdefault(name, (out, lse, *torch.autograd.grad(out, leaves, do)))
    assert copies == [], copies
    assert len(reads) == 1, reads            # two forwards and two backwards, one read
    for got, want in zip(res["fa4"], res["reference"]):
        torch.testing.assert_close(got.float(), want.float(), atol=4e-3, rtol=4e-3)
    cu[-1] -= 3                               # an in-place change: read again, and now three rows trail
    assert fa4._packed_rows(cu) == n - 3 and not fa4._tight(cu, n)


def test_the_stand_in_would_catch_an_unsanitised_tail(fake_fa4):
    """The varlen test above can fail: FA4 fed the NaN tail directly returns NaN (a test that cannot fail is a
    defect)."""
    interface = sys.modules["flash_attn.cute.interface"]
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q, k, v = (torch.randn(5, 2, 16).half() for _ in range(3))
    k[3:], v[3:] = float("nan"), float("nan")
    out, _ = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3,
                                              max_seqlen_k=3, return_lse=True)
    assert torch.isnan(out[:3]).all()
    with pytest.raises(AssertionError, match="real bounds"):
        interface.flash_attn_func(q[None], k[None], v[None], window_size=(-1, 3))

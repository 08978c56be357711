"""The JAX frontend (flashport.jax) on the CPU: xla and blockwise against the float64 reference under the
tolerance rule (forward, lse and gradients, with an lse cotangent), a seeded fuzz, no retracing under jit,
refusal reasons and auto fallback, and bad input.  Skipped where jax is not installed."""
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flashport  # noqa: E402
import flashport.jax as fj  # noqa: E402
from flashport.jax import conformance as C  # noqa: E402
from flashport.jax import registry  # noqa: E402


@pytest.fixture
def small_tiles(monkeypatch):
    """Blockwise with 16-key tiles: every case crosses several tiles and a padded last one."""
    monkeypatch.setattr(registry.get("blockwise"), "block_k", 16)


def _assert_pass(r):
    assert r.status == "PASS", f"{r.backend} {r.case}: {r.status} {r.worst} {r.err:.3e} > {r.bound:.3e} {r.note}"


@pytest.mark.parametrize("case", C.grid("cpu"), ids=lambda c: c.name)
def test_xla_conformance(case):
    _assert_pass(C.check_case("xla", case))


@pytest.mark.parametrize("case", C.grid("cpu"), ids=lambda c: c.name)
def test_blockwise_conformance(case, small_tiles):
    r = C.check_case("blockwise", case)
    _assert_pass(r)
    assert r.checked == "out lse dq dk dv"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_low_precision(backend, dtype, small_tiles):
    _assert_pass(C.check_case(backend, C.Case("causal-gqa-softcap", sq=45, sk=61, hq=4, hkv=2, d=32, causal=True,
                                              softcap=8.0), dtype))


def _fuzz_cases(n, seed=1234):
    rng = np.random.default_rng(seed)
    for t in range(n):
        sq, sk = (int(x) for x in rng.integers(1, 70, size=2))
        hkv = int(rng.choice([1, 2, 3]))
        win = tuple(int(rng.choice([-1, 0, 1, 5, 17])) for _ in range(2))
        causal = bool(rng.random() < 0.3)
        if causal and win[1] not in (-1, 0):
            win = (win[0], -1)
        seg = [None, "pair", "shared"][int(rng.integers(0, 3 if sq == sk else 2))]
        if seg == "shared" and sq < 5:
            seg = None
        yield C.Case(f"fuzz{t}", b=int(rng.integers(1, 3)), sq=sq, sk=sk, hq=hkv * int(rng.choice([1, 2])), hkv=hkv,
                     d=int(rng.choice([8, 16, 24])), dv=int(rng.choice([8, 16])), causal=causal, window=win,
                     softcap=float(rng.choice([0.0, 0.0, 3.0])), segments=None if seg is None else str(seg))


@pytest.mark.parametrize("case", list(_fuzz_cases(12)), ids=lambda c: c.name)
def test_fuzz_against_reference(case, small_tiles):
    for backend in ("xla", "blockwise"):
        _assert_pass(C.check_case(backend, case, seed=hash(case.name) % 1000))


def _qkv(b=1, sq=24, sk=24, hq=2, hkv=1, d=8, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(ks[0], (b, sq, hq, d), dtype), jax.random.normal(ks[1], (b, sk, hkv, d), dtype),
            jax.random.normal(ks[2], (b, sk, hkv, d), dtype))


@pytest.mark.parametrize("backend", ["xla", "blockwise"])
def test_jit_does_not_retrace(backend):
    traces = []

    @jax.jit
    def loss(q, k, v):
        traces.append(1)
        return fj.attention(q, k, v, causal=True, backend=backend).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    q, k, v = _qkv()
    before = registry.trace_counts[backend]
    for seed in range(3):   # new values, same shapes
        q2 = q + seed
        loss(q2, k, v).block_until_ready()
        jax.block_until_ready(grad(q2, k, v))
    assert len(traces) == 1                        # grad reuses loss's trace
    inner = registry.trace_counts[backend] - before
    for _ in range(3):                             # eager calls hit the backend's jit cache too
        fj.attention(q, k, v, causal=True, backend=backend).block_until_ready()
    assert registry.trace_counts[backend] - before == inner
    loss(*_qkv(sq=25, sk=25))                      # a new shape traces again (the counter can fail)
    assert len(traces) == 2


def test_auto_order_and_fallback():
    q, k, v = _qkv()
    assert fj.select(q, k, v) == "xla"                     # short sequence on a CPU
    ql, kl, vl = _qkv(sq=1100, sk=1100, hq=1, d=8)
    assert fj.select(ql, kl, vl) == "blockwise"            # Sq * Sk above the materialising limit
    with pytest.raises(flashport.UnsupportedError, match="materialises"):
        raise flashport.UnsupportedError(registry.get("xla").auto_reasons(
            fj.spec.validate(ql, kl, vl, **fj._DEFAULTS)[0])[0])
    assert fj.select(ql, kl, vl, backend="xla") == "xla"   # named: served, however long


def test_refusals_name_reasons():
    q, k, v = _qkv(sq=37, sk=53)
    with pytest.raises(flashport.UnsupportedError, match="no GPU"):
        fj.attention(q, k, v, backend="cudnn")
    with pytest.raises(flashport.UnsupportedError, match="Sk = 53 not a multiple of 128"):
        fj.attention(q, k, v, backend="pallas-tpu")
    q, k, v = _qkv(sq=128, sk=128)
    with pytest.raises(flashport.UnsupportedError, match="return_lse"):
        fj.attention(q, k, v, return_lse=True, backend="pallas-tpu")
    with pytest.raises(flashport.UnsupportedError, match="GQA"):
        fj.attention(q, k, v, backend="pallas-tpu-flash")
    with pytest.raises(flashport.UnsupportedError, match="unknown JAX backend"):
        fj.attention(q, k, v, backend="triton")
    with pytest.raises(flashport.UnsupportedError, match="unknown JAX backend"):
        fj.attention(q, k, v, backend="")
    why = registry.why_not(fj.spec.validate(*_qkv(), **{**fj._DEFAULTS, "softcap": 2.0, "return_lse": True})[0])
    assert why["xla"] == [] and why["blockwise"] == []
    assert "softcap" in why["cudnn"] and any("return_lse" in w for w in why["cudnn"])


def test_backends_and_describe():
    infos = fj.backends()
    assert [i.name for i in infos] == ["cudnn", "pallas-tpu", "pallas-tpu-flash", "xla", "blockwise"]
    assert all(isinstance(i, flashport.BackendInfo) for i in infos)
    by = {i.name: i for i in infos}
    assert by["xla"].available and by["blockwise"].available and not by["cudnn"].available
    assert by["pallas-tpu"].available                      # interpret mode on a CPU
    assert by["cudnn"].capabilities["dtypes"] == ["float16", "bfloat16"]
    d = fj.describe()
    assert d[0]["name"] == "cudnn" and d[0]["reasons"] and "capabilities" in d[0]
    assert fj.environment()["platform"] == jax.default_backend()


def test_empty_rows_and_degenerate_sizes():
    q, k, v = _qkv(sq=6, sk=3)
    for backend in ("xla", "blockwise"):
        out, lse = fj.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        assert np.all(np.asarray(out[:, :3]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :, :3])))
        g = jax.grad(lambda q, b=backend: fj.attention(q, k, v, causal=True, backend=b).sum())(q)
        assert np.all(np.asarray(g[:, :3]) == 0) and np.all(np.isfinite(np.asarray(g)))
    q0, k0, v0 = _qkv(sq=5, sk=0)
    out, lse = fj.attention(q0, k0, v0, return_lse=True)
    assert out.shape == (1, 5, 2, 8) and np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_bad_input():
    q, k, v = _qkv()
    cases = [
        (dict(q=q[0]), ValueError, "q must be"),
        (dict(k=k.astype(jnp.float16)), TypeError, "share a dtype"),
        (dict(q=q.astype(jnp.int32), k=k.astype(jnp.int32), v=v.astype(jnp.int32)), TypeError, "floating"),
        (dict(k=_qkv(hkv=3, hq=3)[1], v=_qkv(hkv=3, hq=3)[2]), ValueError, "multiple of k's heads"),
        (dict(k=k[:, :5]), ValueError, "v must match"),
        (dict(window_size=(-2, 0)), ValueError, "window_size left"),
        (dict(window_size=3), ValueError, "window_size"),
        (dict(causal=True, window_size=(4, 2)), ValueError, "causal=True contradicts"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softmax_scale=jnp.float32(0.5) + q[0, 0, 0, 0]), TypeError, "softmax_scale"),
        (dict(segment_ids=jnp.zeros((1, 24), jnp.float32)), TypeError, "segment_ids must be int32"),
        (dict(segment_ids=jnp.zeros((1, 23), jnp.int32)), ValueError, "segment_ids must be"),
        (dict(k=k[:, :20], v=v[:, :20], segment_ids=jnp.zeros((1, 24), jnp.int32)), ValueError, "Sq == Sk"),
        (dict(segment_ids=(jnp.zeros((1, 24), jnp.int32), jnp.zeros((1, 23), jnp.int32))), ValueError,
         r"segment_ids\[1\]"),
        (dict(backend=3), TypeError, "backend"),
        (dict(q=[[1.0]]), TypeError, "q must be a jax array"),
    ]
    for kw, exc, msg in cases:
        args = dict(q=q, k=k, v=v)
        args.update({n: kw.pop(n) for n in ("q", "k", "v") if n in kw})
        with pytest.raises(exc, match=msg):
            fj.attention(args["q"], args["k"], args["v"], **kw)


def test_import_flashport_does_not_import_jax():
    code = "import sys, flashport; assert 'jax' not in sys.modules, 'jax imported'; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]

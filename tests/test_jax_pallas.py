"""The Pallas TPU kernels JAX ships (splash: `pallas-tpu`; flash: `pallas-tpu-flash`) in Pallas' TPU
interpret mode on the CPU, against the float64 reference on small shapes (forward and gradients)."""
import pytest

pytest.importorskip("jax")
pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")

from flashport.jax import conformance as C  # noqa: E402

# what each kernel is expected to refuse on the interpret grid (anything else must PASS)
FLASH_SKIPS = {"tpu-causal-gqa-softcap": "softcap", "tpu-causal-sq>sk-empty-rows": "GQA",
               "tpu-window-segments": "mask kind 'window'"}


@pytest.mark.parametrize("case", C.pallas_grid(), ids=lambda c: c.name)
def test_splash_interpret(case):
    r = C.check_case("pallas-tpu", case)
    assert r.status == "PASS", f"{r.case}: {r.status} {r.worst} {r.err:.3e} > {r.bound:.3e} {r.note}"
    assert r.checked == "out dq dk dv" and "lse not served" in r.note


@pytest.mark.parametrize("case", C.pallas_grid(), ids=lambda c: c.name)
def test_flash_interpret(case):
    r = C.check_case("pallas-tpu-flash", case)
    if case.name in FLASH_SKIPS:
        assert r.status == "SKIP" and FLASH_SKIPS[case.name] in r.note, r.note
    else:
        assert r.status == "PASS", f"{r.case}: {r.status} {r.worst} {r.err:.3e} > {r.bound:.3e} {r.note}"


def test_splash_serves_a_second_trace_with_another_batch_and_head_dim():
    """The splash kernel is cached per (heads, lengths, window, softcap); one built inside the first jit trace kept
    that trace's arrays, and the next trace with the same key (another batch or head dim) raised
    UnexpectedTracerError for the rest of the process."""
    import jax
    import jax.numpy as jnp

    import flashport.jax as fj
    from flashport.jax import pallas_tpu

    pallas_tpu._splash_kernel.cache_clear()

    def x(b, d):
        return jnp.ones((b, 128, 2, d), jnp.float32)
    for b, d in ((1, 64), (2, 64), (2, 40)):
        out = fj.attention(x(b, d), x(b, d), x(b, d), backend="pallas-tpu")
        assert out.shape == (b, 128, 2, d) and bool(jnp.allclose(out, 1.0))
    g = jax.grad(lambda q: fj.attention(q, x(3, 40), x(3, 40), backend="pallas-tpu").sum())(x(3, 40))
    assert g.shape == (3, 128, 2, 40)

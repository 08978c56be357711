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

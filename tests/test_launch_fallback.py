"""tuning.launch_with_fallback: the config it remembers per key, and the kernels' variants that must not share one
(the 19th session's H200 run: a prefix-LM call remembered 128x128 tiles for D=128 at S=4096, and the same shape with
an attn_bias gradient then launched them with 360448 B of shared memory, past the card's 232448)."""
from __future__ import annotations

import pytest
import torch

from flashport.kernels import tuning
from flashport.spec import dense_spec

OutOfResources = pytest.importorskip("triton.runtime.errors").OutOfResources
BIG, SMALL = tuning.KernelConfig(128, 128, 8, 3), tuning.KernelConfig(64, 64, 4, 2)


@pytest.fixture
def fake_card(monkeypatch):
    monkeypatch.setattr(tuning, "candidates", lambda kernel, spec, device: [BIG, SMALL])
    monkeypatch.setattr(tuning, "_chosen", {})


def _spec():
    q = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    return dense_spec(q, q, q, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      dropout_p=0.0, deterministic=False, return_lse=False)[0]


def test_a_variant_with_a_larger_footprint_chooses_its_own_config(fake_card):
    spec, dev, ran = _spec(), torch.device("cuda", 0), []

    def launch(footprint):
        def run(cfg):
            if footprint == "bias" and cfg == BIG:
                raise OutOfResources(360448, 232448, "shared memory")
            ran.append((footprint, cfg))
        return run
    assert tuning.launch_with_fallback("fwd", spec, dev, launch("plain")) == BIG
    assert tuning.launch_with_fallback("fwd", spec, dev, launch("bias"), variant=("bias",)) == SMALL
    assert tuning.launch_with_fallback("fwd", spec, dev, launch("plain")) == BIG     # its own remembered config
    assert tuning.launch_with_fallback("fwd", spec, dev, launch("bias"), variant=("bias",)) == SMALL
    assert ran == [("plain", BIG), ("bias", SMALL), ("plain", BIG), ("bias", SMALL)]


def test_a_remembered_config_that_no_longer_fits_is_chosen_again(fake_card):
    spec, dev = _spec(), torch.device("cuda", 0)
    tuning.launch_with_fallback("fwd", spec, dev, lambda cfg: None)           # remembers BIG

    def tight(cfg):
        if cfg == BIG:
            raise OutOfResources(360448, 232448, "shared memory")
    assert tuning.launch_with_fallback("fwd", spec, dev, tight) == SMALL

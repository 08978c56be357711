"""GPU tier of the fuzzer (skipped without CUDA): FLASHPORT_FUZZ_N random cases (default 300, full sizes,
bf16 / fp16 / fp32) with auto selection and with backend="triton", each against the float64 reference
under the tolerance rule; every kernel variant class is hit at least once (Triton forward and backward,
the Gluon forward and backward on sm_90, decode with one split and with split-KV, the Triton merge).
On sm_90 also FLASHPORT_FUZZ_HOPPER_N (default 300) cases of the Hopper focus, hits counted per switched
variant.  FLASHPORT_FUZZ_SEED, FLASHPORT_FUZZ_WORKERS and FLASHPORT_FUZZ_LOG (a directory for the JSON-lines logs)
adjust the run.  The 5000-case run: python -m flashport.fuzz --n 5000 --device cuda --log fuzz.jsonl"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import flashport  # noqa: E402
from flashport.fuzz import cases, format_summary, run_fuzz  # noqa: E402
from flashport.fuzz.variants import GPU_CLASSES  # noqa: E402

N = int(os.environ.get("FLASHPORT_FUZZ_N", "300"))
SEED = int(os.environ.get("FLASHPORT_FUZZ_SEED", "0"))
WORKERS = int(os.environ["FLASHPORT_FUZZ_WORKERS"]) if os.environ.get("FLASHPORT_FUZZ_WORKERS") else None


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def _triton_available():
    info = {b.name: b for b in flashport.backends()}["triton"]
    if not info.available:
        pytest.skip("triton backend unavailable: " + "; ".join(info.reasons))


def test_gate_constants_match_the_kernels():
    # the generator copies the Hopper gates so that drawing a case never imports Triton
    from flashport.kernels import attn_bwd_hopper, attn_fwd_hopper
    assert cases.HOPPER_FWD_TILE == attn_fwd_hopper.TILE
    for d in attn_fwd_hopper.TILES:
        assert cases.HOPPER_FWD_MIN_KEYS[d] == attn_fwd_hopper.MIN_KEYS[d] == attn_fwd_hopper.MIN_KEYS_CAUSAL[d]
    assert cases.HOPPER_BWD_BLOCK_N == attn_bwd_hopper.BLOCK_N
    assert set(cases.HOPPER_BWD_DIMS) == set(attn_bwd_hopper.DEFAULT)


@pytest.mark.parametrize("backend", [None, "triton"], ids=["auto", "triton"])
def test_fuzz_gpu(backend, tmp_path):
    log_dir = os.environ.get("FLASHPORT_FUZZ_LOG") or str(tmp_path)
    os.makedirs(log_dir, exist_ok=True)
    log = os.path.join(log_dir, f"fuzz_gpu_{backend or 'auto'}_{SEED}.jsonl")
    results, summary = run_fuzz(n=N, seed=SEED, device="cuda", backend=backend, size="full", workers=WORKERS,
                                log=log, verbose=True)
    print(format_summary(summary))
    bad = {s: n for s, n in summary["status"].items() if s not in ("PASS",)}
    assert not bad, format_summary(summary)
    assert summary["ran"] == N
    assert not summary["hooks_missing"], summary["hooks_missing"]
    # backend="triton" is the portable kernels alone: the Gluon ones are the gluon backend's
    expected = [c for c in GPU_CLASSES if (_hopper() and backend is None) or not c.startswith("gluon")]
    missing = [c for c in expected if c not in summary["variant_classes"]]
    assert not missing, f"variant classes never hit: {missing}\n" + format_summary(summary)


HOPPER_N = int(os.environ.get("FLASHPORT_FUZZ_HOPPER_N", "300"))
# The Gluon kernels' variants behind switches, as the fuzz labels their hits (flashport/fuzz/variants.py)
SWITCHED = {"gluon_fwd:window": "FLASHPORT_HOPPER_FWD_WINDOW", "gluon_bwd:window": "FLASHPORT_HOPPER_BWD_WINDOW",
            "gluon_fwd:alibi": "FLASHPORT_HOPPER_FWD_ALIBI", "gluon_bwd:alibi": "FLASHPORT_HOPPER_BWD_ALIBI",
            "gluon_fwd:split": "FLASHPORT_HOPPER_FWD_SPLIT", "gluon_bwd:split": "FLASHPORT_HOPPER_BWD_SPLIT",
            "gluon_bwd:m128": "FLASHPORT_HOPPER_BWD_M128", "gluon_bwd:group_loop": "FLASHPORT_HOPPER_BWD_GROUP_LOOP"}


def test_fuzz_gpu_hopper_focus(tmp_path):
    """The fuzz's Hopper focus (entries "hopper": the Gluon kernels' recipes alone, 16-bit, auto selection):
    FLASHPORT_FUZZ_HOPPER_N cases within the rule, the Gluon forward and backward both hit, and every switched
    variant whose switch is on in this process hit at least once (the hits per variant are in the summary) --
    what a fast path behind a switch needs before it goes on by default."""
    from flashport import env
    if not _hopper():
        pytest.skip("the Gluon kernels need an sm_90 GPU")
    log_dir = os.environ.get("FLASHPORT_FUZZ_LOG") or str(tmp_path)
    os.makedirs(log_dir, exist_ok=True)
    results, summary = run_fuzz(n=HOPPER_N, seed=SEED, device="cuda", size="full", dtypes=("bfloat16", "float16"),
                                entries=["hopper"], workers=WORKERS, verbose=True,
                                log=os.path.join(log_dir, f"fuzz_gpu_hopper_{SEED}.jsonl"))
    print(format_summary(summary))
    bad = {s: n for s, n in summary["status"].items() if s not in ("PASS",)}
    assert not bad, format_summary(summary)
    assert {"gluon_fwd", "gluon_bwd"} <= set(summary["variant_classes"]), format_summary(summary)
    missing = [label for label, switch in SWITCHED.items() if env.flag(switch) and label not in summary["by_variant"]]
    assert not missing, f"switched variants never hit: {missing}\n" + format_summary(summary)

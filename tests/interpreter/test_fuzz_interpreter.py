"""Interpreter tier of the fuzzer: small random cases of the whole contract (dense, varlen, KV cache dense
and paged, merge) on the real Triton kernels in Triton's interpreter, fp32 / fp16 (bf16 dots are wrong in
the interpreter), against the float64 reference under the tolerance rule.  FLASHPORT_FUZZ_SEED varies
the seed (default fixed, so CI is reproducible); a failure prints its `python -m flashport.fuzz` line."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from flashport.fuzz import format_summary, run_fuzz  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

N = int(os.environ.get("FLASHPORT_FUZZ_INTERP_N", "40"))
SEED = int(os.environ.get("FLASHPORT_FUZZ_SEED", "2025"))


def test_fuzz_triton_interpreter(tmp_path):
    results, summary = run_fuzz(n=N, seed=SEED, device="cpu", dtypes=("float16", "float32"), backend="triton",
                                size="small", workers=1, log=str(tmp_path / "fuzz.jsonl"), verbose=False,
                                out=lambda *a: None)
    bad = {s: n for s, n in summary["status"].items() if s not in ("PASS",)}
    assert not bad, format_summary(summary)
    assert summary["ran"] == N
    # the kernels really ran (not another backend): Triton forward and backward, the KV-cache kernel
    assert {"triton_fwd", "triton_bwd"} <= set(summary["variant_classes"]), summary["variant_classes"]
    assert {"decode_single", "decode_splitkv"} & set(summary["variant_classes"])
    assert set(summary["by_entry"]) >= {"attention", "varlen", "kvcache"}

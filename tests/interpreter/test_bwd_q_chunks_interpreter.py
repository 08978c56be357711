"""Interpreter tier: the dK/dV kernel with its Q tiles split over several programs per K/V tile
(kernels/attn_bwd.q_chunks, forced by FLASHPORT_BWD_Q_CHUNKS), against the float64 reference: dense and varlen,
causal and windows (full and boundary tiles of a run), rows that see no key, GQA summed per group or looped, a few
keys against many queries (what the split is for), ALiBi and softcap, both loop layouts."""
from __future__ import annotations

import os

import pytest
import torch

from conformance import BASE_CASES, Case, check_dense  # noqa: E402
from flashport.check import check_case  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

CASES = BASE_CASES[:6] + [
    Case(b=2, sq=150, sk=4, hq=2, hkv=2, d=16, window=(-1, 136)),   # the sinks' call: 4 keys, rows < 10 see none
    Case(b=1, sq=90, sk=20, hq=4, hkv=2, d=16, causal=True, softcap=3.0, alibi="head"),
    Case(b=1, sq=70, sk=45, hq=6, hkv=2, d=16, causal=True, window=(7, -1)),
]


@pytest.mark.parametrize("chunks", ["2", "3"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_q_chunks_dense(case, chunks, monkeypatch):
    monkeypatch.setenv("FLASHPORT_BWD_Q_CHUNKS", chunks)
    check_dense("triton", case)


@pytest.mark.parametrize("split", [False, True], ids=["one-loop", "split-loops"])
@pytest.mark.parametrize("group_loop", ["0", "1"])
def test_q_chunks_varlen_and_group_loop(split, group_loop, monkeypatch):
    from flashport.kernels import tuning
    from test_triton_interpreter import VARLEN
    monkeypatch.setenv("FLASHPORT_BWD_Q_CHUNKS", "3")
    monkeypatch.setenv("FLASHPORT_GQA_GROUP_LOOP", group_loop)
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", tuning.KernelConfig(16, 16, 4, 1, split=split))
    check_dense("triton", Case(b=1, sq=70, sk=45, hq=6, hkv=2, d=16, causal=True, window=(7, -1)))
    for case in VARLEN:
        r = check_case("triton", case, torch.float32, "cpu")
        assert r.status == "PASS" and "dq dk dv" in r.checked, r


def test_q_chunks_chooses_a_split_only_where_sms_idle(monkeypatch):
    """auto: one program per key tile unless key tiles x heads x batch fill under half the SMs and the walk is long."""
    from flashport.kernels import attn_bwd, tuning
    from flashport.spec import AttnSpec  # noqa: F401  (the spec's fields used below)
    monkeypatch.setattr(attn_bwd, "_sm_count", lambda index: 132)
    cfg = tuning.KernelConfig(64, 64, 4, 1)
    cuda = torch.device("cuda", 0)

    class S:   # the fields q_chunks reads
        seqlen_q = 16384
    assert attn_bwd.q_chunks(S, cfg, cuda, programs=32) == 9         # the sinks' call: 1 key tile x 16 heads x 2
    assert attn_bwd.q_chunks(S, cfg, cuda, programs=4096) == 1       # a full call
    S.seqlen_q = 1024
    assert attn_bwd.q_chunks(S, cfg, cuda, programs=32) == 1         # a short walk (16 Q tiles)
    assert attn_bwd.q_chunks(S, cfg, torch.device("cpu"), programs=1) == 1


def test_q_chunks_setting_must_be_auto_or_a_positive_integer(monkeypatch):
    from flashport.kernels import attn_bwd, tuning

    class S:
        seqlen_q = 64
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("FLASHPORT_BWD_Q_CHUNKS", bad)
        with pytest.raises(ValueError, match="FLASHPORT_BWD_Q_CHUNKS"):
            attn_bwd.q_chunks(S, tuning.KernelConfig(16, 16, 4, 1), torch.device("cpu"), programs=1)
    monkeypatch.setenv("FLASHPORT_BWD_Q_CHUNKS", "9")
    assert attn_bwd.q_chunks(S, tuning.KernelConfig(16, 16, 4, 1), torch.device("cpu"), programs=1) == 4  # 4 Q tiles

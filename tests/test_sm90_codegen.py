"""The kernels as the H100/H200 get them, checked on a machine without a GPU: tools/gpu/compile_report.py
compiles them for sm_90a with Triton's bundled ptxas and reads the SASS.  Catches a change that makes a
tuned kernel spill registers, fall back from Hopper's HGMMA to HMMA, or lose its 16-byte loads.

Runs the tool in a subprocess: the interpreter tier sets TRITON_INTERPRET=1 in every test process, and
Triton decides at decoration time whether a kernel is compiled or interpreted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's bundled cuobjdump is missing")
@pytest.mark.parametrize("d, gqa", [(64, 1), (72, 4)])
def test_tuned_kernels_use_hgmma_without_spills(tmp_path, d, gqa):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "compile_report.py"), "--d", str(d), "--causal",
                           "--gqa", str(gqa), "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())}
    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        r = rows[kernel]
        assert r["sass"]["HGMMA"] > 0 and r["sass"]["HMMA"] == 0, (kernel, r["config"], r["sass"])
        assert r["sass"]["LDL"] + r["sass"]["STL"] == 0 and r["stack_bytes"] == 0, (kernel, r["config"], r["sass"])
        # 16-byte tile loads even when the head stride (72) is not a multiple of 16 (the ALIGN hint)
        assert not any(op.startswith("LDG.E.U16") for op in r["sass_ops"]), (kernel, r["sass_ops"])


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's bundled cuobjdump is missing")
@pytest.mark.parametrize("switches", [{}, {"FLASHPORT_HOPPER_FWD_PIN": "1"},
                                      {"FLASHPORT_HOPPER_FWD_PIN": "1", "FLASHPORT_HOPPER_FWD_PINGPONG": "1"}],
                         ids=["plain", "pin", "pin+pingpong"])
def test_hopper_forward_compiles_to_hgmma_and_tma_without_spills(switches, tmp_path):
    """The Gluon forward (kernels/attn_fwd_hopper.py) has no interpreter: this is its CPU-side check, for
    every head dim of its tile table (80 and 96 as two column parts), no mask, causal, a window and causal with
    ALiBi: HGMMA, TMA loads, setmaxnreg, no spills, the registers it touches within the consumers' setmaxnreg
    count, shared memory within sm_90's opt-in.  With FLASHPORT_HOPPER_FWD_PIN=1 the softmax's exp2 of each key
    tile lie between the wait for S_j and the wait for P_{j-1} V_{j-1} in the SASS (a tile of 128 keys has 64 per
    thread, of 64 keys 32): the overlap FA3 schedules, which ptxas undoes without the pin (PERFLOG row 87); so too
    with the warpgroups' ping-pong (FLASHPORT_HOPPER_FWD_PINGPONG=1, row 88)."""
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(switches)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "compile_report.py"), "--d", "--hopper-fwd",
                           "--hopper-dtype", "bf16", "--gqa", "2", "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in json.loads(out.read_text()) if r["kernel"] == "fwd_hopper"]
    assert [(r["d"], r["causal"]) for r in rows] == [(d, c) for d in (64, 80, 96, 128, 256)
                                                     for c in (False, True, "window", "alibi")
                                                     if c != "alibi" or d != 256]    # ALIBI_HEAD_DIMS
    for r in rows:
        assert "error" not in r, r["error"]
        ops = r["sass_ops"]
        assert r["sass"]["HGMMA"] > 0 and r["sass"]["HMMA"] == 0, (r["d"], r["sass"])
        assert r["stack_bytes"] == 0 and r["sass"]["LDL"] + r["sass"]["STL"] == 0, (r["d"], r["sass"])
        assert any(op.startswith("UTMALDG") for op in ops) and any(op.startswith("USETMAXREG") for op in ops), ops
        assert r["max_register_used"] <= r["config"]["consumer_regs"], (r["d"], r["causal"], r["max_register_used"])
        assert r["shared_bytes"] <= 232448, (r["d"], r["shared_bytes"])
        if switches:
            waits = r["ex2_between_waits"]
            assert waits and min(waits) >= 32, (r["d"], r["causal"], waits)


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's bundled cuobjdump is missing")
def test_kernels_with_compiled_mods_compile_for_sm90(tmp_path):
    """Issue [15]: the kernels with generated score_mod / mask_mod functions (a captured-tuple argument, constexpr
    jit-function parameters) and a block mask's tile skipping compile for sm_90 (the interpreter cannot show it):
    HGMMA, no HMMA, shared memory within sm_90's opt-in, and the spills of today's report at most (1680 bytes of
    stack in dQ before its 8-warp rule: attn_bwd.dq_config_with_mods)."""
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "compile_report.py"), "--d", "64", "--mods",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in json.loads(out.read_text()) if r.get("mods") and r["kernel"] != "preprocess"]
    assert sorted((r["kernel"], r["mods"]) for r in rows) == sorted(
        (k, m) for k in ("fwd", "bwd_dkdv", "bwd_dq") for m in ("mask_mod", "block_mask"))
    for r in rows:
        assert r["sass"]["HGMMA"] > 0 and r["sass"]["HMMA"] == 0, (r["kernel"], r["mods"], r["sass"])
        assert r["stack_bytes"] <= 64, (r["kernel"], r["mods"], r["stack_bytes"])
        assert r["shared_bytes"] <= 232448, (r["kernel"], r["mods"], r["shared_bytes"])


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's bundled cuobjdump is missing")
def test_q_chunked_dkdv_and_the_merge_kernels_compile_for_sm90_without_spills(tmp_path):
    """The dK/dV kernel with its Q tiles split over programs (FLASHPORT_BWD_Q_CHUNKS forces the runtime value that
    auto chooses on a GPU), and the merge's forward and backward kernels, one chunk of parts and several."""
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLASHPORT_BWD_Q_CHUNKS"] = "3"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "compile_report.py"), "--d", "64", "--merge",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    kernels = [r["kernel"] for r in rows]
    assert "bwd_dkdv" in kernels and kernels.count("merge") == 2 and kernels.count("merge_bwd") == 2, kernels
    for r in rows:
        if r["kernel"] in ("bwd_dkdv", "merge", "merge_bwd"):
            assert "error" not in r and r["sass"]["LDL"] + r["sass"]["STL"] == 0 and r["stack_bytes"] == 0, r
    assert next(r for r in rows if r["kernel"] == "bwd_dkdv")["sass"]["HGMMA"] > 0


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's bundled cuobjdump is missing")
@pytest.mark.parametrize("switches", [{}, {"FLASHPORT_HOPPER_BWD_DQ_FIRST": "1"},
                                      {"FLASHPORT_HOPPER_BWD_GROUP_LOOP": "1"}], ids=["plain", "dq_first", "group_loop"])
def test_hopper_backward_compiles_every_mask_variant(switches, tmp_path):
    """The Gluon backward (kernels/attn_bwd_hopper.py), no mask, causal, its sliding-window variant and causal with
    ALiBi, at each head dim it serves (80 and 96 as two column parts): HGMMA, TMA, setmaxnreg, the registers it
    touches within the consumers' 240, and at D=64, 80, 96 no spills (D=128 spills in every variant: 8 bytes without
    a mask, 32 causal, 40 windowed, 80 with ALiBi in the 22nd session's report; the bounds below keep that from
    growing unnoticed).  The same with dQ_j issued before dK (FLASHPORT_HOPPER_BWD_DQ_FIRST=1, PERFLOG row 89) and with
    the GQA group loop (FLASHPORT_HOPPER_BWD_GROUP_LOOP=1; the report compiles GQA 2, row 90)."""
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(switches)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "compile_report.py"), "--d", "--hopper-bwd",
                           "--hopper-dtype", "bf16", "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in json.loads(out.read_text()) if r["kernel"] == "bwd_hopper"]
    assert [(r["d"], r["causal"]) for r in rows] == [(d, m) for d in (64, 80, 96, 128)
                                                     for m in ("none", "causal", "window", "alibi")]
    for r in rows:
        assert "error" not in r, r["error"]
        ops = r["sass_ops"]
        assert r["sass"]["HGMMA"] > 0 and r["sass"]["HMMA"] == 0, (r["d"], r["sass"])
        assert any(op.startswith("UTMALDG") for op in ops) and any(op.startswith("USETMAXREG") for op in ops), ops
        assert r["max_register_used"] <= 240, (r["d"], r["causal"], r["max_register_used"])
        bound = 0 if r["d"] != 128 else 96 if r["causal"] == "alibi" else 48
        assert r["stack_bytes"] <= bound, (r["d"], r["causal"], r["stack_bytes"])


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's bundled cuobjdump is missing")
def test_hopper_backward_128_row_tile_compiles(tmp_path):
    """The backward's 128-row Q tile at D=64 (variant m128_s2): S^T and dP^T [64, 128] per warpgroup, lse2 / Delta
    read after their matmuls retire.  HGMMA, TMA, registers within 240; no spills without a mask, and at most
    today's (24 bytes causal, 32 windowed, 56 with ALiBi) with one."""
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "compile_report.py"), "--d", "64",
                           "--hopper-bwd", "--hopper-dtype", "bf16", "--hopper-bwd-variant", "m128_s2",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in json.loads(out.read_text()) if r["kernel"] == "bwd_hopper"]
    assert [(r["d"], r["causal"], r["config"]["block_m"]) for r in rows] == [
        (64, m, 128) for m in ("none", "causal", "window", "alibi")]
    bounds = {"none": 0, "causal": 24, "window": 32, "alibi": 56}
    for r in rows:
        assert "error" not in r, r["error"]
        assert r["sass"]["HGMMA"] > 0 and r["sass"]["HMMA"] == 0, r["sass"]
        assert any(op.startswith("UTMALDG") for op in r["sass_ops"]), r["sass_ops"]
        assert r["max_register_used"] <= 240, (r["causal"], r["max_register_used"])
        assert r["stack_bytes"] <= bounds[r["causal"]], (r["causal"], r["stack_bytes"])

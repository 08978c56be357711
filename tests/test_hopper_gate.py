"""Which calls the Gluon Hopper forward (kernels/attn_fwd_hopper.py) accepts, checked without a GPU: the
gate runs on every forward, and anything it lets through that the kernel cannot handle would crash or
compute garbage on an H100/H200 (the kernel itself is checked by tests/gpu/test_hopper_fwd_gpu.py and,
compiled for sm_90a, by tests/test_sm90_codegen.py).  Also the per-head-dim tables (tiles, length
floors) and the floor suggestion of tools/gpu/hopper_fwd_ab.py that those floors are read from."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from conformance import rejecting_launcher
from flashport.spec import dense_spec

ROOT = Path(__file__).resolve().parent.parent
SM90_SMEM = 232448     # bytes of shared memory one block may opt into on sm_90


def _spec(b=1, s=4096, hq=4, hkv=4, d=128, dv=None, causal=False, sk=None, **kw):
    q = torch.empty(b, s, hq, d, dtype=torch.bfloat16, device="meta")    # shapes only, no memory
    k = torch.empty(b, sk or s, hkv, d, dtype=torch.bfloat16, device="meta")
    v = torch.empty(b, sk or s, hkv, dv or d, dtype=torch.bfloat16, device="meta")
    spec, _ = dense_spec(q, k, v, causal=causal, softmax_scale=kw.get("scale"), window_size=kw.get("window", (-1, -1)),
                         softcap=kw.get("softcap", 0.0), alibi_slopes=None, dropout_p=0.0, deterministic=False,
                         return_lse=False)
    return dataclasses.replace(spec, device=torch.device("cuda", 0)), q, k, v   # as if on a GPU: no CUDA call


@pytest.fixture
def on_hopper(monkeypatch):
    """The gate as it runs on an sm_90 GPU with Gluon available (meta tensors report data_ptr 0: aligned)."""
    from flashport.kernels import attn_fwd_hopper
    monkeypatch.setattr(attn_fwd_hopper, "enabled", lambda: True)
    monkeypatch.setattr(attn_fwd_hopper, "_capability", lambda index: (9, 0))
    return attn_fwd_hopper


@pytest.mark.parametrize("kw, reason", [
    (dict(d=72), "head dim"),
    (dict(d=32), "head dim"),
    (dict(d=128, dv=64), "head dim"),                        # q/k and v must share D
    (dict(s=4000), "multiples of 128"),
    (dict(s=4096, sk=4160), "multiples of 128"),             # Sk too (BLOCK_N = 64 would not catch it)
    (dict(s=256), "at least 512"),                          # the shipped floors (results/hopper_fwd_ab_h200.json)
    (dict(d=64, s=8192), "at least 16384 at D=64"),
    (dict(d=256, s=256), "at least 512 at D=256"),
    (dict(s=256, causal=True), "at least 512"),
    (dict(d=256, s=384, causal=True), "at least 512 at D=256"),
    (dict(s=128, sk=8192), "at least 512"),                  # short Sq, long Sk: never measured
    (dict(s=4096, sk=8192, causal=True), "Sq == Sk"),
    (dict(b=0), "batch * heads"),
    (dict(b=8192, hq=16, hkv=16), "batch * heads"),          # grid y would pass 65535
    (dict(window=(256, 0), s=4096, sk=8192), "Sq == Sk"),
    (dict(softcap=5.0), "softcap"),
    (dict(scale=-0.5), "positive softmax scale"),
])
def test_gate_declines_what_the_kernel_cannot_serve(kw, reason, on_hopper):
    spec, q, k, v = _spec(**kw)
    got = on_hopper.reasons(spec, q, k, v)
    assert got and reason in got[0], got


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gate_serves_every_head_dim_from_its_floor(d, causal, on_hopper):
    floor = on_hopper.min_keys(d, causal)
    assert floor is not None and floor % on_hopper.TILE == 0
    for s, served in ((floor, True), (floor - on_hopper.TILE, False), (2 * floor, True)):
        spec, q, k, v = _spec(d=d, s=s, hq=8, hkv=2, causal=causal)    # GQA
        assert (on_hopper.reasons(spec, q, k, v) == []) == served, (d, causal, s, on_hopper.reasons(spec, q, k, v))
    spec, q, k, v = _spec(d=d, s=128, causal=causal)                    # below the floor: only speed says no
    assert on_hopper.reasons(spec, q, k, v) and on_hopper.reasons(spec, q, k, v, length_floor=False) == []
    spec, q, k, v = _spec(d=d, s=0, causal=causal)                      # the kernel needs one Q and key tile
    assert "at least 128" in on_hopper.reasons(spec, q, k, v, length_floor=False)[0]


def test_length_floor_table_is_per_head_dim(on_hopper, monkeypatch):
    """MIN_KEYS / MIN_KEYS_CAUSAL are data: one entry per served head dim; None switches a head dim off."""
    for table in (on_hopper.MIN_KEYS, on_hopper.MIN_KEYS_CAUSAL):
        assert set(table) == set(on_hopper.TILES)
    monkeypatch.setitem(on_hopper.MIN_KEYS, 64, 512)
    monkeypatch.setitem(on_hopper.MIN_KEYS_CAUSAL, 256, None)
    spec, q, k, v = _spec(d=64, s=512)
    assert on_hopper.reasons(spec, q, k, v) == []
    spec, q, k, v = _spec(d=128, s=384)
    assert "at least 512" in on_hopper.reasons(spec, q, k, v)[0]              # D=128 untouched
    spec, q, k, v = _spec(d=256, s=16384, causal=True)
    assert "not at D=256 causal" in on_hopper.reasons(spec, q, k, v)[0]
    spec, q, k, v = _spec(d=256, s=16384)
    assert on_hopper.reasons(spec, q, k, v) == []                              # non-causal D=256 untouched


def test_tile_table_fits_sm90_and_the_causal_diagonal():
    """Every head dim's tiles: BLOCK_N divides the 128-row Q tile and is a multiple of a warpgroup's 64 rows
    (each warpgroup then meets the diagonal in exactly one key tile), the Q tile + K/V ring fit sm_90's
    shared memory, and the setmaxnreg counts fit the register file (two consumer warpgroups + the producer).  A
    head dim that is not a power of two splits into two that are (Gluon's tensors must be)."""
    from flashport.kernels import attn_fwd_hopper as h
    assert set(h.TILES) == {64, 80, 96, 128, 256}
    pow2 = lambda n: n > 0 and n & (n - 1) == 0   # noqa: E731
    for d, t in h.TILES.items():
        assert h.TILE % t.block_n == 0 and t.block_n % h.BLOCK_M == 0, (d, t)
        assert (pow2(d) and t.split == 0) or (pow2(d - t.split) and pow2(t.split) and t.split % 16 == 0), (d, t)
        smem = 2 * (h.TILE * d + 2 * t.stages * t.block_n * d)
        assert smem <= SM90_SMEM - 1024, (d, t, smem)                          # barriers + alignment slack
        assert 2 * t.consumer_regs * 128 + 24 * 128 <= 65536 and t.consumer_regs % 8 == 0, (d, t)
        assert isinstance(t.early_k, bool)


def test_gate_declines_cpu_tensors_and_switch_off(monkeypatch):
    from flashport.kernels import attn_fwd_hopper
    spec, q, k, v = _spec()
    assert attn_fwd_hopper.reasons(dataclasses.replace(spec, device=torch.device("cpu")), q, k, v)
    monkeypatch.setenv("FLASHPORT_HOPPER_FWD", "0")
    assert not attn_fwd_hopper.enabled()
    assert "FLASHPORT_HOPPER_FWD" in attn_fwd_hopper.reasons(spec, q, k, v)[0]


@pytest.mark.parametrize("d", [64, 256])
def test_a_kernel_that_fails_to_compile_switches_itself_off(monkeypatch, d, on_hopper):
    """Safe fallback: if the toolchain rejects the Gluon kernel, forward() warns once and returns None (the
    caller runs the Triton kernel), and the gate declines that variant (dtype, D, causal) from then on."""
    from flashport.kernels import attn_fwd_hopper
    if attn_fwd_hopper.gluon is None:
        pytest.skip("Gluon not installed")
    monkeypatch.setattr(attn_fwd_hopper, "_launch", rejecting_launcher())
    monkeypatch.setattr(attn_fwd_hopper, "broken", {})
    monkeypatch.setattr(attn_fwd_hopper, "_compiled", set())
    q = torch.zeros(1, 256, 2, d, dtype=torch.bfloat16)
    spec, _ = dense_spec(q, q, q, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        assert attn_fwd_hopper.forward(spec, q, q, q) is None
    assert "ptxas: unsupported" in attn_fwd_hopper.broken[(torch.bfloat16, d, "causal", False, q.device)]
    gpu_spec, gq, gk, gv = _spec(d=d, causal=True, s=16384)   # above every floor
    attn_fwd_hopper.broken[(gpu_spec.dtype, d, "causal", False, gpu_spec.device)] = "RuntimeError: ptxas: unsupported"
    assert "failed to compile" in attn_fwd_hopper.reasons(gpu_spec, gq, gk, gv)[0]
    gpu_spec, gq, gk, gv = _spec(d=128, causal=True)
    assert attn_fwd_hopper.reasons(gpu_spec, gq, gk, gv) == []         # another head dim is unaffected


def _ab():
    spec = importlib.util.spec_from_file_location("hopper_fwd_ab", ROOT / "tools" / "gpu" / "hopper_fwd_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cell(d, s, causal, gluon_ms, triton_ms):
    impls = {"gluon": {"ms": gluon_ms} if gluon_ms else {"error": "x"}, "triton": {"ms": triton_ms}}
    return {"d": d, "s": s, "causal": causal, "impls": impls}


def test_ab_suggests_the_shortest_length_from_which_gluon_always_wins():
    ab = _ab()
    cells = [_cell(128, 512, False, 1.0, 2.0),         # wins, but S=1024 loses: not the floor
             _cell(128, 1024, False, 2.0, 1.5),
             _cell(128, 2048, False, 3.0, 4.0), _cell(128, 4096, False, 6.0, 9.0),
             _cell(128, 512, True, 1.0, 0.9), _cell(128, 1024, True, 2.0, 3.0), _cell(128, 2048, True, 2.0, 3.0),
             _cell(256, 512, False, 1.0, 2.0), _cell(256, 1024, False, 3.0, 2.0),    # loses the longest: None
             _cell(64, 512, False, None, 2.0), _cell(64, 1024, False, 1.0, 2.0)]     # failed short cell
    assert ab.suggest(cells) == {(64, False): 1024, (128, False): 2048, (128, True): 1024, (256, False): None}
    assert ab.suggest(cells, margin=0.4)[(128, False)] == 4096           # 4/3 = 1.33x is not > 1.4x
    cells[2]["impls"]["gluon"]["mismatch"] = "max |out - triton| 0.5"    # fast but wrong: not a win
    assert ab.suggest(cells)[(128, False)] == 4096


def test_ab_variants_parse_into_tile_table_entries():
    ab = _ab()
    from flashport.kernels.attn_fwd_hopper import Tiles
    assert ab.parse_variant("64:128:6:240") == (64, Tiles(128, 6, 240, False))
    d, tiles = ab.parse_variant("128:128:3:232:1")
    assert (d, tiles) == (128, Tiles(128, 3, 232, True)) and ab.variant_name(tiles) == "gluon-n128s3r232ek"
    for bad in ("64:128:6", "64:128:6:240:1:0", "d:128:6:240"):
        with pytest.raises(Exception, match="D:BLOCK_N:STAGES:REGS"):
            ab.parse_variant(bad)


def test_windows_pass_the_gate_with_sq_equal_sk_unless_switched_off(monkeypatch, on_hopper):
    """Sliding windows with Sq == Sk pass the forward's gate by default (its WINDOW variant);
    FLASHPORT_HOPPER_FWD_WINDOW=0 (rollback), or Sq != Sk, leaves them to the Triton kernel."""
    windows = (dict(window=(256, 0)), dict(window=(-1, 64)), dict(window=(100, 37), d=64, s=16384),
               dict(window=(17, 3), d=256, hq=8, hkv=2))
    monkeypatch.setenv("FLASHPORT_HOPPER_FWD_WINDOW", "0")
    for kw in windows:
        spec, q, k, v = _spec(**kw)
        assert "FLASHPORT_HOPPER_{FWD,BWD}_WINDOW=0" in on_hopper.reasons(spec, q, k, v)[0], kw
    monkeypatch.delenv("FLASHPORT_HOPPER_FWD_WINDOW")
    for kw in windows:
        spec, q, k, v = _spec(**kw)
        assert on_hopper.reasons(spec, q, k, v) == [], kw
    spec, q, k, v = _spec(window=(256, 0), s=4096, sk=8192)
    assert "Sq == Sk" in on_hopper.reasons(spec, q, k, v)[0]


def test_two_part_head_dims_pass_the_gate_unless_switched_off(monkeypatch, on_hopper):
    """D=80 and D=96 run as two power-of-two column parts (TILES' split) by default, FLASHPORT_HOPPER_FWD_SPLIT=0
    (rollback) leaves them to the Triton kernel; the launch carries a second set of descriptors for the parts'
    columns."""
    monkeypatch.setenv("FLASHPORT_HOPPER_FWD_SPLIT", "0")
    for d in (80, 96):
        spec, q, k, v = _spec(d=d)
        assert "FLASHPORT_HOPPER_FWD_SPLIT=0" in on_hopper.reasons(spec, q, k, v)[0]
    monkeypatch.delenv("FLASHPORT_HOPPER_FWD_SPLIT")
    for d, parts in ((80, (64, 16)), (96, (64, 32))):
        spec, q, k, v = _spec(d=d, hq=8, hkv=2, causal=True)
        assert on_hopper.reasons(spec, q, k, v) == []
        q, k, v = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))   # descriptors read strides only
        out, lse = torch.empty_like(q), torch.empty(1, 8, q.shape[1])
        grid, args, meta = on_hopper.launch_args(spec, q, k, v, out, lse, lse)
        assert on_hopper.launcher(spec) is on_hopper._launch_split
        assert meta["HEAD_DIM"] == d and grid == (q.shape[1] // on_hopper.TILE, 8)
        assert [a.block_shape[1] for a in args[:8]] == [parts[0]] * 4 + [parts[1]] * 4
    spec, q, k, v = _spec(d=128)
    q, k, v = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
    _, args, meta = on_hopper.launch_args(spec, q, k, v, torch.empty_like(q), None, None)
    assert on_hopper.launcher(spec) is on_hopper._launch
    assert [a.block_shape[1] for a in args[:4]] == [128] * 4 and args[4] is None   # four descriptors, then lse


def test_alibi_passes_the_forward_gate_unless_switched_off(monkeypatch, on_hopper):
    """The forward serves ALiBi slopes by default, FLASHPORT_HOPPER_FWD_ALIBI=0 (rollback) leaves them to the Triton
    kernel, each direction on its own switch; the launch carries the slopes and their batch stride."""
    from flashport.kernels import attn_bwd_hopper
    monkeypatch.setattr(attn_bwd_hopper, "enabled", lambda: True)
    monkeypatch.setattr(attn_bwd_hopper, "_capability", lambda index: (9, 0))
    slopes = torch.rand(2, 8)
    q = torch.empty(2, 1024, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 1024, 2, 128, dtype=torch.bfloat16)
    spec, _ = dense_spec(q, k, k, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=slopes, dropout_p=0.0, deterministic=False, return_lse=False)
    gpu = dataclasses.replace(spec, device=torch.device("cuda", 0))
    monkeypatch.setenv("FLASHPORT_HOPPER_FWD_ALIBI", "0")
    assert "ALiBi" in on_hopper.reasons(gpu, q, k, k)[0]
    assert "ALiBi" not in "".join(attn_bwd_hopper.spec_reasons(gpu))   # the backward's own switch is still on
    monkeypatch.delenv("FLASHPORT_HOPPER_FWD_ALIBI")
    assert on_hopper.reasons(gpu, q, k, k) == []
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD_ALIBI", "0")
    assert "ALiBi" in attn_bwd_hopper.spec_reasons(gpu)[0]
    lse = torch.empty(2, 8, 1024)
    _, args, meta = on_hopper.launch_args(spec, q, k, k, torch.empty_like(q), lse, lse, slopes)
    assert meta["ALIBI"] and args[-2] is not lse and args[-1] == 8
    _, args, meta = on_hopper.launch_args(spec, q, k, k, torch.empty_like(q), lse, lse, slopes[0])
    assert meta["ALIBI"] and args[-1] == 0                     # [Hq] slopes: no batch stride
    with pytest.raises(ValueError, match="alibi slopes"):   # a call with ALiBi launched without its slopes
        on_hopper.launch_args(spec, q, k, k, torch.empty_like(q), lse, lse)

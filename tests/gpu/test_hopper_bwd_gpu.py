"""GPU tier of the Hopper backward (kernels/attn_bwd_hopper.py, Gluon, FlashAttention-3's 5-matmul schedule
with dQ summed by TMA reduce-adds): skipped unless the GPU is an sm_90 part.  The kernel serves a subset of
backward calls inside the `triton` backend (deterministic=False only), so each test checks both that the
call was served by it (or, for the cases it must decline, that it was not) and the gradients under the
conformance tolerance rule."""
from __future__ import annotations

import pytest
import torch

import flashport
from conformance import Case, check_dense, check_served_with, kwargs_of, make_inputs, needs_sm90, served_calls

pytestmark = [pytest.mark.gpu, needs_sm90()]

DEV = "cuda"


@pytest.fixture
def served(monkeypatch):
    """Counts the backward calls the Hopper kernel served.  (Imported here, not at collection: importing
    the kernels before the interpreter tier sets TRITON_INTERPRET would compile them for every tier.)"""
    from flashport.kernels import attn_bwd_hopper
    calls = served_calls(monkeypatch, attn_bwd_hopper, "backward")
    if not attn_bwd_hopper.enabled():
        pytest.skip("Gluon unavailable")
    return calls


SERVED = [
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=128),
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=128, causal=True),
    Case(b=1, sq=384, sk=640, hq=8, hkv=2, d=128),                   # Sq != Sk, GQA
    Case(b=2, sq=256, sk=512, hq=4, hkv=2, d=128),                   # Sq != Sk with B > 1
    Case(b=2, sq=640, sk=256, hq=2, hkv=2, d=128),                   # Sq > Sk
    Case(b=1, sq=1024, sk=1024, hq=4, hkv=1, d=128, causal=True),    # MQA, 8 K/V tiles per head
    Case(b=1, sq=128, sk=128, hq=2, hkv=2, d=128, causal=True, scale=0.3),   # one tile: diagonal only
    # D=64: the same schedule with [64, 32] halves of dQ_j (K's columns split inside a 128-byte swizzle atom)
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=64),
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=64, causal=True),
    Case(b=1, sq=384, sk=640, hq=8, hkv=2, d=64),                    # Sq != Sk, GQA
    Case(b=1, sq=1024, sk=1024, hq=4, hkv=1, d=64, causal=True),     # MQA, 8 K/V tiles per head
    # Ragged lengths (RAGGED): the last tiles reach into the next batch entry's rows or past the tensor
    Case(b=1, sq=200, sk=256, hq=2, hkv=2, d=128),                   # only Sq ragged
    Case(b=2, sq=200, sk=333, hq=4, hkv=2, d=128),                   # both, GQA, B > 1 (no row of the next entry)
    Case(b=2, sq=300, sk=300, hq=2, hkv=2, d=128, causal=True),      # causal: keys past Sk lie past every diagonal
    Case(b=2, sq=1500, sk=1500, hq=4, hkv=4, d=64),                  # Whisper's encoder length
    Case(b=3, sq=129, sk=700, hq=2, hkv=1, d=64),                    # one row past a tile, MQA
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", SERVED, ids=str)
def test_served_calls_conform(case, dtype, served):
    check_dense(None, case.replace(dtype=dtype), DEV, grads=True)
    assert served, "the Hopper backward did not serve this call"


# Every variant (attn_bwd_hopper.VARIANTS) at each head dim it fits, the library's choice or not: their
# synchronisation differs (one dQ buffer: the consumers wait for every drain; a 3-deep ring).  Programs with 2
# Q tiles (causal, last K/V tile; one-tile case), many tiles (Sq > Sk, 8-tile causal MQA) and GQA.
CANDIDATES = [("s2_tma_lse", 128), ("s2_tma_lse", 64), ("s2_tma2_lse", 64), ("s3_tma2_lse", 64)]
CANDIDATE_CASES = [SERVED[1], SERVED[2], SERVED[4], SERVED[5], SERVED[6]]


@pytest.mark.parametrize("variant, d", CANDIDATES)
@pytest.mark.parametrize("case", CANDIDATE_CASES, ids=str)
def test_candidate_variants_conform(case, variant, d, served, monkeypatch):
    from flashport.kernels import attn_bwd_hopper
    spy = attn_bwd_hopper.backward                  # the served fixture's counting wrapper
    monkeypatch.setattr(attn_bwd_hopper, "backward", lambda *a, **kw: spy(*a, **kw, variant=variant))
    dtype = torch.float16 if case.causal and case.hkv == 1 else torch.bfloat16
    check_dense(None, case.replace(dtype=dtype, d=d), DEV, grads=True)
    assert served, f"the Hopper backward ({variant}) did not serve this call"


# Sliding windows (FLASHPORT_HOPPER_BWD_WINDOW=1, Sq == Sk): each K/V tile walks only the Q tiles of its band,
# and masks those crossing the band's edges.  Left-only, right-only and two-sided bands; bands narrower than a
# tile, wider than the sequence, ragged lengths, GQA.
WINDOWS = [
    Case(b=2, sq=512, sk=512, hq=4, hkv=4, d=128, window=(64, 0)),
    Case(b=1, sq=1024, sk=1024, hq=4, hkv=2, d=128, window=(200, 0)),     # GQA, a band not a tile multiple
    Case(b=1, sq=640, sk=640, hq=2, hkv=2, d=64, window=(100, 37)),      # two-sided
    Case(b=2, sq=384, sk=384, hq=2, hkv=1, d=64, window=(-1, 5)),        # right bound only, MQA
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, window=(300, 300)),      # a window kind that hides nothing (300 > S)
    Case(b=2, sq=300, sk=300, hq=2, hkv=2, d=128, window=(17, 3)),       # ragged, narrower than a tile
    Case(b=1, sq=1500, sk=1500, hq=4, hkv=4, d=64, window=(511, 0)),     # ragged, several tiles
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", WINDOWS, ids=str)
def test_window_calls_conform(case, dtype, served, monkeypatch):
    check_served_with({"FLASHPORT_HOPPER_BWD_WINDOW": "1"}, case.replace(dtype=dtype), served, monkeypatch)


# ALiBi (FLASHPORT_HOPPER_BWD_ALIBI=1): P recomputed with -slope * |i + Sk - Sq - j| from the lse of either forward
# (the Gluon one where FLASHPORT_HOPPER_FWD_ALIBI=1 too, else the Triton one): per-head and per-batch slopes, causal,
# Sq != Sk, ragged lengths, GQA.
ALIBI = [
    (Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=128, causal=True, alibi="head"), "1"),
    (Case(b=2, sq=384, sk=640, hq=4, hkv=2, d=128, alibi="batch_head"), "0"),
    (Case(b=1, sq=512, sk=512, hq=4, hkv=1, d=64, causal=True, alibi="batch_head"), "1"),
    (Case(b=2, sq=300, sk=300, hq=2, hkv=2, d=64, causal=True, alibi="head"), "0"),     # ragged: Triton forward
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case, fwd_alibi", ALIBI, ids=str)
def test_alibi_calls_conform(case, fwd_alibi, dtype, served, monkeypatch):
    check_served_with({"FLASHPORT_HOPPER_BWD_ALIBI": "1", "FLASHPORT_HOPPER_FWD_ALIBI": fwd_alibi},
                      case.replace(dtype=dtype), served, monkeypatch)


# Head dims 80 and 96 (FLASHPORT_HOPPER_BWD_SPLIT=1) as two column parts: S^T and dP^T chained over the parts, dK /
# dV an accumulator per part, dQ_j's parts from one warpgroup each (reduce-adds through two descriptors).  Whole
# and ragged tiles, causal, Sq != Sk, GQA / MQA, with the Gluon forward's split (FLASHPORT_HOPPER_FWD_SPLIT) or the
# Triton forward; windows and ALiBi through the split.
SPLIT = [
    (Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=96), {}),
    (Case(b=2, sq=512, sk=512, hq=4, hkv=2, d=96, causal=True), {"FLASHPORT_HOPPER_FWD_SPLIT": "1"}),
    (Case(b=1, sq=384, sk=640, hq=8, hkv=2, d=80), {}),                                   # Sq != Sk, GQA
    (Case(b=1, sq=1024, sk=1024, hq=4, hkv=1, d=80, causal=True), {"FLASHPORT_HOPPER_FWD_SPLIT": "1"}),   # MQA
    (Case(b=2, sq=300, sk=300, hq=2, hkv=2, d=96, causal=True), {}),                      # ragged
    (Case(b=1, sq=1500, sk=1500, hq=4, hkv=4, d=80), {}),                                 # ragged, several tiles
    (Case(b=1, sq=640, sk=640, hq=2, hkv=2, d=96, window=(100, 37)), {"FLASHPORT_HOPPER_BWD_WINDOW": "1"}),
    (Case(b=2, sq=256, sk=256, hq=4, hkv=2, d=80, causal=True, alibi="head"), {"FLASHPORT_HOPPER_BWD_ALIBI": "1"}),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case, switches", SPLIT, ids=str)
def test_split_head_dims_conform(case, switches, dtype, served, monkeypatch):
    check_served_with({"FLASHPORT_HOPPER_BWD_SPLIT": "1", **switches}, case.replace(dtype=dtype), served, monkeypatch)


# FLASHPORT_HOPPER_BWD_DQ_FIRST=1: dQ_j's matmul issued before dK's, dK retired after dQ_j's store (FA3's order).
# Every head dim, causal, Sq != Sk, GQA / MQA, ragged, one Q tile, windows, ALiBi, split head dims.
DQ_FIRST = [(SERVED[i], {}) for i in (1, 2, 4, 5, 6, 8, 14, 15)] + [
    (WINDOWS[2], {"FLASHPORT_HOPPER_BWD_WINDOW": "1"}), (ALIBI[0][0], {"FLASHPORT_HOPPER_BWD_ALIBI": "1"}),
    (SPLIT[1][0], {"FLASHPORT_HOPPER_BWD_SPLIT": "1"}), (SPLIT[4][0], {"FLASHPORT_HOPPER_BWD_SPLIT": "1"})]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case, switches", DQ_FIRST, ids=str)
def test_dq_first_conforms(case, switches, dtype, served, monkeypatch):
    check_served_with({"FLASHPORT_HOPPER_BWD_DQ_FIRST": "1", **switches}, case.replace(dtype=dtype), served, monkeypatch)


# The 128-row Q tile (FLASHPORT_HOPPER_BWD_M128=1: variant m128_s2, D=64 only): one diagonal Q tile per causal K/V
# tile, lse2 / Delta read after their matmuls retire.  Every D=64 case of this tier: causal, Sq != Sk, GQA / MQA,
# ragged, windows, ALiBi.
M128 = [(c, {}) for c in SERVED if c.d == 64] + [
    (c, {"FLASHPORT_HOPPER_BWD_WINDOW": "1"}) for c in WINDOWS if c.d == 64] + [
    (c, {"FLASHPORT_HOPPER_BWD_ALIBI": "1", "FLASHPORT_HOPPER_FWD_ALIBI": f}) for c, f in ALIBI if c.d == 64]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case, switches", M128, ids=str)
def test_m128_tile_conforms(case, switches, dtype, served, monkeypatch):
    check_served_with({"FLASHPORT_HOPPER_BWD_M128": "1", **switches}, case.replace(dtype=dtype), served, monkeypatch)


# FLASHPORT_HOPPER_BWD_GROUP_LOOP=1: under GQA one program per K/V head walks its group's query heads, dK / dV summed
# in registers and written once.  Every GQA / MQA case of this tier: causal, Sq != Sk, ragged, windows, ALiBi (per-head
# slopes change inside a program), split head dims, the 128-row tile.
GROUP_LOOP = [(c, {}) for c in SERVED if c.hq != c.hkv] + [
    (c, {"FLASHPORT_HOPPER_BWD_WINDOW": "1"}) for c in WINDOWS if c.hq != c.hkv] + [
    (c, {"FLASHPORT_HOPPER_BWD_ALIBI": "1", "FLASHPORT_HOPPER_FWD_ALIBI": f}) for c, f in ALIBI if c.hq != c.hkv] + [
    (c, {"FLASHPORT_HOPPER_BWD_SPLIT": "1", **sw}) for c, sw in SPLIT if c.hq != c.hkv] + [
    (c, {"FLASHPORT_HOPPER_BWD_M128": "1"}) for c in SERVED if c.hq != c.hkv and c.d == 64]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case, switches", GROUP_LOOP, ids=str)
def test_group_loop_conforms(case, switches, dtype, served, monkeypatch):
    check_served_with({"FLASHPORT_HOPPER_BWD_GROUP_LOOP": "1", **switches}, case.replace(dtype=dtype), served,
                      monkeypatch)


DECLINED = [
    Case(b=2, sq=256, sk=256, hq=4, hkv=2, d=128, causal=True, deterministic=True),   # unordered dQ sums: never
    Case(b=1, sq=100, sk=256, hq=2, hkv=2, d=128),                   # shorter than one tile
    Case(b=1, sq=256, sk=384, hq=2, hkv=2, d=128, causal=True),      # causal with Sq != Sk
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, noncontig=True),   # strided: no TMA view
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=72),
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, softcap=5.0),
]


@pytest.mark.parametrize("case", DECLINED, ids=str)
def test_declined_calls_run_the_triton_kernels(case, served):
    check_dense(None, case.replace(dtype=torch.bfloat16), DEV, grads=True)
    assert not served


ROLLED_BACK = [   # served by default; each rollback switch hands its calls to the Triton kernels
    (Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=96), "FLASHPORT_HOPPER_BWD_SPLIT"),
    (Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=64, window=(64, 0)), "FLASHPORT_HOPPER_BWD_WINDOW"),
    (Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, alibi="head"), "FLASHPORT_HOPPER_BWD_ALIBI"),
]


@pytest.mark.parametrize("case, switch", ROLLED_BACK, ids=str)
def test_rolled_back_calls_run_the_triton_kernels(case, switch, served, monkeypatch):
    monkeypatch.setenv(switch, "0")
    check_dense(None, case.replace(dtype=torch.bfloat16), DEV, grads=True)
    assert not served


def _grads(q, k, v, do, dlse, kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flashport.attention(*leaves, **kw)
    return torch.autograd.grad((out.float() * do.float()).sum() + (lse * dlse).sum(), leaves)


def test_agreement_with_the_triton_kernels_and_switch_off(served, monkeypatch):
    """Same gradients as the Triton kernels (with an lse gradient: dlse folds into Delta); dK, dV carry no
    atomics, so they repeat bit for bit; FLASHPORT_HOPPER_BWD=0 rolls back to the Triton kernels."""
    case = Case(b=2, sq=512, sk=512, hq=8, hkv=2, d=128, causal=True, dtype=torch.bfloat16)
    q, k, v, do, slopes = make_inputs(case, DEV)
    dlse = torch.randn(case.b, case.hq, case.sq, device=DEV)
    kw = dict(kwargs_of(case, slopes), backend=None, return_lse=True)
    got = _grads(q, k, v, do, dlse, kw)
    again = _grads(q, k, v, do, dlse, kw)
    assert len(served) == 2
    assert torch.equal(got[1], again[1]) and torch.equal(got[2], again[2])
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD", "0")
    ref = _grads(q, k, v, do, dlse, kw)
    assert len(served) == 2                                         # rolled back to the Triton kernels
    for name, a, r in zip(("dq", "dk", "dv"), got, ref):
        scale = r.float().abs().max().item()
        assert (a.float() - r.float()).abs().max().item() <= 2e-2 * scale, name


def test_deterministic_true_is_reproducible(served):
    case = Case(b=1, sq=512, sk=512, hq=4, hkv=4, d=128, dtype=torch.bfloat16)
    q, k, v, do, slopes = make_inputs(case, DEV)
    dlse = torch.zeros(case.b, case.hq, case.sq, device=DEV)
    kw = dict(kwargs_of(case, slopes), backend=None, return_lse=True, deterministic=True)
    first, second = _grads(q, k, v, do, dlse, kw), _grads(q, k, v, do, dlse, kw)
    assert not served
    assert all(torch.equal(a, b) for a, b in zip(first, second))

"""GPU tier of the Hopper forward (kernels/attn_fwd_hopper.py, Gluon, FlashAttention-3 schedule): skipped
unless the GPU is an sm_90 part.  The kernel serves a subset of calls inside the `triton` backend, so
each test checks both that the call was served by it (or, for the cases it must decline, that it was
not) and the result under the conformance tolerance rule, gradients included (the backward reads the
lse2 this kernel writes)."""
from __future__ import annotations

import pytest
import torch

import flashport
from conformance import Case, check_dense, check_served_with, kwargs_of, make_inputs, needs_sm90, served_calls

pytestmark = [pytest.mark.gpu, needs_sm90()]

DEV = "cuda"


@pytest.fixture
def served(monkeypatch):
    """Counts the calls the Hopper kernel served.  (Imported here, not at collection: importing the
    kernels before the interpreter tier sets TRITON_INTERPRET would compile them for every tier.)"""
    from flashport.kernels import attn_fwd_hopper
    # Short shapes keep the float64 reference cheap; the length floor is a speed choice (tested below).
    monkeypatch.setattr(attn_fwd_hopper, "MIN_KEYS", dict.fromkeys(attn_fwd_hopper.TILES, 0))
    monkeypatch.setattr(attn_fwd_hopper, "MIN_KEYS_CAUSAL", dict.fromkeys(attn_fwd_hopper.TILES, 0))
    calls = served_calls(monkeypatch, attn_fwd_hopper, "forward")
    if not attn_fwd_hopper.enabled():
        pytest.skip("Gluon unavailable")
    return calls


SERVED = [
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=128),
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=128, causal=True),
    Case(b=1, sq=384, sk=640, hq=8, hkv=2, d=128),                   # Sq != Sk, GQA
    Case(b=2, sq=256, sk=512, hq=4, hkv=2, d=128),                   # Sq != Sk with B > 1: b*Sq vs b*Sk rows
    Case(b=1, sq=1024, sk=1024, hq=4, hkv=1, d=128, causal=True),    # MQA, 8 causal tiles per head
    Case(b=1, sq=128, sk=128, hq=2, hkv=2, d=128, causal=True, scale=0.3),
    # D=64: BLOCK_N = 128, a 4-stage ring (8 key tiles wrap it twice)
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=64),
    Case(b=2, sq=1024, sk=1024, hq=4, hkv=2, d=64, causal=True),    # GQA
    Case(b=2, sq=384, sk=640, hq=6, hkv=2, d=64),                   # Sq != Sk, GQA
    # D=256: BLOCK_N = 64, so each 128-row Q tile's diagonal spans two key tiles (masked in each warpgroup's
    # last tile; the first warpgroup skips the program's last one) and a 2-stage ring wraps often
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=256),
    Case(b=2, sq=384, sk=384, hq=4, hkv=2, d=256, causal=True),     # GQA, 3 Q tiles: 2, 4 and 6 key tiles
    Case(b=1, sq=128, sk=128, hq=2, hkv=2, d=256, causal=True),     # one program: the diagonal only
    Case(b=2, sq=256, sk=640, hq=8, hkv=2, d=256),                  # Sq != Sk, GQA
]


def plan(case):
    """The Gluon forward's plan for a training call: backend=None, except at D=256 without a window, where static
    priority gives training calls to cuDNN on Hopper (backend/triton.py: cudnn_first), so the pair is named."""
    return "gluon/triton" if case.d == 256 and case.window == (-1, -1) else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", SERVED, ids=str)
def test_served_calls_conform(case, dtype, served):
    check_dense(plan(case), case.replace(dtype=dtype), DEV, grads=True)
    assert served, "the Hopper kernel did not serve this call"


# FLASHPORT_HOPPER_FWD_PIN=1: the same kernel with a shared-memory store of the row sums before each wait for P V
# (a scheduling change only); every head dim, causal and not, Sq != Sk, GQA, a window.
PINNED = [(SERVED[i], {}) for i in (1, 2, 4, 5, 7, 9, 10)] + [
    (Case(b=1, sq=1024, sk=1024, hq=4, hkv=2, d=128, window=(200, 0)), {"FLASHPORT_HOPPER_FWD_WINDOW": "1"}),
    (Case(b=2, sq=512, sk=512, hq=4, hkv=2, d=96, causal=True), {"FLASHPORT_HOPPER_FWD_SPLIT": "1"})]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case, switches", PINNED, ids=str)
def test_pinned_wait_conforms(case, switches, dtype, served, monkeypatch):
    check_served_with({"FLASHPORT_HOPPER_FWD_PIN": "1", **switches}, case.replace(dtype=dtype), served, monkeypatch,
                      backend=plan(case))


# FLASHPORT_HOPPER_FWD_PINGPONG=1 (with and without the pin): the consumer warpgroups take turns issuing their
# matmuls through two mbarriers; a wrong parity or count hangs the kernel (the tier's time limit shows it) or
# reorders nothing.  One key tile (tile 0 and the last P V only), many, causal, windows, GQA, split head dims; D=256
# keeps it off (its warpgroups issue different numbers of matmul groups under causal).
PINGPONG = [(SERVED[i], {}) for i in (1, 4, 5, 7, 8, 10)] + [
    (SERVED[0], {"FLASHPORT_HOPPER_FWD_PIN": "1"}), (SERVED[2], {"FLASHPORT_HOPPER_FWD_PIN": "1"}),
    (Case(b=1, sq=1024, sk=1024, hq=4, hkv=2, d=128, window=(200, 0)), {"FLASHPORT_HOPPER_FWD_WINDOW": "1"}),
    (Case(b=2, sq=512, sk=512, hq=4, hkv=2, d=80, causal=True), {"FLASHPORT_HOPPER_FWD_SPLIT": "1"})]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case, switches", PINGPONG, ids=str)
def test_pingpong_conforms(case, switches, dtype, served, monkeypatch):
    check_served_with({"FLASHPORT_HOPPER_FWD_PINGPONG": "1", **switches}, case.replace(dtype=dtype), served,
                      monkeypatch, backend=plan(case))


# Sliding windows (FLASHPORT_HOPPER_FWD_WINDOW=1, Sq == Sk): each Q tile's ring holds only its band's key tiles,
# masked where a tile crosses the band's edge for a warpgroup; rows whose first tiles hold no visible key keep
# p = alpha = 0.  Left-only, right-only, two-sided, narrower than a key tile, wider than the sequence; GQA.
WINDOWS = [
    Case(b=2, sq=512, sk=512, hq=4, hkv=4, d=128, window=(64, 0)),
    Case(b=1, sq=1024, sk=1024, hq=4, hkv=2, d=128, window=(200, 0)),
    Case(b=1, sq=640, sk=640, hq=2, hkv=2, d=64, window=(100, 37)),
    Case(b=2, sq=384, sk=384, hq=2, hkv=1, d=64, window=(-1, 5)),
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, window=(300, 300)),       # a window kind that hides nothing (300 > S)
    Case(b=2, sq=512, sk=512, hq=4, hkv=2, d=256, window=(17, 3)),        # BLOCK_N = 64, a narrow band
    Case(b=1, sq=768, sk=768, hq=2, hkv=2, d=256, window=(300, 130)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", WINDOWS, ids=str)
def test_window_calls_conform(case, dtype, served, monkeypatch):
    check_served_with({"FLASHPORT_HOPPER_FWD_WINDOW": "1"}, case.replace(dtype=dtype), served, monkeypatch,
                      backend=plan(case))


# Head dims that are not powers of two (FLASHPORT_HOPPER_FWD_SPLIT=1): two column parts, 64 + 16 and 64 + 32, in
# every operand, chained wgmma for S and an accumulator per part; causal, windows, GQA and a 3-stage ring wrapping.
SPLIT = [
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=96),
    Case(b=2, sq=512, sk=512, hq=4, hkv=2, d=96, causal=True),
    Case(b=1, sq=384, sk=896, hq=6, hkv=2, d=96),                    # Sq != Sk, GQA
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=80),
    Case(b=1, sq=1024, sk=1024, hq=4, hkv=1, d=80, causal=True),     # MQA, 8 causal tiles per head
    Case(b=1, sq=512, sk=512, hq=2, hkv=2, d=96, window=(100, 20)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", SPLIT, ids=str)
def test_split_head_dims_conform(case, dtype, served, monkeypatch):
    flashport.reset_stats()
    check_served_with({"FLASHPORT_HOPPER_FWD_SPLIT": "1", "FLASHPORT_HOPPER_FWD_WINDOW": "1"},
                      case.replace(dtype=dtype), served, monkeypatch)
    # the backward pairs with the Triton kernels, never blockwise (PyTorch ops tile by tile: dispatch.options ranks it
    # last on a GPU)
    assert not flashport.stats().get("blockwise", {}).get("backward"), flashport.stats()


# ALiBi (FLASHPORT_HOPPER_FWD_ALIBI=1): the Gluon forward adds -slope * |i + Sk - Sq - j| in the log2 domain, and
# the Triton backward recomputes P with the same formula from the lse it wrote.  Slopes per head and per batch
# entry and head; causal, Sq != Sk (bottom-right), a two-part head dim, a window.
ALIBI = [
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=128, causal=True, alibi="head"),
    Case(b=2, sq=384, sk=640, hq=4, hkv=2, d=128, alibi="batch_head"),
    Case(b=1, sq=512, sk=512, hq=4, hkv=4, d=64, causal=True, alibi="head"),
    Case(b=2, sq=256, sk=256, hq=4, hkv=2, d=80, causal=True, alibi="batch_head"),
    Case(b=1, sq=512, sk=512, hq=2, hkv=2, d=96, causal=True, alibi="head"),
    Case(b=1, sq=512, sk=512, hq=2, hkv=2, d=128, window=(100, 0), alibi="head"),
    Case(b=2, sq=384, sk=896, hq=4, hkv=2, d=96, alibi="batch_head"),     # two parts, Sq != Sk
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ALIBI, ids=str)
def test_alibi_calls_conform(case, dtype, served, monkeypatch):
    switches = ("FLASHPORT_HOPPER_FWD_ALIBI", "FLASHPORT_HOPPER_FWD_SPLIT", "FLASHPORT_HOPPER_FWD_WINDOW")
    check_served_with(dict.fromkeys(switches, "1"), case.replace(dtype=dtype), served, monkeypatch,
                      backend=plan(case))


DECLINED = [
    Case(b=1, sq=200, sk=256, hq=2, hkv=2, d=128),                   # not a multiple of 128
    Case(b=1, sq=256, sk=384, hq=2, hkv=2, d=128, causal=True),      # causal with Sq != Sk
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, noncontig=True),   # strided: no TMA view
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=72),                    # a head dim without tiles
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, dv=64),            # q/k and v head dims differ
    Case(b=1, sq=256, sk=320, hq=2, hkv=2, d=256),                   # Sk not a multiple of 128
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, softcap=5.0),
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=256, alibi="head"),     # ALiBi at D=256 (its registers would spill)
]


@pytest.mark.parametrize("case", DECLINED, ids=str)
def test_declined_calls_run_the_triton_kernel(case, served):
    check_dense(None, case.replace(dtype=torch.bfloat16), DEV, grads=False)
    assert not served


ROLLED_BACK = [   # served by default; each rollback switch hands its calls to the Triton kernel
    (Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=96), "FLASHPORT_HOPPER_FWD_SPLIT"),
    (Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, window=(64, 0)), "FLASHPORT_HOPPER_FWD_WINDOW"),
    (Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, alibi="head"), "FLASHPORT_HOPPER_FWD_ALIBI"),
]


@pytest.mark.parametrize("case, switch", ROLLED_BACK, ids=str)
def test_rolled_back_calls_run_the_triton_kernel(case, switch, served, monkeypatch):
    monkeypatch.setenv(switch, "0")
    check_dense(None, case.replace(dtype=torch.bfloat16), DEV, grads=False)
    assert not served


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_served_at_the_shipped_length_floor(causal, d, monkeypatch):
    """With the shipped gate (no lowered floor): the shortest served call conforms, forward and lse."""
    from flashport.kernels import attn_fwd_hopper
    if not attn_fwd_hopper.enabled():
        pytest.skip("Gluon unavailable")
    s = attn_fwd_hopper.min_keys(d, causal)
    if s is None:
        pytest.skip(f"not served at D={d} causal={causal}")
    calls = []
    real = attn_fwd_hopper.forward

    def spy(*a, **kw):
        result = real(*a, **kw)
        calls.append(result is not None)
        return result
    monkeypatch.setattr(attn_fwd_hopper, "forward", spy)
    check_dense(None, Case(b=1, sq=s, sk=s, hq=2, hkv=1, d=d, causal=causal, dtype=torch.bfloat16), DEV,
                grads=False)
    assert calls and all(calls)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_short_sequences_stay_on_the_triton_kernel(d):
    from flashport.kernels import attn_fwd_hopper
    from flashport.spec import dense_spec
    for causal in (False, True):
        sk = attn_fwd_hopper.min_keys(d, causal)
        for s in ((sk - 128, sk) if sk is not None else (16384,)):
            q = torch.empty(1, s, 2, d, device=DEV, dtype=torch.bfloat16)
            spec, _ = dense_spec(q, q, q, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                 alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
            assert bool(attn_fwd_hopper.reasons(spec, q, q, q)) == (sk is None or s < sk), (causal, s)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_switch_off_and_agreement_with_the_triton_kernel(d, served, monkeypatch):
    case = Case(b=2, sq=512, sk=512, hq=8, hkv=2, d=d, causal=True, dtype=torch.bfloat16)
    q, k, v, _, slopes = make_inputs(case, DEV)
    kw = dict(kwargs_of(case, slopes), backend=None, return_lse=True)
    out, lse = flashport.attention(q, k, v, **kw)
    again, _ = flashport.attention(q, k, v, **kw)
    assert len(served) == 2 and torch.equal(out, again)             # deterministic
    monkeypatch.setenv("FLASHPORT_HOPPER_FWD", "0")
    ref, ref_lse = flashport.attention(q, k, v, **kw)
    assert len(served) == 2                                         # rolled back to the Triton kernel
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)

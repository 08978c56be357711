"""GPU tier of the `triton` backend (skipped without CUDA): conformance at realistic sizes in bf16 and
fp16 with gradients, bitwise reproducibility, int64 offsets past 2**31 elements, and the memory
of a 128K-token causal forward + backward."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import flashport  # noqa: E402
from conformance import Case, check_dense, make_inputs  # noqa: E402
from flashport.backend.reference import materialized_attention  # noqa: E402
from flashport.check import GridCase, assert_within_rule, check_case, magnitude  # noqa: E402
from flashport.dropout import dense_keep_mask, draw_rng_state  # noqa: E402

DEV = "cuda"


@pytest.fixture(autouse=True)
def _triton_available():
    info = {b.name: b for b in flashport.backends()}["triton"]
    if not info.available:
        pytest.skip("triton backend unavailable: " + "; ".join(info.reasons))


GRID = [
    Case(b=2, sq=1023, sk=1023, hq=4, hkv=2, d=64, causal=True),
    Case(b=1, sq=1024, sk=1024, hq=2, hkv=2, d=128, dv=64),
    Case(b=1, sq=513, sk=1024, hq=4, hkv=1, d=128, window=(200, 17)),
    Case(b=1, sq=257, sk=1023, hq=2, hkv=2, d=256, causal=True),
    Case(b=1, sq=1000, sk=777, hq=2, hkv=1, d=40, alibi="head"),
    Case(b=1, sq=333, sk=1024, hq=3, hkv=1, d=80, softcap=10.0, causal=True),
    Case(b=2, sq=255, sk=300, hq=2, hkv=2, d=96, noncontig=True),
    Case(b=1, sq=127, sk=511, hq=2, hkv=1, d=192, window=(64, 64), alibi="batch_head"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GRID, ids=str)
def test_conformance(case, dtype):
    check_dense("triton", case.replace(dtype=dtype), device=DEV)


def test_fp32_ieee():
    check_dense("triton", Case(b=1, sq=300, sk=200, hq=2, hkv=1, d=64, causal=True), device=DEV)


@pytest.mark.parametrize("name", ["tiles-causal-d128", "tiles-d256", "varlen-tiles"])
def test_check_grid_gpu_cases(name):
    case = next(c for c in flashport.check.grid(torch.device(DEV)) if c.name == name)
    r = check_case("triton", case, torch.bfloat16, DEV)
    assert r.status == "PASS" and "dq dk dv" in r.checked, r


def test_varlen_poisoned_padding():
    case = GridCase("varlen-gpu", kind="varlen", hq=4, hkv=2, d=64, window=(100, 3), softcap=20.0,
                    seqs=((300, 200), (0, 17), (1, 1), (700, 700), (33, 0)), tail=7)
    r = check_case("triton", case, torch.float16, DEV)
    assert r.status == "PASS" and "dq dk dv" in r.checked, r


def test_dropout_uses_the_shared_mask():
    case = Case(b=2, sq=200, sk=257, hq=4, hkv=2, d=64, causal=True, dtype=torch.float16)
    q, k, v, do, _ = make_inputs(case, DEV)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    out = flashport.attention(*leaves, causal=True, dropout_p=0.2, backend="triton")
    grads = torch.autograd.grad(out, leaves, do)
    torch.manual_seed(7)
    keep = dense_keep_mask(draw_rng_state(torch.device(DEV)), 0.2, case.b, case.hq, case.sq, case.sk)
    kw = dict(scale=64 ** -0.5, right=0, keep=keep, dropout_p=0.2)
    ref_l = [t.double().requires_grad_() for t in (q, k, v)]
    low_l = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = materialized_attention(*ref_l, **kw)
    low, _ = materialized_attention(*low_l, compute_dtype=torch.float16, **kw)
    assert_within_rule("dropout out", out, ref, low, torch.float16, 2)
    ref_g = torch.autograd.grad(ref, ref_l, do.double())
    low_g = torch.autograd.grad(low, low_l, do)
    for name, a, r, lo in zip(("dq", "dk", "dv"), grads, ref_g, low_g):
        assert_within_rule(f"dropout {name}", a, r, lo, torch.float16, 3, mag=magnitude(*ref_l, do))


def test_forward_bitwise_repeatable_250x():
    case = Case(b=2, sq=1024, sk=1024, hq=8, hkv=2, d=128, causal=True, dtype=torch.bfloat16)
    q, k, v, _, _ = make_inputs(case, DEV)
    first = flashport.attention(q, k, v, causal=True, backend="triton")
    for _ in range(249):
        assert torch.equal(flashport.attention(q, k, v, causal=True, backend="triton"), first)


def test_deterministic_backward_bitwise_100x():
    case = Case(b=2, sq=1024, sk=1024, hq=8, hkv=2, d=128, causal=True, dtype=torch.bfloat16)
    q, k, v, do, _ = make_inputs(case, DEV)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashport.attention(*leaves, causal=True, deterministic=True, backend="triton")
    first = torch.autograd.grad(out, leaves, do, retain_graph=True)
    for _ in range(99):
        again = torch.autograd.grad(out, leaves, do, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# Walks of at least 128 Q tiles of 64 rows, the shortest q_chunks splits (shorter ones ran slower split: row 77).
FEW_KEYS = [Case(b=2, sq=16384, sk=77, hq=8, hkv=8, d=64, dtype=torch.bfloat16),                # cross-attention
            Case(b=2, sq=16000, sk=4, hq=16, hkv=4, d=128, window=(-1, 12000), dtype=torch.bfloat16)]  # sinks' call


@pytest.mark.parametrize("case", FEW_KEYS, ids=str)
def test_q_chunks_auto_split_is_exact_and_bitwise_repeatable(case, monkeypatch):
    """A few keys against many queries: auto splits each key tile's walk (attn_bwd.q_chunks); the gradients pass the
    rule, repeat bitwise with deterministic=True, and match the unsplit kernel's to float32 summation order."""
    from types import SimpleNamespace

    from flashport.kernels import attn_bwd, tuning
    programs = -(-case.sk // 64) * case.hq * case.b
    if 2 * programs <= attn_bwd._sm_count(torch.cuda.current_device()):   # an H100 / H200: 132 SMs
        assert attn_bwd.q_chunks(SimpleNamespace(seqlen_q=case.sq), tuning.KernelConfig(64, 64, 4, 1),
                                 torch.device(DEV), programs) > 1
    check_dense("triton", case, DEV)
    q, k, v, do, _ = make_inputs(case, DEV)
    kw = dict(window_size=case.window, deterministic=True, backend="triton")
    grads = []
    for chunks in ("auto", "auto", "1"):
        monkeypatch.setenv("FLASHPORT_BWD_Q_CHUNKS", chunks)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grads.append(torch.autograd.grad(flashport.attention(*leaves, **kw), leaves, do))
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    for a, b in zip(grads[0], grads[2]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_merge_backward_kernel_matches_the_pytorch_backward():
    """The merge's backward kernel as compiled for this card (the interpreter tier checks its semantics)."""
    from flashport.kernels.merge import merge_backward_triton
    from flashport.merge import merge_backward_torch
    g = torch.Generator(device=DEV).manual_seed(0)
    outs = [torch.randn(2, 1000, 16, 128, device=DEV, generator=g).to(torch.bfloat16) for _ in range(3)]
    lses = [torch.randn(2, 16, 1000, device=DEV, generator=g) * 3 for _ in range(3)]
    lses[1][0, :, :100] = float("-inf")
    outs[1][0, :100] = float("nan")
    _, lse = flashport.merge_attention_states(outs, lses)
    dout = torch.randn(2, 1000, 16, 128, device=DEV, generator=g).to(torch.bfloat16)
    dlse = torch.randn(2, 16, 1000, device=DEV, generator=g)
    got, want = merge_backward_triton(outs, lses, lse, dout, dlse), merge_backward_torch(outs, lses, lse, dout, dlse)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def test_int64_offsets_past_2_31_elements():
    """q and out hold more than 2**31 elements: rows at the end must be right (forward only)."""
    s, h, d = 2**20 + 128, 16, 128
    assert s * h * d > 2**31
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, s, h, d, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, s, 1, d, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, s, 1, d, device=DEV, dtype=torch.bfloat16, generator=g)
    out, lse = flashport.attention(q, k, v, causal=True, window_size=(255, 0), return_lse=True, backend="triton")
    for start in (0, s - 700):  # first rows and the rows past element 2**31
        k0 = max(start - 255, 0)
        qs, ks, vs = q[:, start:start + 700], k[:, k0:start + 700], v[:, k0:start + 700]
        kw = dict(scale=d ** -0.5, left=255, right=0)
        ref, ref_lse = materialized_attention(qs, ks, vs, **kw)
        low, low_lse = materialized_attention(qs, ks, vs, compute_dtype=torch.bfloat16, **kw)
        assert_within_rule(f"out@{start}", out[:, start:start + 700], ref, low, torch.bfloat16, 2)
        assert_within_rule(f"lse@{start}", lse[:, :, start:start + 700], ref_lse, low_lse, torch.bfloat16, 2)
    del q, k, v, out


def test_long_causal_memory_is_linear():
    """S = 131072 causal fwd + bwd: peak memory within 1.3x of inputs + outputs + gradients."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    b, s, h, d = 1, 131072, 16, 128
    q, k, v, do = (torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = flashport.attention(*leaves, causal=True, backend="triton")
    dq, dk, dv = torch.autograd.grad(out, leaves, do)
    torch.cuda.synchronize()
    tensors = (q, k, v, do, out, dq, dk, dv)
    needed = sum(t.numel() * t.element_size() for t in tensors)
    peak = torch.cuda.max_memory_allocated() - base
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    assert peak <= 1.3 * needed, f"peak {peak / 2**30:.2f} GiB > 1.3 x {needed / 2**30:.2f} GiB"
    # spot-check the last rows against the reference (they see all 131072 keys)
    qs = q[:, -64:].detach()
    ref, _ = materialized_attention(qs, k.detach(), v.detach(), scale=d ** -0.5, right=0)
    low, _ = materialized_attention(qs, k.detach(), v.detach(), scale=d ** -0.5, right=0,
                                    compute_dtype=torch.bfloat16)
    assert_within_rule("out tail", out[:, -64:], ref, low, torch.bfloat16, 2)

"""GPU tier of bad index contents (issue [5]; skipped without CUDA).  Without FLASHPORT_CHECKS=1 nothing
reads cu_seqlens / cache_seqlens / block_table on the host: out-of-range contents are clamped on the
device, the call returns, flashport.check_errors() raises DeviceError naming the argument, and the CUDA
context stays usable (a device-side assert would fail every later CUDA call of the process).  Run under
compute-sanitizer memcheck too (results/ has the log): no access outside the tensors."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import flashport  # noqa: E402

DEV = "cuda"


@pytest.fixture(autouse=True)
def _no_host_checks(monkeypatch):
    monkeypatch.delenv("FLASHPORT_CHECKS", raising=False)
    flashport.check_errors()   # nothing left over from an earlier test
    yield


def _context_alive():
    torch.cuda.synchronize()
    x = torch.arange(1024, device=DEV, dtype=torch.float32)
    assert x.sum().item() == 1023 * 1024 / 2


def _raises(name):
    with pytest.raises(flashport.DeviceError, match=name):
        flashport.check_errors()
    flashport.check_errors()
    _context_alive()


def _paged(g, dtype=torch.bfloat16, blocks=6, page=16, hkv=2, d=64):
    kc = torch.randn(blocks, page, hkv, d, generator=g, device=DEV).to(dtype)
    vc = torch.randn(blocks, page, hkv, d, generator=g, device=DEV).to(dtype)
    return kc, vc


@pytest.mark.parametrize("backend", ["triton", None])
def test_block_table_entry_out_of_range(backend):
    g = torch.Generator(device=DEV).manual_seed(0)
    kc, vc = _paged(g)
    q = torch.randn(2, 1, 4, 64, generator=g, device=DEV).to(torch.bfloat16)
    table = torch.tensor([[0, 1, 2], [3, 1 << 30, -7]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([40, 48], dtype=torch.int32, device=DEV)
    out = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, backend=backend)
    assert torch.isfinite(out.float()).all()
    _raises("block_table")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("backend", ["triton", None])
def test_append_past_capacity(backend, paged):
    g = torch.Generator(device=DEV).manual_seed(1)
    b, hkv, d = 2, 2, 64
    if paged:
        kc, vc = _paged(g)
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEV)   # capacity 32
    else:
        kc = torch.randn(b, 32, hkv, d, generator=g, device=DEV).to(torch.bfloat16)
        vc = torch.randn_like(kc)
        table = None
    untouched = (kc.clone(), vc.clone())
    q = torch.randn(b, 4, 4, d, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(b, 4, hkv, d, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.tensor([30, 1 << 20], dtype=torch.int32, device=DEV)   # 30 + 4 > 32; the second far past it
    out = flashport.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                           backend=backend)
    assert torch.isfinite(out.float()).all()
    _raises("cache_seqlens")
    # What the append did write lies inside entry 0's capacity; everything else is as it was.
    if not paged:
        assert torch.equal(kc[0, 30:], k[0, :2]) and torch.equal(kc[0, :30], untouched[0][0, :30])
        assert torch.equal(kc[1], untouched[0][1]) and torch.equal(vc[1], untouched[1][1])


@pytest.mark.parametrize("backend", ["triton", None])
def test_cu_seqlens_past_the_tensor(backend):
    g = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(300, 4, 64, generator=g, device=DEV).to(torch.bfloat16).requires_grad_()
    k = torch.randn(260, 2, 64, generator=g, device=DEV).to(torch.bfloat16).requires_grad_()
    v = torch.randn(260, 2, 64, generator=g, device=DEV).to(torch.bfloat16).requires_grad_()
    cq = torch.tensor([0, 100, 300], dtype=torch.int32, device=DEV)
    ck = torch.tensor([0, 200, 1 << 28], dtype=torch.int32, device=DEV)
    out = flashport.attention_varlen(q, k, v, cq, ck, 200, 1 << 28, causal=True, backend=backend)
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all() and torch.isfinite(k.grad.float()).all()
    _raises("cu_seqlens_k")


def test_host_checks_still_raise_before_the_launch(monkeypatch):
    monkeypatch.setenv("FLASHPORT_CHECKS", "1")
    g = torch.Generator(device=DEV).manual_seed(3)
    kc, vc = _paged(g)
    before = kc.clone()
    q = torch.randn(1, 1, 4, 64, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(1, 1, 2, 64, generator=g, device=DEV).to(torch.bfloat16)
    table = torch.tensor([[0, 99]], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="block_table"):
        flashport.attention_with_kvcache(q, kc, vc, k, torch.randn_like(k), cache_seqlens=torch.tensor(
            [20], dtype=torch.int32, device=DEV), block_table=table)
    assert torch.equal(kc, before)
    flashport.check_errors()


def test_merge_on_cuda_is_differentiable():
    outs = [torch.randn(1, 5, 2, 8, device=DEV, requires_grad=True) for _ in range(3)]
    lses = [torch.randn(1, 2, 5, device=DEV, requires_grad=True) for _ in range(3)]
    out, lse = flashport.merge_attention_states(outs, lses)
    (out.sum() + lse.sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in outs + lses)

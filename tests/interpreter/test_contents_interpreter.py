"""Bad index contents never leave the tensors (issue [5]): the clamping kernels and the masked KV append of
flashport/kernels/contents.py, run in Triton's interpreter on CPU tensors, flag what they clamp, and
flashport.check_errors() raises DeviceError naming the argument.  (On a GPU they run before every kernel;
tests/gpu/test_contents_gpu.py checks the same calls end to end there, under compute-sanitizer too.)"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

import flashport  # noqa: E402
from flashport import contents  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def _clear_flags():
    contents._flags.clear()
    yield
    contents._flags.clear()


def _raises(*names):
    with pytest.raises(flashport.DeviceError) as e:
        flashport.check_errors()
    for n in names:
        assert n in str(e.value)
    flashport.check_errors()   # cleared by the first read


def test_clamp_varlen_good_contents_unchanged_no_flag():
    from flashport.kernels.contents import clamp_varlen
    cq = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    ck = torch.tensor([0, 5, 9, 9], dtype=torch.int32)
    oq, ok = clamp_varlen(cq, ck, 12, 9, 7, 5)
    assert torch.equal(oq, cq) and torch.equal(ok, ck)
    flashport.check_errors()


@pytest.mark.parametrize("cq,ck,flag", [
    ([0, 3, 40, 10], [0, 5, 9, 9], "cu_seqlens_q"),          # past the tensor, then decreasing
    ([0, 3, 3, 10], [0, -4, 9, 9], "cu_seqlens_k"),          # negative
    ([2, 3, 3, 10], [0, 5, 9, 9], "cu_seqlens_q"),           # does not start at 0
    ([0, 3, 3, 10], [0, 5, 9, 2 ** 31 - 1], "cu_seqlens_k"),  # int32 extreme
])
def test_clamp_varlen_flags_and_clamps(cq, ck, flag):
    from flashport.kernels.contents import clamp_varlen
    cq, ck = torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)
    oq, ok = clamp_varlen(cq, ck, 12, 9, 12, 9)
    assert torch.equal(oq, cq.clamp(0, 12)) and torch.equal(ok, ck.clamp(0, 9))
    _raises(flag)


def test_clamp_varlen_flags_length_past_max_seqlen():
    from flashport.kernels.contents import clamp_varlen
    cq = torch.tensor([0, 3, 11], dtype=torch.int32)
    clamp_varlen(cq, cq.clone(), 11, 11, 7, 8)
    _raises("max_seqlen_q")


def test_clamp_kvcache_lengths_and_used_table_entries():
    from flashport.kernels.contents import clamp_kvcache
    lens = torch.tensor([3, 30, -2], dtype=torch.int32)            # capacity 32: 30 + 4 is past it, -2 negative
    table = torch.tensor([[0, 1, -1, -1], [2, 3, 4, 9], [5, -1, -1, -1]], dtype=torch.int32)   # 6 blocks
    seqlens, bt = clamp_kvcache(lens, 4, 32, table, 6, 8)
    assert seqlens.tolist() == [7, 32, 2]
    assert torch.equal(bt, table.clamp(0, 5))
    _raises("cache_seqlens", "block_table")   # entry 9 of row 1 is in use (32 keys = 4 pages)


def test_clamp_kvcache_unused_table_padding_is_not_an_error():
    from flashport.kernels.contents import clamp_kvcache
    lens = torch.tensor([3, 9], dtype=torch.int32)
    table = torch.tensor([[0, -1, -1], [1, 2, -1]], dtype=torch.int32)    # -1 padding past the used pages
    clamp_kvcache(lens, 1, 24, table, 3, 8)
    flashport.check_errors()


@pytest.mark.parametrize("paged", [False, True])
def test_append_skips_positions_past_capacity_and_bad_pages_and_restores(paged):
    from flashport.kernels.contents import append_kv, restore_kv
    g = torch.Generator().manual_seed(0)
    b, cap, hkv, d, dv, s_new = 3, 16, 2, 8, 12, 3
    page = 4
    if paged:
        table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 99], [7, 8, 9, 10]], dtype=torch.int32)  # 99: out of range
        kc = torch.randn(11, page, hkv, d, generator=g)
        vc = torch.randn(11, page, hkv, dv, generator=g)
    else:
        table = None
        kc = torch.randn(b, cap, hkv, d, generator=g)
        vc = torch.randn(b, cap, hkv, dv, generator=g)
    k, v = torch.randn(b, s_new, hkv, d, generator=g), torch.randn(b, s_new, hkv, dv, generator=g)
    lens = torch.tensor([2, 13, 15], dtype=torch.int32)   # entry 2's last two tokens fall past the capacity
    k0, v0 = kc.clone(), vc.clone()
    saved = append_kv(kc, vc, k, v, lens, table)

    def slot(bi, pos):
        return (int(table[bi, pos // page]), pos % page) if paged else (bi, pos)
    expect_k, expect_v = k0.clone(), v0.clone()
    for bi in range(b):
        for t in range(s_new):
            pos = int(lens[bi]) + t
            if pos >= cap or (paged and int(table[bi, pos // page]) >= kc.shape[0]):
                continue
            expect_k[slot(bi, pos)] = k[bi, t]
            expect_v[slot(bi, pos)] = v[bi, t]
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)
    restore_kv(kc, vc, saved, lens, table)
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


# ----------------------------------------------------------------------------- end to end
# What a GPU call without FLASHPORT_CHECKS=1 does, in the interpreter: the host checks are switched off, so
# the bad contents reach flashport.contents.guard and the kernels.
@pytest.fixture
def no_host_checks(monkeypatch):
    import flashport.spec
    monkeypatch.setattr(flashport.spec, "content_checks_enabled", lambda device: False)


def test_varlen_cu_seqlens_past_the_tensor_end_to_end(no_host_checks):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(10, 2, 16, generator=g, requires_grad=True)
    k = torch.randn(12, 1, 16, generator=g, requires_grad=True)
    v = torch.randn(12, 1, 16, generator=g, requires_grad=True)
    cq = torch.tensor([0, 4, 10], dtype=torch.int32)
    ck = torch.tensor([0, 5, 4000], dtype=torch.int32)     # far past k's 12 rows
    out = flashport.attention_varlen(q, k, v, cq, ck, 6, 4000, backend="triton")
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(k.grad).all()
    _raises("cu_seqlens_k")


def test_paged_block_table_out_of_range_end_to_end(no_host_checks):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 16, generator=g)
    kc, vc = torch.randn(4, 8, 2, 16, generator=g), torch.randn(4, 8, 2, 16, generator=g)
    table = torch.tensor([[0, 1], [2, 1 << 30]], dtype=torch.int32)
    lens = torch.tensor([16, 12], dtype=torch.int32)
    out = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, backend="triton")
    assert torch.isfinite(out).all()
    _raises("block_table")

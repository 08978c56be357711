"""CPU tier of flashport.contents: the PyTorch twins of the clamping kernels (what a GPU without Triton
runs) flag and clamp exactly as tests/interpreter/test_contents_interpreter.py expects of the kernels."""
from __future__ import annotations

import pytest
import torch

import flashport
from flashport import contents
from flashport.kvcache import _slots


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
    flashport.check_errors()


def test_varlen_twin_good_contents_unflagged():
    cq = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    ck = torch.tensor([0, 5, 9, 9], dtype=torch.int32)
    oq, ok = contents.clamp_varlen_torch(cq, ck, 12, 9, 7, 5)
    assert torch.equal(oq, cq) and torch.equal(ok, ck) and oq.dtype == torch.int32
    flashport.check_errors()


@pytest.mark.parametrize("cq,ck,flag", [
    ([0, 3, 40, 10], [0, 5, 9, 9], "cu_seqlens_q"),
    ([0, 3, 3, 10], [0, -4, 9, 9], "cu_seqlens_k"),
    ([2, 3, 3, 10], [0, 5, 9, 9], "cu_seqlens_q"),
])
def test_varlen_twin_flags_and_clamps(cq, ck, flag):
    cq, ck = torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)
    oq, ok = contents.clamp_varlen_torch(cq, ck, 12, 9, 12, 9)
    assert torch.equal(oq, cq.clamp(0, 12)) and torch.equal(ok, ck.clamp(0, 9))
    _raises(flag)


def test_varlen_twin_flags_length_past_max_seqlen():
    cq = torch.tensor([0, 3, 11], dtype=torch.int32)
    contents.clamp_varlen_torch(cq, cq.clone(), 11, 11, 7, 8)
    _raises("max_seqlen_q")


def test_kvcache_twin_lengths_and_used_table_entries():
    lens = torch.tensor([3, 30, -2], dtype=torch.int32)
    table = torch.tensor([[0, 1, -1, -1], [2, 3, 4, 9], [5, -1, -1, -1]], dtype=torch.int32)
    seqlens, bt = contents.clamp_kvcache_torch(lens, 4, 32, table, 6, 8)
    assert seqlens.tolist() == [7, 32, 2]
    assert torch.equal(bt, table.clamp(0, 5))
    _raises("cache_seqlens", "block_table")


def test_kvcache_twin_unused_padding_is_not_an_error():
    lens = torch.tensor([3, 9], dtype=torch.int32)
    table = torch.tensor([[0, -1, -1], [1, 2, -1]], dtype=torch.int32)
    contents.clamp_kvcache_torch(lens, 1, 24, table, 3, 8)
    flashport.check_errors()


def test_append_slots_mark_what_does_not_exist():
    kc = torch.zeros(4, 8, 1, 2)      # 4 pages of 8
    table = torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)
    lens = torch.tensor([14, 6], dtype=torch.int32)
    (blocks, slots), ok = _slots(kc, table, lens, 4)
    # entry 0: positions 14, 15 land, 16, 17 are past its 2 pages; entry 1: 6, 7 land, 8, 9 hit table entry 99
    assert ok.tolist() == [[True, True, False, False], [True, True, False, False]]
    assert blocks[ok].tolist() == [1, 1, 2, 2] and slots[ok].tolist() == [6, 7, 6, 7]

"""The gradient code mod_codegen generates for captured tensors sums the terms of a tile that share an element
before its atomics (common.add_reduced), choosing how from what the traced index depends on.  The sums' values are
checked against float64 in tests/interpreter/test_mods_triton_interpreter.py (test_gradients_into_captured_tensors,
one case per mode); here, which mode each index gets."""
from __future__ import annotations

import inspect
import re

import pytest
import torch

from flashport import mods
from flashport.kernels import mod_codegen

H, N = 4, 9
TABLE, SCALE, PER_KEY, PER_QUERY, PAIR, SUMS = (torch.randn(*shape).requires_grad_()
                                                 for shape in ((H, N), (H,), (1, 1, 1, 64), (64,), (64, 64), (127,)))
BUCKETS = torch.randint(0, N, (127,))


def _bias_reads(t, b, h, i, j):   # attn_bias's reads: a size-1 dimension is indexed with x * 0
    return t[b * 0, h * 0, i * 0, j]


CASES = {
    "relative table: per diagonal": (mods.relative_position(TABLE), TABLE, 4),
    "bucketed distance: per diagonal": (lambda s, b, h, i, j: s + TABLE[h, BUCKETS[j - i + 63]], TABLE, 4),
    "per head: one sum": (lambda s, b, h, i, j: s * SCALE[h], SCALE, 1),
    "per query": (lambda s, b, h, i, j: s + PER_QUERY[i], PER_QUERY, 2),
    "per key (broadcast attn_bias)": (lambda s, b, h, i, j: s + _bias_reads(PER_KEY, b, h, i, j),
                                      PER_KEY, 3),
    "per pair: element by element": (lambda s, b, h, i, j: s + PAIR[i, j], PAIR, 0),
    "per diagonal, a value that varies along it": (lambda s, b, h, i, j: s + TABLE[h, (i - j).clamp(-4, 4) + 4] * i,
                                                    TABLE, 4),
    "distance and query: element by element": (lambda s, b, h, i, j: s + PAIR[i, (i - j).clamp(0, 63)], PAIR, 0),
    "a sum of positions, not a difference": (lambda s, b, h, i, j: s + SUMS[i + j], SUMS, 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_gradient_index_gets_its_reduction(name):
    score_mod, leaf, mode = CASES[name]
    compiled = mod_codegen.compile_mods(score_mod, None, "cpu", grads_for=(leaf,))
    assert not isinstance(compiled, str), compiled
    src = inspect.getsource(getattr(compiled.cap_grad, "fn", compiled.cap_grad))   # jit or interpreted function
    modes = re.findall(r"add_reduced\(.*, (\d)\)\n", src + "\n")
    assert modes == [str(mode)], (name, src)

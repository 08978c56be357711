"""Properties of exact attention, checked with hypothesis on `blockwise` (small tiles, so the
multi-tile paths run): key order does not matter, merging split keys is exact, causality holds."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashport
from flashport.backend import blockwise

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK_M", 8)
    monkeypatch.setattr(blockwise, "BLOCK_N", 8)


shapes = st.fixed_dictionaries(dict(
    b=st.integers(1, 2), sq=st.integers(1, 24), sk=st.integers(1, 40), hkv=st.integers(1, 2),
    group=st.integers(1, 3), d=st.sampled_from([8, 16, 24]), seed=st.integers(0, 2**16),
    softcap=st.sampled_from([0.0, 0.0, 2.0])))


def make(s):
    g = torch.Generator().manual_seed(s["seed"])
    hq = s["hkv"] * s["group"]
    return (torch.randn(s["b"], s["sq"], hq, s["d"], generator=g),
            torch.randn(s["b"], s["sk"], s["hkv"], s["d"], generator=g),
            torch.randn(s["b"], s["sk"], s["hkv"], s["d"], generator=g), g)


@SETTINGS
@given(shapes)
def test_permuting_keys_with_values_changes_nothing(s):
    q, k, v, g = make(s)
    perm = torch.randperm(s["sk"], generator=g)
    out, lse = flashport.attention(q, k, v, softcap=s["softcap"], return_lse=True, backend="blockwise")
    out_p, lse_p = flashport.attention(q, k[:, perm], v[:, perm], softcap=s["softcap"], return_lse=True,
                                       backend="blockwise")
    torch.testing.assert_close(out_p, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_p, lse, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(shapes, st.floats(0.0, 1.0))
def test_merging_two_key_halves_equals_the_whole(s, frac):
    q, k, v, _ = make(s)
    cut = int(frac * s["sk"])  # 0 and sk give an empty part (lse -inf)
    parts = [flashport.attention(q, k[:, a:b], v[:, a:b], softcap=s["softcap"], return_lse=True, backend="blockwise")
             for a, b in ((0, cut), (cut, s["sk"]))]
    out, lse = flashport.merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    whole, whole_lse = flashport.attention(q, k, v, softcap=s["softcap"], return_lse=True, backend="blockwise")
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(shapes, st.integers(0, 40), st.sampled_from([-1, 3]))
def test_causal_rows_never_see_future_keys(s, change_from, left):
    """Changing keys/values at positions >= j0 leaves every row whose diagonal is < j0 bitwise unchanged."""
    q, k, v, g = make(s)
    sq, sk = s["sq"], s["sk"]
    j0 = min(change_from, sk)
    k2, v2 = k.clone(), v.clone()
    k2[:, j0:] = torch.randn(k2[:, j0:].shape, generator=g) * 5
    v2[:, j0:] = torch.randn(v2[:, j0:].shape, generator=g) * 5
    kw = dict(causal=True, window_size=(left, 0), softcap=s["softcap"], backend="blockwise")
    out, out2 = flashport.attention(q, k, v, **kw), flashport.attention(q, k2, v2, **kw)
    rows = [i for i in range(sq) if i + sk - sq < j0]  # row i sees keys j <= i + sk - sq
    assert torch.equal(out[:, rows], out2[:, rows])
    if j0 < sk:  # the last row's diagonal is sk - 1 >= j0: it does see the change
        assert not torch.equal(out[:, -1], out2[:, -1])

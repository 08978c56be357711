"""attention_varlen on `reference` and `blockwise` against per-sequence dense attention on the fp64
reference: zero-length and length-1 sequences, NaN-poisoned padding past cu_seqlens[-1], GQA,
causal with Sq != Sk per sequence, gradients."""
import pytest
import torch

import flashport

BACKENDS = ["reference", "blockwise"]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    from flashport.backend import blockwise
    monkeypatch.setattr(blockwise, "BLOCK_M", 8)
    monkeypatch.setattr(blockwise, "BLOCK_N", 16)


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def packed(lens_q, lens_k, hq=4, hkv=2, d=16, dv=None, pad_q=0, pad_k=0, seed=0):
    """q [sum(lens_q) + pad_q, Hq, D], k/v [sum(lens_k) + pad_k, Hkv, D|Dv], padding poisoned with NaN."""
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq + pad_q, hq, d, generator=g)
    k = torch.randn(tk + pad_k, hkv, d, generator=g)
    v = torch.randn(tk + pad_k, hkv, dv, generator=g)
    q[tq:], k[tk:], v[tk:] = float("nan"), float("nan"), float("nan")
    return q, k, v


def per_sequence(q, k, v, lens_q, lens_k, **kw):
    """Dense fp64 reference, one sequence at a time: (out [tq, Hq, Dv], lse [Hq, tq])."""
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    outs, lses = [], []
    for b in range(len(lens_q)):
        qb = q[cq[b]:cq[b + 1]][None].double()
        kb, vb = k[ck[b]:ck[b + 1]][None].double(), v[ck[b]:ck[b + 1]][None].double()
        slopes = kw.get("alibi_slopes")
        kwb = {**kw, "alibi_slopes": None if slopes is None else slopes[b:b + 1]}
        o, l = flashport.attention(qb, kb, vb, return_lse=True, backend="reference", **kwb)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, 1)


def run_varlen(backend, q, k, v, lens_q, lens_k, **kw):
    return flashport.attention_varlen(q, k, v, cu(lens_q), cu(lens_k), max(lens_q + [0]), max(lens_k + [0]),
                                      return_lse=True, backend=backend, **kw)


CASES = [
    # lens_q, lens_k, keywords
    ([5, 17, 3], [5, 17, 3], dict()),
    ([0, 1, 9, 0, 20], [4, 1, 0, 0, 33], dict(causal=True)),              # zero-length and length-1
    ([7, 30, 2], [19, 11, 40], dict(causal=True)),                         # Sq != Sk per sequence
    ([12, 25], [25, 12], dict(window_size=(6, 2), softcap=3.0)),
    ([9, 18, 1], [21, 18, 5], dict(causal=True, alibi="batch_head")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lens_q,lens_k,kw", CASES, ids=lambda x: str(x).replace(" ", ""))
def test_varlen_matches_per_sequence_dense(backend, lens_q, lens_k, kw):
    kw = dict(kw)
    hq = 4
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.rand(len(lens_q), hq) * 0.3 + 0.05
    q, k, v = packed(lens_q, lens_k, hq=hq, hkv=2, pad_q=3, pad_k=5)
    out, lse = run_varlen(backend, q, k, v, lens_q, lens_k, **kw)
    ref, ref_lse = per_sequence(q, k, v, lens_q, lens_k, **kw)
    tq = sum(lens_q)
    assert out.shape == (tq + 3, hq, 16) and lse.shape == (hq, tq + 3) and lse.dtype == torch.float32
    torch.testing.assert_close(out[:tq], ref.float(), rtol=1e-4, atol=1e-5)
    assert torch.equal(out[tq:], torch.zeros_like(out[tq:])), "rows past cu_seqlens_q[-1] must be zero"
    assert torch.equal(torch.isneginf(lse[:, :tq]), torch.isneginf(ref_lse))
    torch.testing.assert_close(lse[:, :tq], ref_lse.float(), rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[:, tq:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_gradients_gqa(backend):
    lens_q, lens_k = [6, 0, 1, 23], [10, 3, 1, 17]
    q, k, v = packed(lens_q, lens_k, hq=6, hkv=2, dv=8, pad_q=2, pad_k=4, seed=1)
    tq, tk = sum(lens_q), sum(lens_k)
    do = torch.randn(tq + 2, 6, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = run_varlen(backend, *leaves, lens_q, lens_k, causal=True)
    dq, dk, dv = torch.autograd.grad(out, leaves, do)

    ref_leaves = [t[:n].double().requires_grad_() for t, n in zip((q, k, v), (tq, tk, tk))]
    ref, _ = per_sequence(*ref_leaves, lens_q, lens_k, causal=True)
    rq, rk, rv = torch.autograd.grad(ref, ref_leaves, do[:tq].double())
    for got, want, n in ((dq, rq, tq), (dk, rk, tk), (dv, rv, tk)):
        torch.testing.assert_close(got[:n], want.float(), rtol=1e-4, atol=1e-5)
        assert torch.equal(got[n:], torch.zeros_like(got[n:])), "padding must get zero gradient"


@pytest.mark.parametrize("backend", BACKENDS)
def test_poisoned_keys_past_the_end_change_nothing(backend):
    lens_q, lens_k = [4, 9], [7, 13]
    q, k, v = packed(lens_q, lens_k, pad_k=6)
    clean = run_varlen(backend, q, k[:20], v[:20], lens_q, lens_k)[0]
    poisoned = run_varlen(backend, q, k, v, lens_q, lens_k)[0]
    assert torch.equal(clean, poisoned)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_total(backend):
    q, k, v = torch.randn(0, 2, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 8)
    z = torch.zeros(3, dtype=torch.int32)
    out, lse = flashport.attention_varlen(q, k, v, z, z, 0, 0, return_lse=True, backend=backend)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


def test_blockwise_varlen_dropout_matches_reference_mask():
    """Varlen dropout uses (b, h, i, j) with positions inside each sequence: the reference agrees."""
    lens_q, lens_k = [5, 0, 11], [8, 2, 14]
    q, k, v = packed(lens_q, lens_k, hq=2, hkv=1)
    outs = []
    for backend in BACKENDS:
        torch.manual_seed(7)
        outs.append(run_varlen(backend, q, k, v, lens_q, lens_k, dropout_p=0.25)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)

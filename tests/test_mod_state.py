"""mod_state.fingerprint: what a traced mod depends on beyond its code, recorded so that `same` holds exactly while
a re-trace would give the same graph -- Python values by value wherever they live, tensors by identity."""
from __future__ import annotations

import functools

import torch

import flashport
from flashport import mask_rules
from flashport.mod_state import MAX_ENTRIES, fingerprint, same

LIMIT = [5]


def _global_window(b, h, i, j):
    return (i >= j) & (i - j <= LIMIT[0])


class _Cfg:
    def __init__(self, w):
        self.w = w


class _Attn(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.cfg = _Cfg(w)
        self.register_buffer("table", torch.zeros(4))

    def mod(self):
        return lambda b, h, i, j: (i >= j) & (i - j <= self.cfg.w)

    def forward(self, score, b, h, i, j):
        return score + self.table[h]


class _Half:
    def __init__(self, w):
        self.full = w

    @property
    def window(self):
        return self.full // 2


class _Mul:
    def __init__(self, a):
        self.a = a

    def __call__(self, score, b, h, i, j):
        return score * self.a


def _changes(fn, change) -> bool:
    before = fingerprint(fn)
    assert same(before, fingerprint(fn))      # nothing changed: a memo hit, no re-trace
    change()
    return not same(before, fingerprint(fn))


def test_values_changed_in_place_change_the_fingerprint():
    cfg, table = {"w": 3}, [1, 2]
    attn = _Attn(4)
    mul = _Mul(2.0)
    half = _Half(4)

    def default(b, h, i, j, w=[6]):
        return i - j <= w[0]
    cases = [
        (lambda b, h, i, j: i - j <= cfg["w"], lambda: cfg.update(w=4)),
        (lambda b, h, i, j: i - j <= table[1], lambda: table.append(3)),
        (_global_window, lambda: LIMIT.__setitem__(0, 6)),
        (attn.mod(), lambda: setattr(attn.cfg, "w", 5)),                  # self.cfg.w, two attributes down
        (mul, lambda: setattr(mul, "a", 3.0)),                            # a callable object's attribute
        (mul.__call__, lambda: setattr(mul, "a", 4.0)),                   # its bound method
        (default, lambda: default.__defaults__[0].__setitem__(0, 7)),     # a mutable default
        (functools.partial(lambda s, b, h, i, j, c: s * c[0], c=cfg), lambda: cfg.update(w=9)),
        (lambda b, h, i, j: _global_window(b, h, i, j) & (i >= 0), lambda: LIMIT.__setitem__(0, 8)),  # a callee's
        (lambda b, h, i, j: i - j <= half.window, lambda: setattr(half, "full", 9)),   # a property over other state
    ]
    for n, (fn, change) in enumerate(cases):
        assert _changes(fn, change), n


def test_what_no_trace_reads_keeps_the_fingerprint():
    """Tensor values (loaded at run time), attributes the code does not name, and a new lambda of the same code over
    equal values are the same fingerprint."""
    attn = _Attn(4)
    mod = attn.mod()
    assert not _changes(mod, lambda: attn.table.add_(1.0))
    assert not _changes(attn, lambda: attn.table.add_(1.0))             # nn.Module forward reading a buffer
    assert not _changes(mod, lambda: setattr(attn, "unrelated", 1))
    assert same(fingerprint(attn.mod()), fingerprint(attn.mod()))      # a new lambda over the same module
    t = torch.zeros(3)

    def make(w):
        return lambda b, h, i, j: (i - j <= w) & (t[h] == 0)
    assert same(fingerprint(make(3)), fingerprint(make(3)))
    assert not same(fingerprint(make(3)), fingerprint(make(4)))
    assert not _changes(make(3), lambda: t.fill_(2.0))


def test_rebound_tensors_and_new_shapes_change_the_fingerprint():
    holder = {"t": torch.zeros(3)}
    mod = lambda s, b, h, i, j: s + holder["t"][h]   # noqa: E731
    assert _changes(mod, lambda: holder.update(t=torch.zeros(3)))
    assert _changes(mod, lambda: holder["t"].resize_(5))


def test_a_container_past_the_limit_never_matches():
    big = list(range(MAX_ENTRIES + 1))
    fn = lambda b, h, i, j: i - j <= big[0]   # noqa: E731
    assert not same(fingerprint(fn), fingerprint(fn))
    small = big[:MAX_ENTRIES]
    fn = lambda b, h, i, j: i - j <= small[0]  # noqa: E731
    assert same(fingerprint(fn), fingerprint(fn))


def test_the_band_memo_follows_a_modules_window():
    """The nn.Module pattern: a lambda over self whose window changes between calls is read afresh, and
    backend=None runs the new window (it ran the first one's before)."""
    attn = _Attn(2)
    mod = attn.mod()
    assert mask_rules.band_of(mod) == ("band", 2, 0)
    attn.cfg.w = 9
    assert mask_rules.band_of(mod) == ("band", 9, 0)
    g = torch.Generator().manual_seed(28)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g) for _ in range(3))
    attn.cfg.w = 3
    out = flashport.attention(q, k, v, mask_mod=mod)
    assert torch.equal(out, flashport.attention(q, k, v, window_size=(3, 0)))

"""Selection (issue [6]): mixed forward / backward plans, strict names, the measured table and its key.
The case matrix comes from the backends' own declarations."""
import json
import warnings

import pytest
import torch

import flashport
from flashport import capabilities, dispatch, table
from flashport.backend.blockwise import BlockwiseBackend
from flashport.spec import dense_spec


KW = dict(softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
          deterministic=False, return_lse=False)


def _qkv(grad=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 19, h, 16, generator=g, dtype=dtype).requires_grad_(grad) for h in (4, 2, 2)]


def _grads(backend, causal=True):
    q, k, v = _qkv()
    out, lse = flashport.attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    (out.sum() + lse.sum()).backward()
    return out, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("plan", ["blockwise/reference", "reference/blockwise"])
def test_forward_from_one_backend_backward_from_another(plan):
    ref = _grads("reference")
    got = _grads(plan)
    assert dispatch.select(dense_spec(*_qkv(), causal=True, **KW)[0], plan).name == plan
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_strict_names():
    q, k, v = _qkv(grad=False)
    with flashport.use_backend("sdpa-cudnn"), pytest.raises(flashport.UnsupportedError, match="sdpa-cudnn"):
        flashport.attention(q, k, v)
    with pytest.raises(flashport.UnsupportedError, match="own forward state"):
        flashport.attention(q, k, v, backend="sdpa/blockwise")
    with pytest.raises(flashport.UnsupportedError, match="unknown backend"):
        flashport.attention(q, k, v, backend="blockwise/nope")
    with flashport.use_backend("blockwise/reference"):
        flashport.attention(*_qkv(), causal=True).sum().backward()


def test_disabled_backend_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("FLASHPORT_DISABLE", "blockwise")
    with pytest.raises(flashport.UnsupportedError, match="FLASHPORT_DISABLE"):
        flashport.attention(*_qkv(grad=False), backend="blockwise")


class _Fake(BlockwiseBackend):
    name = "fake-fast"


def _spec():
    return dense_spec(*_qkv(grad=False), causal=True, **KW)[0]


@pytest.mark.usefixtures("without_sdpa_cpu")   # auto on CPU as blockwise
def test_a_tuned_table_is_read_by_its_key(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(dispatch._REGISTRY, "fake-fast", _Fake())
    spec = _spec()
    assert dispatch.select(spec).name == "blockwise"          # static priority: registration order
    table.save(table.user_path("cpu"), "cpu", {table.bucket(spec): {"fwd": {"blockwise": 2.0, "fake-fast": 1.0},
                                                                     "bwd": {}}})
    assert dispatch.select(spec).name == "fake-fast"
    assert table.describe("cpu")["status"] == "in force"


@pytest.mark.usefixtures("without_sdpa_cpu")   # auto on CPU as blockwise
def test_the_nearest_bucket_of_the_same_kind_stands_in(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(dispatch._REGISTRY, "fake-fast", _Fake())
    spec = _spec()
    name = table.bucket(spec)
    *kind, g, q, k, bh = name.split("|")
    near = "|".join([*kind, g, f"q{int(q[1:]) + 1}", f"k{int(k[1:]) + 1}", bh])        # 2 log2 steps away
    far = "|".join([*kind, g, f"q{int(q[1:]) + 4}", k, bh])                           # 4 steps away
    other = "|".join([kind[0], "d32", *kind[2:], g, q, k, bh])                        # another head dim
    fast = {"fwd": {"blockwise": 2.0, "fake-fast": 1.0}, "bwd": {}}
    for buckets, want in (({near: fast}, "fake-fast"), ({far: fast}, "blockwise"), ({other: fast}, "blockwise")):
        table.save(table.user_path("cpu"), "cpu", buckets)
        table.reload()
        dispatch.clear_cache()
        assert dispatch.select(spec).name == want, buckets


@pytest.mark.usefixtures("without_sdpa_cpu")   # auto on CPU as blockwise
def test_a_call_that_returns_the_lse_uses_the_measurement_without_it(monkeypatch, tmp_path):
    """The lse costs nothing extra where a backend returns it, so a call asking for it (as backend=None's built-in
    rewrites do, to merge or to return it) is chosen from the same bucket, among the backends that can return it."""
    monkeypatch.setenv("FLASHPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(dispatch._REGISTRY, "fake-fast", _Fake())
    spec = _spec()
    with_lse = dense_spec(*_qkv(grad=False), causal=True, **{**KW, "return_lse": True})[0]
    assert table.bucket(with_lse) == table.bucket(spec)
    table.save(table.user_path("cpu"), "cpu", {table.bucket(spec): {"fwd": {"blockwise": 2.0, "fake-fast": 1.0},
                                                                     "bwd": {}}})
    assert dispatch.select(with_lse).name == "fake-fast"


def test_every_way_of_asking_for_the_causal_rule_is_one_spec():
    """causal=True, window_size=(-1, 0), and a mask backend=None finds to be causal are one spec: one plan-cache
    entry, one bucket and one plan."""
    from flashport import mods
    q, k, v = _qkv(grad=False)
    specs = [dense_spec(q, k, v, causal=True, **KW)[0],
             dense_spec(q, k, v, causal=False, **{**KW, "window_size": (-1, 0)})[0],
             dense_spec(q, k, v, causal=False, **KW, mask_mod=mods.causal, builtin_rules=True)[0],
             dense_spec(q, k, v, causal=False, **KW, block_mask=flashport.create_block_mask(
                 lambda b, h, i, j: j <= i, None, None, 19, 19, block_size=8), builtin_rules=True)[0]]
    assert all(s == specs[0] for s in specs[1:]) and specs[0].causal


@pytest.mark.usefixtures("without_sdpa_cpu")   # auto on CPU as blockwise
def test_a_stale_table_is_ignored_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(dispatch._REGISTRY, "fake-fast", _Fake())
    spec = _spec()
    path = table.save(table.user_path("cpu"), "cpu", {table.bucket(spec): {"fwd": {"fake-fast": 1.0}, "bwd": {}}})
    doc = json.loads(open(path).read())
    doc["key"]["torch"] = "0.0.1"
    open(path, "w").write(json.dumps(doc))
    table.reload()
    dispatch.clear_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch.select(spec).name == "blockwise"
    assert any("stale" in str(w.message) for w in caught)


def _declared_cases():
    """(backend, dtype, mask kind) for every pairing a CPU backend declares."""
    for b in dispatch._REGISTRY.values():
        if b.availability() or "cpu" not in b.caps.devices:
            continue
        for dtype in b.caps.dtypes:
            for mk in capabilities.MASK_KINDS:
                yield b.name, dtype, mk


WINDOWS = {"none": dict(causal=False, window_size=(-1, -1)), "causal": dict(causal=True, window_size=(-1, -1)),
           "window": dict(causal=False, window_size=(3, 2))}


@pytest.mark.parametrize("name, dtype, mk", list(_declared_cases()))
def test_declarations_are_honest(name, dtype, mk):
    b = dispatch.get(name)
    q, k, v = _qkv(grad=False, dtype=getattr(torch, dtype))
    kw = {**KW, **WINDOWS[mk]}
    spec = dense_spec(q, k, v, **kw)[0]
    reasons = b.supports(spec)
    if mk not in b.caps.mask_kinds:
        assert reasons, (name, mk)
        return
    if reasons:   # a backend may add its own reasons on top of the declaration (e.g. the interpreter's bf16)
        pytest.skip("; ".join(reasons))
    out = flashport.attention(q, k, v, backend=name, **{x: kw[x] for x in ("causal", "window_size")})
    ref = flashport.attention(q.double(), k.double(), v.double(), backend="reference",
                              **{x: kw[x] for x in ("causal", "window_size")})
    torch.testing.assert_close(out.double(), ref, atol=3e-2 if dtype in ("float16", "bfloat16") else 1e-5, rtol=0)


def test_every_shipped_table_reads_under_its_own_key():
    """The tables in flashport/configs (the H200's, the H100's) are of the current format, every bucket name parses,
    and every backend they name is registered: a table written by a device run and committed must not be ignored as
    unreadable on the card it was measured on."""
    import json

    import flashport
    from flashport import table
    paths = sorted(table.SHIPPED.glob("selection-*.json"))
    assert len(paths) >= 2
    names = {b.name for b in flashport.backends()}
    for p in paths:
        doc = json.loads(p.read_text())
        t, why = table._read(p, doc["key"])
        assert t is not None, why
        assert t.buckets and all(table._split(name) for name in t.buckets), p
        used = {b for entry in t.buckets.values() for role in entry.values() for b in role}
        assert used <= names, (p, used - names)


def test_a_backend_slow_on_a_gpu_ranks_last_there_whatever_it_prefers():
    """dispatch._ranked, the static priority: preferring backends first, then the others; on CUDA a slow_on_gpu
    backend (blockwise) after all of them.  It used to rank first wherever the Triton kernels deferred an odd head
    dim to cuDNN and cuDNN could not serve the call (ALiBi at D=96), running the whole call on PyTorch ops."""
    import dataclasses

    class Fake(dispatch.Backend):
        def __init__(self, name, prefers, slow=False, leads=False):
            self.name, self._prefers, self.slow_on_gpu, self._leads = name, prefers, slow, leads

        def prefers(self, spec, role):
            return self._prefers

        def leads(self, spec, role):
            return self._leads

    q = torch.empty(1, 256, 4, 96, dtype=torch.bfloat16, device="meta")
    spec, _ = dense_spec(q, q, q, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    blockwise, triton, gluon = Fake("blockwise", True, slow=True), Fake("triton", False), Fake("gluon", True)
    on_gpu = dataclasses.replace(spec, device=torch.device("cuda", 0))
    assert [b.name for b in dispatch._ranked([blockwise, triton, gluon], on_gpu, "bwd")] == ["gluon", "triton",
                                                                                             "blockwise"]
    cudnn = Fake("cudnn", False, leads=True)   # a leader comes before those that prefer; a slow one stays last
    assert [b.name for b in dispatch._ranked([blockwise, triton, gluon, cudnn], on_gpu, "bwd")] == [
        "cudnn", "gluon", "triton", "blockwise"]
    on_cpu = dataclasses.replace(spec, device=torch.device("cpu"))   # there it is the fast path
    assert [b.name for b in dispatch._ranked([blockwise, triton, gluon], on_cpu, "bwd")] == ["blockwise", "gluon",
                                                                                             "triton"]
    assert BlockwiseBackend.slow_on_gpu


def test_static_priority_puts_cudnn_first_on_hopper_where_the_table_measured_it_faster(monkeypatch):
    """Where no table bucket fits, cuDNN's plan leads static priority on Hopper (backend/triton.py: cudnn_first) for
    D=256 training calls, and unless FLASHPORT_CUDNN_FIRST=0 for the other dense calls where the H200 table measured it
    faster: training calls over fewer than 64k keys, short inference calls at D <= 128, padded head dims but the D=96
    the Gluon kernels split.  Long training calls, long inference calls, D=256 inference, float32 and other cards
    keep ours first.  Whatever leads, the order among flashport's own kernels is theirs (the Gluon forward's length
    floor), and FA2 and the memory-efficient kernel never rank before them."""
    import dataclasses

    from flashport.backend import triton as triton_backend
    from flashport.backend.gluon import FWD_HEAD_DIMS

    def spec(d, grad, causal=False, s=1024, b=2, h=4, dv=None, dtype=torch.bfloat16):
        q = torch.empty(b, s, h, d, dtype=dtype, device="meta", requires_grad=grad)
        v = torch.empty(b, s, h, dv or d, dtype=dtype, device="meta", requires_grad=grad)
        out, _ = dense_spec(q, q, v, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
        return dataclasses.replace(out, device=torch.device("cuda", 0))

    gluon, triton, cudnn, fa2, eff = (dispatch.get(n) for n in ("gluon", "triton", "sdpa-cudnn", "sdpa-flash",
                                                                   "sdpa-efficient"))
    monkeypatch.setattr(triton_backend, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)   # the interpreter tier sets it process-wide
    assert spec(256, True).needs_grad and not spec(256, False).needs_grad
    always = [spec(256, True), spec(256, True, causal=True)]
    switched = [spec(128, True), spec(64, True, causal=True), spec(128, True, s=32768, h=32), spec(64, False),
                spec(128, False, causal=True, s=4096, h=8), spec(80, False, s=16384, h=32), spec(192, True, dv=128),
                spec(80, True), spec(72, True), spec(128, False, dtype=torch.float16), spec(64, True, s=1024)]
    never = [spec(128, True, s=1 << 16, b=1, h=1), spec(256, False), spec(128, False, s=16384, h=32),
             spec(64, False, s=8192, h=32), spec(128, True, dtype=torch.float32), spec(96, True), spec(96, False)]
    ours_order = {}
    for on in ("0", "1"):
        monkeypatch.setenv("FLASHPORT_CUDNN_FIRST", on)
        for s in always + switched + never:
            first = s in always or (on == "1" and s in switched)
            assert triton_backend.cudnn_first(s) == first, (on, s)
            assert cudnn.leads(s, "fwd") == first and not fa2.leads(s, "fwd") and not eff.leads(s, "fwd"), (on, s)
            assert not gluon.leads(s, "fwd") and not triton.leads(s, "fwd")
            served = s.head_dim == s.head_dim_v and s.head_dim in FWD_HEAD_DIMS   # what auto would rank gluon for
            ranked = dispatch._ranked([gluon, triton, cudnn, fa2, eff] if served else [triton, cudnn, fa2, eff],
                                      s, "fwd")
            ours = [b for b in ranked if b in (gluon, triton)]
            # cuDNN first where it leads; else only where none of ours prefers the call (the padded head dims)
            assert (ranked[0] is cudnn) == (first or not any(b.prefers(s, "fwd") for b in ours)), (on, s)
            assert ours_order.setdefault(s, ours) == ours, (on, s)   # the switch never reorders ours
            assert max(ranked.index(b) for b in ours) < min(ranked.index(fa2), ranked.index(eff))
    monkeypatch.setenv("FLASHPORT_CUDNN_FIRST", "1")   # D=96 keeps the Gluon kernels only while both splits are on
    assert not triton_backend.cudnn_first(spec(96, True))
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD_SPLIT", "0")
    assert triton_backend.cudnn_first(spec(96, True))
    monkeypatch.setattr(triton_backend, "_capability", lambda index: (8, 0))   # an A100: no such measurement
    for s in always + switched:
        assert not cudnn.leads(s, "fwd"), s
        assert triton.prefers(s, "fwd"), s


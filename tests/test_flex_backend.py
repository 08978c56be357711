"""The `flex` backend's mapping of the contract onto FlexAttention, checked on a CPU with eager flex_attention
standing in for the compiled one (the backend itself serves CUDA only: compiled Flex on a CPU has no backward
and no lse, and eager Flex materialises).  Flex has no backward on a CPU at all, so the gradients are checked on
the GPU (tests/gpu/test_flex_gpu.py); here the forward and lse."""
import pytest
import torch

import flashport
from flashport import mods
from flashport.backend import flex
from flashport.spec import dense_spec

fa = pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture
def eager_flex(monkeypatch):
    monkeypatch.setattr(flex, "_compiled", [fa.flex_attention])
    monkeypatch.setattr(flex, "BLOCK", 16)
    flex._BLOCK_MASKS.clear()
    yield
    flex._BLOCK_MASKS.clear()


def _call(sq, sk, **kw):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, sq, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, sk, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, sk, 2, 16, generator=g, dtype=torch.float64)
    opts = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, deterministic=False, return_lse=True)
    opts.update(kw)
    return (q, k, v), dense_spec(q, k, v, **opts), opts


CASES = {
    "causal-bottom-right": (40, 56, dict(causal=True)),
    "window": (48, 48, dict(window_size=(7, 3))),
    "softcap+alibi": (33, 33, dict(softcap=4.0, alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.05]))),
    "score+mask+bias": (48, 48, dict(score_mod=mods.relative_position(torch.randn(4, 9, dtype=torch.float64)),
                                     mask_mod=mods.prefix_lm(10), attn_bias=torch.randn(4, 1, 48, dtype=torch.float64),
                                     causal=True)),
    "empty rows": (32, 32, dict(mask_mod=lambda b, h, i, j: (i >= 12) & (j <= i))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flex_mapping_equals_the_reference(name, eager_flex):
    sq, sk, kw = CASES[name]
    (q, k, v), (spec, inputs), opts = _call(sq, sk, **kw)
    out, lse = flex.FlexBackend().run(spec, inputs)
    ref, ref_lse = flashport.attention(q, k, v, backend="reference", **opts)
    # ALiBi's bias is float32 by contract: its rounding enters the float64 results at 1e-8
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6 if "alibi" in name else 1e-10)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=0, atol=1e-5)


def test_user_block_mask_and_cache(eager_flex):
    bm = flashport.create_block_mask(mods.causal, None, None, 48, 48, block_size=16)
    (q, k, v), (spec, inputs), opts = _call(48, 48, block_mask=bm)
    out, _ = flex.FlexBackend().run(spec, inputs)
    out2, _ = flex.FlexBackend().run(spec, inputs)
    assert len(flex._BLOCK_MASKS) == 1          # built once, reused
    ref = flashport.attention(q, k, v, backend="reference", causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_flex_is_listed_and_refuses_cpu():
    info = {b.name: b for b in flashport.backends()}["flex"]
    assert "score_mod" in info.capabilities["mods"]
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(flashport.UnsupportedError, match="flex"):
        flashport.attention(q, q, q, backend="flex", score_mod=mods.tanh_softcap(3.0))


@pytest.fixture
def traced_flex(monkeypatch):
    """The backend's own torch.compile(flex_attention, dynamic=True), with Dynamo's tracing and AOT autograd as on a
    GPU but the aot_eager backend (no Inductor lowering; Flex's dense math runs the traced graphs), on a CPU: where
    flashport's mods break Dynamo (graph breaks, recompiles), they break here too.  Counts the compiled graphs."""
    from dataclasses import replace

    from torch._dynamo.testing import CompileCounterWithBackend
    if not hasattr(fa, "_validate_device"):
        pytest.skip("this torch's flex_attention has no _validate_device to lift its CPU-backward refusal")
    monkeypatch.setattr(fa, "_validate_device", lambda *a, **k: None)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    monkeypatch.setattr(flex, "_compiled", [torch.compile(fa.flex_attention, dynamic=True, backend=counter)])
    monkeypatch.setattr(flex, "BLOCK", 16)
    monkeypatch.setattr(flex.FlexBackend, "availability", lambda self: [])
    monkeypatch.setattr(flex.FlexBackend, "caps", replace(flex.FlexBackend.caps, devices=("cuda", "cpu")))
    flex._BLOCK_MASKS.clear()
    yield counter
    flex._BLOCK_MASKS.clear()
    torch._dynamo.reset()


def _grads(backend, sq, b, kw, extras=()):
    g = torch.Generator().manual_seed(sq + b)
    q, k, v = (torch.randn(b, sq, 4, 16, generator=g, dtype=torch.float32, requires_grad=True) for _ in range(3))
    out = flashport.attention(q, k, v, backend=backend, **kw)
    ts = (q, k, v, *extras)
    return out, torch.autograd.grad(out, ts, torch.ones_like(out))


TRACED = {   # the kinds that failed on the GPU in the 14th session (a float the mods close over, captured grads)
    "softcap builtin": lambda: (dict(softcap=20.0, causal=True), ()),
    "alibi score_mod": lambda: (dict(score_mod=mods.alibi(torch.rand(4, dtype=torch.float32)), causal=True), ()),
    "relative table (grad)": lambda: _with(lambda t: dict(score_mod=mods.relative_position(t), causal=True),
                                           torch.randn(4, 9, dtype=torch.float32)),
    "attn_bias (grad)": lambda: _with(lambda t: dict(attn_bias=t), torch.randn(1, 4, 1, 48, dtype=torch.float32)),
}


def _with(make, t):
    t.requires_grad_()
    return make(t), (t,)


@pytest.mark.parametrize("name", list(TRACED))
def test_traced_flex_forward_and_gradients(name, traced_flex):
    kw, extras = TRACED[name]()
    out, grads = _grads("flex", 48, 2, kw, extras)
    ref, ref_grads = _grads("reference", 48, 2, kw, extras)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    for gr, rg in zip(grads, ref_grads):
        # a captured table's gradient sums thousands of terms in a thread-dependent order: relative tolerance too
        torch.testing.assert_close(gr, rg, rtol=1e-5, atol=2e-5)


def test_new_lengths_and_batches_compile_nothing(traced_flex):
    """One compiled graph per mod: after the first call, new S and B values (and new captured values) reuse it.
    B = 1 is Dynamo's size-1 specialisation: one more graph, once."""
    table = torch.randn(4, 9, dtype=torch.float32, requires_grad=True)
    kw = dict(score_mod=mods.relative_position(table), softcap=8.0, causal=True)
    _grads("flex", 48, 2, kw, (table,))
    first = traced_flex.frame_count
    assert first >= 1
    for sq, b in ((64, 2), (80, 3), (112, 4)):
        _grads("flex", sq, b, kw, (table,))
    with torch.no_grad():
        table.add_(1.0)   # new values of the captured table: the same graph
    _grads("flex", 96, 2, kw, (table,))
    assert traced_flex.frame_count == first
    for sq in (32, 64):
        _grads("flex", sq, 1, kw, (table,))
    assert traced_flex.frame_count <= first + 1


def test_ready_made_score_mods_lower_in_inductor_with_dynamic_shapes():
    """Inductor's Flex lowering (here its CPU template, forward) under dynamic=True: a mod whose ints become symbolic
    sizes fails there ("'Mul' object has no attribute 'get_name'" on a CPU, "'ShapeAsConstantBuffer' object has no
    attribute 'dtype'" on an H100) -- the learnable table's clamp bounds did, before they became tensors."""
    compiled = torch.compile(fa.flex_attention, dynamic=True)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
    table = torch.randn(2, 33, generator=g)
    for mod in (mods.relative_position(table), mods.alibi(torch.rand(2, generator=g))):
        out = compiled(q, k, v, score_mod=mod)
        ref = flashport.attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=mod, backend="reference")
        torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("block_size", [16, 8, 32])   # aligned with Flex's (test) block of 16, finer, coarser
def test_block_sparse_user_tiles(eager_flex, block_size):
    """The user's empty tiles hide their pairs whether they align with Flex's blocks (then only listed blocks
    carry them) or not (then the elementwise mask does)."""
    n = -(-48 // block_size)
    bm = flashport.create_block_mask(mods.block_sparse(n, n, block_size, density=0.4, seed=3), None, None, 48, 48,
                                     block_size=block_size)
    (q, k, v), (spec, inputs), opts = _call(48, 48, block_mask=bm)
    out, lse = flex.FlexBackend().run(spec, inputs)
    ref, ref_lse = flashport.attention(q, k, v, backend="reference", **opts)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_small_tiles_only_where_a_score_mod_reads_a_tensor_that_needs_grad():
    from types import SimpleNamespace
    from flashport.backend import flex
    table = SimpleNamespace(prog=SimpleNamespace(captured=(torch.zeros(3, requires_grad=True),)))
    assert flex._kernel_options(table) == flex.SMALL_TILES
    assert flex._kernel_options(SimpleNamespace(prog=None)) is None
    assert flex._kernel_options(SimpleNamespace(prog=SimpleNamespace(captured=()))) is None
    # Flex gives "fwd_" keys to the forward kernel and "bwd_" keys to the backward's: no key reaches both
    assert all(k.startswith(("fwd_", "bwd_")) for k in flex.SMALL_TILES)

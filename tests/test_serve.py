"""CPU smoke test of examples/serve.py: the paged flashport serving loop generates exactly the tokens
of the dense-cache SDPA loop, and finished requests' KV pages are reused.  The fixed-shape decode step
that --cuda-graph captures on CUDA runs here uncaptured (--static-decode) and must give the same tokens."""
from __future__ import annotations

import gc
import importlib.util
import pathlib
import sys
import weakref

import pytest
import torch

SERVE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "serve.py"


@pytest.fixture(scope="module")
def serve():
    spec = importlib.util.spec_from_file_location("flashport_example_serve", SERVE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_tiny_serving_loop_matches_sdpa(serve, capsys, monkeypatch):
    # A CPU smoke test: keep it on the PyTorch-speed backends even when the interpreter tier's
    # conftest has switched TRITON_INTERPRET on for this process.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    res = serve.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--no-cuda-graph"])
    assert res["mode"] == "eager"
    assert res["equal"] == res["requests"] == 6 and not res["ties"]
    assert res["tokens_paged"] == res["tokens_dense"]
    assert all(len(t) >= 4 for t in res["tokens_paged"])         # new tokens drawn from [4, 8]
    assert res["pages_reused"] > 0                                # later requests got freed pages
    assert res["paged"]["tokens"] == sum(len(t) for t in res["tokens_paged"])
    out = capsys.readouterr().out
    assert "TTFT" in out and "tok/s" in out and "KV pool" in out
    assert "paged/flashport [eager]" in out and "dense/SDPA [eager]" in out


def test_static_decode_step_gives_the_eager_tokens(serve, capsys, monkeypatch):
    # The step a CUDA graph captures (fixed-width block table; fixed-capacity SDPA cache with a length
    # mask and compacted slots), run eagerly: the tokens must be those of the eager loops.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    eager = serve.main(["--tiny", "--device", "cpu"])
    capsys.readouterr()
    res = serve.main(["--tiny", "--device", "cpu", "--static-decode", "--cuda-graph"])
    out = capsys.readouterr().out
    assert "--cuda-graph ignored on cpu" in out                   # no CUDA here: a note, no capture
    assert res["mode"] == "static" and "paged/flashport [static]" in out and "dense/SDPA [static]" in out
    assert res["equal"] == res["requests"] == 6 and not res["ties"]
    assert res["tokens_paged"] == res["tokens_dense"] == eager["tokens_paged"] == eager["tokens_dense"]


def test_allocator_reuses_released_blocks(serve):
    alloc = serve.BlockAllocator(3)
    first = [alloc.alloc() for _ in range(3)]
    with pytest.raises(RuntimeError):
        alloc.alloc()
    alloc.release(first[:2])
    again = [alloc.alloc(), alloc.alloc()]
    assert sorted(again) == sorted(first[:2]) and alloc.reused == 2 and alloc.peak_used == 3


def test_pool_too_small_is_an_error(serve, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kv-blocks"):
        serve.main(["--tiny", "--device", "cpu", "--kv-blocks", "2"])


def _requests(serve, lengths):
    return [serve.Request(i, [1] * n, 4, length=n) for i, n in enumerate(lengths)]


def test_dense_slots_stay_compact_and_map_rows(serve):
    kv = serve.DenseSdpaKV(serve.TINY, 3, 16, torch.device("cpu"), torch.float32)
    a, b, c = _requests(serve, [5, 7, 2])
    for s, r in enumerate((a, b, c)):
        kc, _ = kv._cache(r, 0)
        kc.fill_(s + 1.0)                       # mark each slot's cache with its first owner
    assert kv.slot == {0: 0, 1: 1, 2: 2} and not kv.can_admit(None, [])
    kv.release(a)                               # the last slot's request (c) moves into the hole
    assert kv.slot == {1: 1, 2: 0} and kv.can_admit(None, [])
    assert (kv.k[0][0] == 3.0).all() and (kv.k[0][1] == 2.0).all()
    assert kv.load([b, c]) == [1, 0]            # request order -> batch rows
    assert kv.lengths[:2].tolist() == [2, 7]    # row 0 holds c, row 1 holds b
    kv.release(c)
    assert kv.slot == {1: 0} and (kv.k[0][0] == 2.0).all()


def test_masked_sdpa_step_equals_sliced_sdpa(serve):
    # One decode layer: the batched, fixed-capacity, length-masked step (what the graph captures)
    # against the per-request sliced SDPA of the eager loop, with slots out of request order.
    cfg, dev = serve.TINY, torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    kv = serve.DenseSdpaKV(cfg, 3, 24, dev, torch.float32)
    reqs = _requests(serve, [9, 0, 23])         # lengths before the append: empty and full-capacity too
    for r in reqs:
        kv._cache(r, 0)
    kv.release(reqs[0])                          # leaves rows out of request order
    reqs = reqs[1:] + [serve.Request(9, [1] * 4, 4, length=4)]
    kv._cache(reqs[-1], 0)
    for c in (*kv.k, *kv.v):
        c.copy_(torch.randn(c.shape, generator=g))
    hd = cfg.head_dim
    q = torch.randn(3, cfg.heads, hd, generator=g)
    k, v = (torch.randn(3, cfg.kv_heads, hd, generator=g) for _ in range(2))
    want = kv.decode(reqs)(1, q, k, v)           # request order
    rows = kv.load(reqs)
    assert rows != sorted(rows)
    perm = torch.tensor(rows)
    qs, ks, vs = (torch.empty_like(t).index_copy_(0, perm, t) for t in (q, k, v))
    got = kv.static_attend(3)(1, qs, ks, vs)[perm]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i, r in enumerate(reqs):                 # the appended token landed at each request's length
        torch.testing.assert_close(kv.k[1][rows[i], r.length], k[i])


class _ReadsOutside(torch.overrides.TorchFunctionMode):
    """Records (weakly) every tensor an op reads that was made before the capture began: what a CUDA
    graph would read by raw address.  A view stands for its base (the memory it reads)."""

    def __init__(self):
        super().__init__()
        self.made, self.keep, self.outside = set(), [], {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) not in self.made:
                base = t if t._base is None else t._base
                self.outside[id(base)] = (weakref.ref(base), f"{tuple(base.shape)} {base.dtype} read by {func}")
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):            # made during capture: the graph's pool owns it
                self.made.add(id(t))
                self.keep.append(t)
        return out


def test_captured_step_inputs_outlive_capture(serve, monkeypatch):
    # CPU stand-in for --cuda-graph: "capture" runs the step once, noting the tensors it reads from
    # outside; "replay" first checks those are all still alive (a real graph holds raw addresses, not
    # references: a freed index tensor's memory is reused by eager code and read as indices, the
    # device-side assert of results/serve_graph_h200_failed.log), then reruns the step.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    replays = []

    def fake_capture(step, pool):
        with _ReadsOutside() as reads:
            step()
        step_ref = weakref.ref(step)                   # a graph does not keep the Python step alive

        def replay():
            freed = [what for ref, what in reads.outside.values() if ref() is None]
            assert step_ref() is not None and not freed, f"freed while captured: {freed}"
            replays.append(1)
            return step_ref()()
        return replay

    monkeypatch.setattr(serve, "capture_step", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    cfg, dev = serve.TINY, torch.device("cpu")
    model = serve.Llama(cfg, dev, torch.float32)
    kvs = {"paged": lambda: serve.PagedFlashportKV(cfg, 3 * 12, 4, 3, 46, dev, torch.float32),
           "dense": lambda: serve.DenseSdpaKV(cfg, 3, 46, dev, torch.float32)}
    tokens = {}
    for name, make_kv in kvs.items():
        for graph in (False, True):
            kv = make_kv()
            decoder = serve.StaticDecode(model, kv, 3, capture=True) if graph else None
            gc.collect()                               # capture done: what only it referenced is gone
            reqs = serve.make_requests(5, (3, 40), 6, cfg.vocab)
            serve.serve(model, kv, reqs, 3, decoder)
            tokens[name, graph] = [r.out for r in reqs]
    assert replays                                     # the decode steps went through "replay"
    assert tokens["paged", True] == tokens["paged", False] == tokens["dense", True] == tokens["dense", False]

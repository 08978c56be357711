"""CPU smoke test of examples/serve.py: the paged flashport serving loop generates exactly the tokens
of the dense-cache SDPA loop, and finished requests' KV pages are reused."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

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
    res = serve.main(["--tiny", "--device", "cpu", "--dtype", "float32"])
    assert res["equal"] == res["requests"] == 6 and not res["ties"]
    assert res["tokens_paged"] == res["tokens_dense"]
    assert all(len(t) >= 4 for t in res["tokens_paged"])         # new tokens drawn from [4, 8]
    assert res["pages_reused"] > 0                                # later requests got freed pages
    assert res["paged"]["tokens"] == sum(len(t) for t in res["tokens_paged"])
    out = capsys.readouterr().out
    assert "TTFT" in out and "tok/s" in out and "KV pool" in out


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

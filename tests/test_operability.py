"""Issue [7]: counters, profiler ranges, the guard and its quarantine, kill switches, the config file, and
memory that stays flat over many calls (CPU; the GPU versions are in tests/gpu)."""
import gc
import warnings
import json
import logging
import random
import subprocess
import sys

import pytest
import torch

import flashport
from flashport import dispatch, env, monitor, rollout
from flashport.backend.blockwise import BlockwiseBackend

# CPU auto as blockwise: these tests are about flashport's own path (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("without_sdpa_cpu")



def _qkv(b=2, s=37, hq=4, hkv=2, d=16, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).requires_grad_(grad) for h in (hq, hkv, hkv)]


class Faulty(BlockwiseBackend):
    """blockwise, with its output nudged by `error` (a miscompiled kernel, as a rollout would meet it)."""

    name = "faulty"
    state_family = "faulty"

    def __init__(self, error=1e-2):
        self.error = error

    def forward(self, spec, inputs):
        out, lse, private = super().forward(spec, inputs)
        return out + self.error, lse, private


@pytest.fixture
def faulty_first(monkeypatch):
    """A faulty backend registered ahead of every other (auto's first choice on a CPU)."""
    f = Faulty()
    monkeypatch.setattr(dispatch, "_REGISTRY", {"faulty": f, **dispatch._REGISTRY})
    dispatch.clear_cache()
    return f


# ----------------------------------------------------------------------------- counters
def test_counters_per_backend():
    q, k, v = _qkv()
    out = flashport.attention(q, k, v, causal=True)
    out.sum().backward()
    flashport.attention(*(t.detach() for t in (q, k, v)), backend="reference")
    st = flashport.stats()
    bw, ref = st["blockwise"], st["reference"]
    assert (bw["calls"], bw["forward"], bw["backward"], bw["errors"]) == (1, 1, 1, 0)
    pairs = 37 * 38 // 2   # causal, Sq == Sk
    fwd = 2 * (16 + 16) * pairs * 2 * 4
    assert bw["flops"] == fwd + int(2.5 * fwd)
    assert bw["bytes_read"] == sum(t.numel() * 4 for t in (q, k, v))
    assert ref["calls"] == 1 and ref["backward"] == 0
    assert ref["peak_extra_bytes"] > 4 * 8 * 2 * 4 * 37 * 37   # the reference materialises its scores
    flashport.reset_stats()
    assert flashport.stats() == {}


def test_errors_are_counted(monkeypatch):
    def broken(self, spec, inputs):
        raise RuntimeError("kernel fault")
    monkeypatch.setattr(BlockwiseBackend, "forward", broken)
    with pytest.raises(RuntimeError, match="kernel fault"):
        flashport.attention(*_qkv(grad=False))
    assert flashport.stats()["blockwise"]["errors"] == 1


def test_varlen_and_kvcache_are_counted():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    flashport.attention_varlen(q, q, q, cu, cu, 7, 7)
    kc, vc = torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    flashport.attention_with_kvcache(torch.randn(2, 1, 2, 16), kc, vc, torch.randn(2, 1, 2, 16),
                                     torch.randn(2, 1, 2, 16), cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))
    assert flashport.stats()["blockwise"]["calls"] == 2


# ----------------------------------------------------------------------------- profiler ranges
def _trace(fn):
    from torch.profiler import profile
    with profile() as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("flashport::")]


@pytest.mark.parametrize("backend", [None, "sdpa", "blockwise/reference"])
def test_profiler_trace_has_the_flashport_ranges(backend):
    def step():
        q, k, v = _qkv()
        flashport.attention(q, k, v, causal=True, backend=backend).sum().backward()
    names = _trace(step)
    fwd, bwd = (backend or "blockwise").split("/")[0], (backend or "blockwise").split("/")[-1]
    assert f"flashport::attention[{fwd}]" in names
    assert f"flashport::attention_backward[{bwd}]" in names


def test_hooks_on_a_fused_backward_node_bracket_it_and_count_it():
    """monitor.bracket_node (the SDPA kernels' backward on CUDA): the backward range opens before the fused op's
    backward and closes after it, and the backward is counted once per backward pass (twice with retain_graph)."""
    import torch.nn.functional as F
    from torch.profiler import profile

    from flashport.spec import dense_spec
    q, k, v = (t.transpose(1, 2) for t in _qkv(hkv=4))   # [B, H, S, D] for F.sdpa
    spec, _ = dense_spec(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False,
                         return_lse=False)
    before = flashport.stats().get("probe", {}).get("backward", 0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.grad_fn is not None and "ScaledDotProduct" in type(out.grad_fn).__name__
    monitor.bracket_node(spec, "probe", out.grad_fn)
    with profile() as prof:
        out.sum().backward(retain_graph=True)
    events = {e.name: e for e in prof.events()}
    rng = events["flashport::attention_backward[probe]"]
    fused = next(e for name, e in events.items() if "scaled_dot_product" in name and "backward" in name)
    assert rng.time_range.start <= fused.time_range.start and fused.time_range.end <= rng.time_range.end
    assert flashport.stats()["probe"]["backward"] == before + 1
    out.sum().backward()
    assert flashport.stats()["probe"]["backward"] == before + 2


def test_an_sdpa_backend_bracketing_its_own_backward_counts_it_once(monkeypatch):
    """SdpaBackend.brackets_backward (true on CUDA) through serve: no autograd Functions around the call, the hooks
    on the fused node give the backward its range, counted once per backward."""
    from torch.profiler import profile

    from flashport.backend.sdpa import SdpaBackend
    monkeypatch.setattr(SdpaBackend, "brackets_backward", lambda self, spec: True)
    q, k, v = _qkv(hkv=4)
    before = flashport.stats().get("sdpa", {}).get("backward", 0)
    out = flashport.attention(q, k, v, causal=True, backend="sdpa")
    with profile() as prof:
        out.sum().backward()
    names = [e.name for e in prof.events()]
    assert names.count("flashport::attention_backward[sdpa]") == 1
    assert not any("_Open" in n or "_Close" in n for n in names)   # serve's Functions were not used
    assert flashport.stats()["sdpa"]["backward"] == before + 1


def test_varlen_range_and_ranges_off(monkeypatch):
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert _trace(lambda: flashport.attention_varlen(q, q, q, cu, cu, 7, 7)) == \
        ["flashport::attention_varlen[blockwise]"]
    monkeypatch.setenv("FLASHPORT_RANGES", "0")
    assert _trace(lambda: flashport.attention_varlen(q, q, q, cu, cu, 7, 7)) == []


def test_selection_and_reasons_logged_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="flashport"):
        flashport.attention(*_qkv(grad=False))
    text = caplog.text
    assert "blockwise chosen automatically" in text and "reference: never chosen automatically" in text


# ----------------------------------------------------------------------------- guard
def test_guard_quarantines_a_faulty_backend(faulty_first, caplog):
    q, k, v = _qkv(grad=False)
    assert dispatch.select(dispatch_spec(q, k, v)).name == "faulty"
    with caplog.at_level(logging.WARNING, logger="flashport"):
        with flashport.guard(sample_rate=1.0):
            bad = flashport.attention(q, k, v)
            good = flashport.attention(q, k, v)      # the next eligible backend
            flashport.attention(q, k, v)
    ref = flashport.attention(q, k, v, backend="reference")
    assert (bad - ref).abs().max() > 5e-3 and (good - ref).abs().max() < 1e-5
    assert "faulty" in flashport.quarantined() and "guard" in flashport.quarantined()["faulty"]
    st = flashport.stats()
    assert st["faulty"]["guard_failures"] == 1 and st["faulty"]["calls"] == 1
    assert st["blockwise"]["fallbacks"] == 2 and st["blockwise"]["guard_failures"] == 0
    assert sum("quarantined" in r.message for r in caplog.records) == 1   # one warning
    with pytest.raises(flashport.UnsupportedError, match="quarantined"):
        flashport.attention(q, k, v, backend="faulty")
    flashport.release_quarantine("faulty")
    assert flashport.quarantined() == {}
    assert dispatch.select(dispatch_spec(q, k, v)).name == "faulty"


def dispatch_spec(q, k, v, **kw):
    from flashport.spec import dense_spec
    args = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, deterministic=False, return_lse=False) | kw
    return dense_spec(q, k, v, **args)[0]


def test_guard_passes_correct_backends_on_every_kind():
    g = torch.Generator().manual_seed(1)
    with flashport.guard(sample_rate=1.0):
        for causal, window, softcap in ((True, (-1, -1), 0.0), (False, (5, 3), 0.0), (False, (-1, -1), 10.0)):
            q, k, v = _qkv(s=29, grad=False)
            flashport.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                alibi_slopes=torch.rand(4, generator=g))
        q = torch.randn(20, 4, 16, generator=g)
        kv = torch.randn(25, 2, 16, generator=g)
        cu_q, cu_k = torch.tensor([0, 0, 7, 20], dtype=torch.int32), torch.tensor([0, 4, 9, 25], dtype=torch.int32)
        for _ in range(6):   # every sequence, the empty one included, gets sampled
            flashport.attention_varlen(q, kv, kv, cu_q, cu_k, 13, 16, causal=True)
        kc, vc = torch.randn(2, 16, 2, 16, generator=g), torch.randn(2, 16, 2, 16, generator=g)
        flashport.attention_with_kvcache(torch.randn(2, 3, 4, 16, generator=g), kc, vc, torch.randn(2, 3, 2, 16),
                                         torch.randn(2, 3, 2, 16), cache_seqlens=torch.tensor([4, 9], dtype=torch.int32),
                                         causal=True)
    st = flashport.stats()["blockwise"]
    assert st["guard_checks"] == 10 and st["guard_failures"] == 0 and flashport.quarantined() == {}
    assert st["guard_max_error_ratio"] < 1.0


@pytest.mark.parametrize("kind", ["varlen", "kvcache"])
def test_guard_catches_errors_on_varlen_and_kvcache(faulty_first, kind):
    with flashport.guard(sample_rate=1.0):
        if kind == "varlen":
            q = torch.randn(20, 4, 16)
            cu = torch.tensor([0, 9, 20], dtype=torch.int32)
            flashport.attention_varlen(q, q, q, cu, cu, 11, 11)
        else:
            kc = torch.randn(2, 16, 4, 16)
            flashport.attention_with_kvcache(torch.randn(2, 1, 4, 16), kc, kc.clone(),
                                             cache_seqlens=torch.tensor([4, 9], dtype=torch.int32))
    assert "faulty" in flashport.quarantined()


def test_guard_ignores_garbage_past_a_caches_length():
    # found by the fuzzer with the guard at 1.0: NaN / inf in unused cache slots made the bound NaN, and a
    # correct backend was quarantined
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 4, 16, generator=g, dtype=torch.float32).to(torch.bfloat16)
    kc, vc = (torch.randn(2, 16, 2, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    kc[0, 5:], vc[0, 5:] = float("nan"), float("inf")
    with flashport.guard(sample_rate=1.0):
        for _ in range(4):
            flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([5, 16], dtype=torch.int32))
    st = flashport.stats()["blockwise"]
    assert st["guard_checks"] == 4 and st["guard_failures"] == 0 and flashport.quarantined() == {}


def test_guard_ignores_rows_past_a_varlen_sequence():
    # also found by the fuzzer: an empty sequence left only rows past its end (here NaN padding) to check
    g = torch.Generator().manual_seed(4)
    q = torch.randn(14, 2, 16, generator=g)
    k, v = torch.randn(12, 2, 16, generator=g), torch.randn(12, 2, 16, generator=g)
    q[9:] = float("nan")
    cu_q, cu_k = torch.tensor([0, 9, 9], dtype=torch.int32), torch.tensor([0, 7, 12], dtype=torch.int32)
    with flashport.guard(sample_rate=1.0):
        for _ in range(8):
            flashport.attention_varlen(q, k, v, cu_q, cu_k, 9, 7, alibi_slopes=torch.tensor([0.5, 0.25]))
    st = flashport.stats()["blockwise"]
    assert st["guard_checks"] == 8 and st["guard_failures"] == 0 and flashport.quarantined() == {}


def test_guard_setting_process_wide_and_as_a_block():
    flashport.guard(sample_rate=0.25)                  # process-wide from here
    q, k, v = _qkv(grad=False)
    for _ in range(8):
        flashport.attention(q, k, v)
    assert flashport.stats()["blockwise"]["guard_checks"] == 2     # every 4th call
    with flashport.guard(sample_rate=0.0):
        flashport.attention(q, k, v)
        flashport.attention(q, k, v)
        flashport.attention(q, k, v)
    assert flashport.stats()["blockwise"]["guard_checks"] == 2
    for _ in range(4):                                  # 0.25 again after the block
        flashport.attention(q, k, v)
    assert flashport.stats()["blockwise"]["guard_checks"] == 3


def test_guard_tolerance_and_bad_arguments(faulty_first):
    q, k, v = _qkv(grad=False)
    with flashport.guard(sample_rate=1.0, tolerance=0.1):     # the faulty error (0.01) is within 0.1
        flashport.attention(q, k, v)
    assert flashport.quarantined() == {}
    for bad in (dict(sample_rate=1.5), dict(sample_rate="1"), dict(sample_rate=True)):
        with pytest.raises(ValueError, match="sample_rate"):
            flashport.guard(**bad)
    with pytest.raises(ValueError, match="tolerance"):
        flashport.guard(tolerance=-1.0)


def test_guard_from_the_environment(monkeypatch, faulty_first):
    monkeypatch.setenv("FLASHPORT_GUARD", "1")
    flashport.attention(*_qkv(grad=False))
    assert "faulty" in flashport.quarantined()


def test_guard_skips_dropout_calls():
    with flashport.guard(sample_rate=1.0):
        flashport.attention(*_qkv(), dropout_p=0.1)
    st = flashport.stats()["blockwise"]
    assert st["guard_skipped"] == 1 and st["guard_checks"] == 0


# ----------------------------------------------------------------------------- kill switch and config file
def test_kill_switch(monkeypatch):
    monkeypatch.setenv("FLASHPORT_DISABLE", "blockwise")
    with pytest.raises(flashport.UnsupportedError, match="disabled by FLASHPORT_DISABLE"):
        flashport.attention(*_qkv(grad=False))
    with pytest.raises(flashport.UnsupportedError, match="disabled"):
        flashport.attention(*_qkv(grad=False), backend="blockwise")
    assert flashport.attention(*_qkv(grad=False), backend="reference").shape == (2, 37, 4, 16)


def test_config_file(monkeypatch, tmp_path):
    cfg = tmp_path / "flashport.toml"
    cfg.write_text('disable = ["blockwise"]\nFLASHPORT_GUARD = 0.5\n')
    monkeypatch.setenv("FLASHPORT_CONFIG", str(cfg))
    assert env.value("FLASHPORT_DISABLE") == "blockwise" and env.value("FLASHPORT_GUARD") == "0.5"
    assert env.source("FLASHPORT_DISABLE") == f"config {cfg}" and env.source("FLASHPORT_CHECKS") == "default"
    with pytest.raises(flashport.UnsupportedError, match="disabled"):
        flashport.attention(*_qkv(grad=False))
    monkeypatch.setenv("FLASHPORT_DISABLE", "")          # the environment wins over the file
    assert env.source("FLASHPORT_DISABLE") == "environment"
    flashport.attention(*_qkv(grad=False))
    out = subprocess.run([sys.executable, "-m", "flashport", "info", "--json"], capture_output=True, text=True,
                         env={**__import__("os").environ, "FLASHPORT_DISABLE": ""}, check=True).stdout
    sw = json.loads(out)["switches"]
    assert sw["FLASHPORT_GUARD"] == {**sw["FLASHPORT_GUARD"], "value": "0.5", "source": f"config {cfg}"}
    assert sw["FLASHPORT_DISABLE"]["source"] == "environment"


def test_config_file_with_an_unknown_key_or_bad_toml_warns(monkeypatch, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('disabel = "triton"\n')
    monkeypatch.setenv("FLASHPORT_CONFIG", str(cfg))
    with pytest.warns(RuntimeWarning, match="unknown key 'disabel'"):
        env.reload_config()
        assert env.value("FLASHPORT_DISABLE") == ""
    cfg.write_text('disable = [\n')
    env.reload_config()
    with pytest.warns(RuntimeWarning, match="not valid TOML"):
        env.value("FLASHPORT_DISABLE")


# ----------------------------------------------------------------------------- memory
def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():     # isinstance() on torch's deprecated module aliases warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_leak_10000_calls_with_varied_shapes(monkeypatch):
    """10,000 forward + backward calls drawn from 40 shapes and masks (and the guard sampling 1%), after
    one warm call of each: live tensors, every cache flashport owns and the process's memory stay flat;
    the dispatcher's memo, cut to 16 entries, cycles without growing."""
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(dispatch, "MEMO_SIZE", 16)
    rng = random.Random(7)
    flashport.guard(sample_rate=0.01)
    pool = [(s, sk, hkv, causal, window) for s, sk in ((1, 1), (5, 17), (24, 24), (17, 9))
            for hkv in (1, 2) for causal in (False, True) for window in ((-1, -1), (3, 0), (2, 5))
            if not (causal and window == (2, 5))]

    def call(s, sk, hkv, causal, window):
        q = torch.randn(1, s, 2 * hkv, 8, requires_grad=True)
        k = torch.randn(1, sk, hkv, 8, requires_grad=True)
        v = torch.randn(1, sk, hkv, 8, requires_grad=True)
        flashport.attention(q, k, v, causal=causal, window_size=window).sum().backward()

    assert len(pool) == 40
    for case in pool:
        call(*case)
    caches = {k: v for k, v in monitor.cache_sizes().items() if k != "dispatch._memo"}
    tensors, rss = _live_tensors(), psutil.Process().memory_info().rss
    for _ in range(10_000):
        call(*rng.choice(pool))
        assert len(dispatch._memo) <= 16
    assert _live_tensors() <= tensors + 10
    assert {k: v for k, v in monitor.cache_sizes().items() if k != "dispatch._memo"} == caches
    assert len(monitor._stats) <= len(dispatch._REGISTRY)
    assert len(rollout._pending) == 0
    assert psutil.Process().memory_info().rss - rss < 64 << 20
    st = flashport.stats()["blockwise"]
    assert st["calls"] == 10_040 and st["guard_checks"] == 100 and st["guard_failures"] == 0


# ----------------------------------------------------------------------------- prometheus
def test_prometheus_exporter():
    prometheus_client = pytest.importorskip("prometheus_client")
    from flashport import prometheus
    reg = prometheus_client.CollectorRegistry()
    prometheus.register(reg)
    with flashport.guard(sample_rate=1.0):
        flashport.attention(*_qkv(grad=False))
    text = prometheus_client.generate_latest(reg).decode()
    assert 'flashport_calls_total{backend="blockwise"} 1.0' in text
    assert 'flashport_guard_error_ratio_bucket{backend="blockwise",le="+Inf"} 1.0' in text
    assert "flashport_peak_extra_bytes" in text
    flashport.reset_stats()
    q, k, v = _qkv(grad=False)
    flashport.attention(q, k, v, mask_mod=flashport.mods.causal)
    text = prometheus_client.generate_latest(reg).decode()
    assert 'flashport_builtin_rewrites_total{rule="window"} 1.0' in text
    assert 'flashport_builtin_rewrites_total{rule="documents"} 0.0' in text


# ----------------------------------------------------------------------------- bench --trace
def test_bench_trace_names_every_entry_point(tmp_path):
    from flashport.bench.shapes import Shape
    from flashport.bench.trace import trace
    shapes = [Shape("t", 1, 24, 24, 4, 2, 16, causal=True, dtype="float32"),
              Shape("t", 2, 1, 32, 4, 2, 16, modes=("fwd",), kind="decode", page=8, dtype="float32")]
    path = tmp_path / "trace.json.gz"
    ranges = trace(shapes, torch.device("cpu"), str(path))
    assert ranges == {"flashport::attention[blockwise]": 1, "flashport::attention_backward[blockwise]": 1,
                      "flashport::attention_with_kvcache[blockwise]": 1}, ranges
    import gzip
    assert "flashport::attention_backward[blockwise]" in gzip.open(path).read().decode()


def test_every_cache_is_bounded_and_counted():
    import importlib
    import pkgutil
    for m in pkgutil.walk_packages(flashport.__path__, "flashport."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
    assert monitor.unbounded_caches() == []
    sizes = monitor.cache_sizes()
    assert "dispatch._memo" in sizes and "monitor.visible_pairs" in sizes
    from triton.runtime.jit import JITFunction
    from flashport.kernels import attn_fwd
    if isinstance(attn_fwd._attn_fwd, JITFunction):   # not when imported under TRITON_INTERPRET=1
        assert "kernels.attn_fwd._attn_fwd (compiled)" in sizes
        assert "kernels.attn_fwd_hopper._attn_fwd_hopper (compiled)" in sizes


def test_guard_never_quarantines_a_correct_backend_over_the_fuzzer():
    """The fuzzer's random calls (every entry point, mask, dtype, layout, garbage past lengths) with the
    guard checking each one: the exact backends must never be judged wrong."""
    from flashport.fuzz.driver import run_fuzz
    with flashport.guard(sample_rate=1.0):
        results, summary = run_fuzz(n=300, seed=11, device="cpu", verbose=False)
        assert flashport.quarantined() == {}
    st = flashport.stats()
    assert sum(d["guard_checks"] for d in st.values()) >= 200
    assert all(d["guard_failures"] == 0 for d in st.values())


def test_switch_values_read_as_triton_reads_them_and_typos_warn(monkeypatch):
    """true / yes / on and false / no / off (any case) are 1 and 0; anything else keeps the default and warns once
    (FLASHPORT_CHECKS=true used to leave the checks off silently, FLASHPORT_RANGES=no to leave ranges on)."""
    monkeypatch.setattr(env, "_warned", set())
    for v, want in (("1", True), ("true", True), ("Yes", True), (" on ", True), ("0", False), ("FALSE", False),
                    ("no", False), ("", False)):
        monkeypatch.setenv("FLASHPORT_CHECKS", v)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert env.flag("FLASHPORT_CHECKS") is want, v
    monkeypatch.setenv("FLASHPORT_RANGES", "no")
    assert env.flag("FLASHPORT_RANGES") is False
    monkeypatch.setenv("FLASHPORT_CHECKS", "maybe")
    with pytest.warns(RuntimeWarning, match="FLASHPORT_CHECKS='maybe' is not a 0/1 switch value.*default 0"):
        assert env.flag("FLASHPORT_CHECKS") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # once per value
        assert env.flag("FLASHPORT_CHECKS") is False


def test_an_unknown_name_in_the_kill_switch_warns_once(monkeypatch):
    monkeypatch.setattr(env, "_warned", set())
    monkeypatch.setenv("FLASHPORT_DISABLE", "blockwisex, reference")
    q = torch.randn(1, 8, 2, 8)
    with pytest.warns(RuntimeWarning, match="FLASHPORT_DISABLE names 'blockwisex'.*disables nothing"):
        flashport.attention(q, q, q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashport.attention(q, q, q)
    assert "reference" in dispatch._disabled()

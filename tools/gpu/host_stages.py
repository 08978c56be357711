"""Host time of an eager Gluon forward, stage by stage, next to SDPA's (which peer runs in C++).

    PYTHONPATH=. python3 tools/gpu/host_stages.py [--d 256] [--out stages.json]
    PYTHONPATH=. python3 tools/gpu/host_stages.py --backward [--profile DIR]   # where the autograd backward's time goes

`flashport bench` times eager calls with `do_bench`, whose L2 flush (~85 us on an H200) hides host time only
up to that much: a short cell whose call costs more host time than that reads slow however fast the kernel
is.  Here each stage of one call (spec checks, dispatch, the autograd Function, allocations, descriptors,
the launch) runs back to back 2000 times without a sync on a problem so small (B = 1, H = 1, S = 512) that
the GPU is never the bottleneck: wall time / calls is the host time per call.  Needs an sm_90 GPU.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flashport  # noqa: E402


def per_call_us(fn, calls: int = 2000, repeats: int = 5) -> float:
    """Median over `repeats` of wall time / calls for `calls` back-to-back calls (one sync per batch)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def stages(d: int, causal: bool, only: str = "") -> dict:
    """Host µs per call of each stage whose name matches the regular expression `only`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashport import dispatch
    from flashport.kernels import attn_bwd, attn_bwd_hopper, attn_fwd, attn_fwd_hopper
    from flashport.spec import dense_spec
    dev, dt = torch.device("cuda"), torch.bfloat16
    q, k, v = (torch.randn(1, 512, 1, d, device=dev, dtype=dt) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    kw = dict(causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, deterministic=False, return_lse=False)
    spec, inputs = dense_spec(q, k, v, **kw)
    why = attn_fwd_hopper.reasons(spec, q, k, v)
    if why:
        raise SystemExit(f"the Gluon forward declines this call: {why}")
    out = torch.empty_like(q)
    lse = torch.empty(1, 1, 512, dtype=torch.float32, device=dev)
    grid, args, meta = attn_fwd_hopper.launch_args(spec, q, k, v, out, lse, lse)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    qtg, ktg, vtg = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))

    # backward: the bench's cell is autograd.grad on a recorded graph (retain_graph=True)
    do = torch.randn_like(q)
    out_g = flashport.attention(qg, kg, vg, causal=causal, backend="triton")
    qtgb, ktgb, vtgb = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_s = torch.nn.functional.scaled_dot_product_attention(qtgb, ktgb, vtgb, is_causal=causal)
    o, _, lse2 = attn_fwd.forward(spec, q, k, v)
    dlse = torch.zeros_like(lse2)
    delta = torch.randn_like(lse2)

    def train_step():
        out = flashport.attention(qg, kg, vg, causal=causal, backend="triton")
        return torch.autograd.grad(out, (qg, kg, vg), do)

    def device_context():
        with torch.cuda.device(dev):
            pass

    def sdpa(a, b, c):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal)

    cases = {
        "flashport.attention, inputs requiring grad (the bench's training cells)":
            lambda: flashport.attention(qg, kg, vg, causal=causal, backend="triton"),
        "flashport.attention, no grad": lambda: flashport.attention(q, k, v, causal=causal, backend="triton"),
        "flashport.attention, no grad, backend chosen (auto)": lambda: flashport.attention(q, k, v, causal=causal),
        "spec.dense_spec": lambda: dense_spec(q, k, v, **kw),
        "dispatch.select(spec, 'triton')": lambda: dispatch.select(spec, "triton"),
        "dispatch.select(spec, None)": lambda: dispatch.select(spec, None),
        "backend run (no grad)": lambda: dispatch.get("triton").run(spec, inputs),
        "attn_fwd.forward": lambda: attn_fwd.forward(spec, q, k, v),
        "attn_fwd_hopper.reasons": lambda: attn_fwd_hopper.reasons(spec, q, k, v),
        "attn_fwd_hopper.forward": lambda: attn_fwd_hopper.forward(spec, q, k, v),
        "launch only (DirectLauncher, prebuilt args)": lambda: attn_fwd_hopper.launcher(spec)(grid, args, meta),
        "3 allocations (out, lse, lse2)": lambda: (torch.empty_like(q), torch.empty(1, 1, 512, device=dev),
                                                   torch.empty(1, 1, 512, device=dev)),
        "4 descriptors (Desc objects)": lambda: [attn_fwd_hopper._descriptor(t, 64) for t in (q, k, v, out)],
        "torch.cuda.device(dev) context": device_context,
        "SDPA cuDNN, inputs requiring grad": lambda: sdpa(qtg, ktg, vtg),
        "SDPA cuDNN, no grad": lambda: sdpa(qt, kt, vt),
        "bwd: autograd.grad on a recorded flashport graph (the bench's cell)":
            lambda: torch.autograd.grad(out_g, (qg, kg, vg), do, retain_graph=True),
        "bwd: training step (flashport fwd + autograd.grad)": train_step,
        "bwd: attn_bwd.backward, dlse=None": lambda: attn_bwd.backward(spec, do, q, k, v, o, lse2),
        "bwd: attn_bwd.backward, dlse zeros (as autograd passes it)":
            lambda: attn_bwd.backward(spec, do, q, k, v, o, lse2, dlse=dlse),
        "bwd: attn_bwd_hopper.backward (Delta given; skipped where it declines)":
            lambda: attn_bwd_hopper.reasons(spec, q, k, v, do) or attn_bwd_hopper.backward(spec, do, q, k, v, o,
                                                                                            lse2, delta),
        "bwd: SDPA cuDNN autograd.grad on a recorded graph":
            lambda: torch.autograd.grad(out_s, (qtgb, ktgb, vtgb), do.transpose(1, 2), retain_graph=True),
    }
    return {name: per_call_us(fn) for name, fn in cases.items() if re.search(only, name)}


class _Trivial(torch.autograd.Function):
    """An autograd Function with a Python backward that launches nothing: the engine's own cost."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def backward_stages(d: int, causal: bool) -> dict:
    """The bench's backward cell (autograd.grad on a recorded graph) against its parts: the backward called
    on the main thread, the engine with a Python Function that does nothing, the engine run on the calling
    thread (torch.autograd.set_multithreading_enabled(False)), Python's GC off, and SDPA-cuDNN alike."""
    import gc

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashport.backend import triton as tb
    from flashport.kernels import attn_bwd, attn_fwd
    from flashport.spec import dense_spec
    dev, dt = torch.device("cuda"), torch.bfloat16
    q, k, v = (torch.randn(1, 512, 1, d, device=dev, dtype=dt) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    spec, _ = dense_spec(q, k, v, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    do = torch.randn_like(q)
    out_g = flashport.attention(qg, kg, vg, causal=causal, backend="triton")
    out_t = _Trivial.apply(qg, kg, vg)
    qs, ks, vs = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_s = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    o, _, lse2 = attn_fwd.forward(spec, q, k, v)
    dos = do.transpose(1, 2)

    def ours():
        return torch.autograd.grad(out_g, (qg, kg, vg), do, retain_graph=True)

    def single_threaded(fn):
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                return fn()
        return run

    def gc_off(fn):
        def run():
            gc.disable()
            try:
                return fn()
            finally:
                gc.enable()
        return run

    def trivial():
        return torch.autograd.grad(out_t, (qg, kg, vg), do, retain_graph=True)

    def cudnn():
        return torch.autograd.grad(out_s, (qs, ks, vs), dos, retain_graph=True)

    res = {
        "attn_bwd.backward on the main thread": per_call_us(lambda: attn_bwd.backward(spec, do, q, k, v, o, lse2)),
        "autograd.grad, flashport graph (the bench's cell)": per_call_us(ours),
        "autograd.grad, flashport graph, engine on the calling thread": per_call_us(single_threaded(ours)),
        "autograd.grad, flashport graph, gc disabled": per_call_us(gc_off(ours)),
        "autograd.grad, Python Function that launches nothing": per_call_us(trivial),
        "autograd.grad, Python Function that launches nothing, calling thread": per_call_us(single_threaded(trivial)),
        "autograd.grad, SDPA cuDNN graph": per_call_us(cudnn),
        "autograd.grad, SDPA cuDNN graph, calling thread": per_call_us(single_threaded(cudnn)),
    }
    # Time spent inside the Function's backward itself when the engine calls it (on its device thread).
    inner = []
    original = tb._TritonAttention.backward

    def timed(ctx, dout, dlse):
        t0 = time.perf_counter()
        r = original(ctx, dout, dlse)
        inner.append(time.perf_counter() - t0)
        return r
    tb._TritonAttention.backward = staticmethod(timed)
    try:
        per_call_us(ours, calls=500, repeats=3)
    finally:
        tb._TritonAttention.backward = staticmethod(original)
    res["inside Function.backward, as the engine runs it"] = statistics.median(inner) * 1e6
    return res


def profile(d: int, causal: bool, out_dir: Path) -> None:
    """cProfile (by own time) of 1000 eager forwards, 1000 backwards called directly and 1000 through autograd
    on the calling thread (so that the profiler sees the Function's backward)."""
    import cProfile
    import io
    import pstats

    from flashport.kernels import attn_bwd, attn_fwd
    from flashport.spec import dense_spec
    dev, dt = torch.device("cuda"), torch.bfloat16
    q, k, v = (torch.randn(1, 512, 1, d, device=dev, dtype=dt) for _ in range(3))
    spec, _ = dense_spec(q, k, v, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    o, _, lse2 = attn_fwd.forward(spec, q, k, v)
    do = torch.randn_like(q)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out_g = flashport.attention(qg, kg, vg, causal=causal, backend="triton")

    def autograd_calling_thread():
        with torch.autograd.set_multithreading_enabled(False):
            return torch.autograd.grad(out_g, (qg, kg, vg), do, retain_graph=True)
    for name, fn in (("forward", lambda: flashport.attention(q, k, v, causal=causal, backend="triton")),
                     ("backward", lambda: attn_bwd.backward(spec, do, q, k, v, o, lse2)),
                     ("autograd", autograd_calling_thread)):
        per_call_us(fn, calls=100, repeats=1)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(1000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
        (out_dir / f"profile_{name}_d{d}.txt").write_text(text.getvalue())


def environment() -> dict:
    import os
    import platform
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "cpu": model, "cpus": os.cpu_count(), "loadavg": os.getloadavg()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, nargs="*", default=[256, 128])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--backward", action="store_true", help="only the backward's autograd decomposition")
    ap.add_argument("--profile", type=Path, help="also write cProfile reports of forward and backward here")
    ap.add_argument("--cases", default="", help="only the stages whose name matches this regular expression")
    args = ap.parse_args(argv)
    result = {**environment(), "runs": {}}
    for d in args.d:
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            profile(d, True, args.profile)
        for causal in (True, False):
            label = f"D={d} causal={causal} (B=1, H=1, S=512, bf16)"
            res = backward_stages(d, causal) if args.backward else stages(d, causal, args.cases)
            result["runs"][label] = res
            print(f"\n== {label}: host microseconds per call")
            for name, us in res.items():
                print(f"  {us:8.1f}  {name}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention over a whole long document on one device: a million tokens forward, a quarter million with backward.

Exact attention needs no S x S matrix: flashport computes it tile by tile with an online softmax, so memory
grows linearly with the sequence.  This example runs causal self-attention (a decoder reading one document
whose tokens all see their past) at lengths where the materialised scores alone would not fit on any GPU,
and prints, for each length: time, TFLOP/s (FlashAttention's convention: forward 4·B·H·S²·D, halved for
causal; backward 2.5x forward), peak memory, and what the score matrix [B, H, S, S] would have needed.  A
few query rows are checked against float32 math on the same inputs.  Outputs under --out: long_document.json
and long_document.png (time and memory against length).

    python examples/long_document.py                     # CPU: a scaled-down run (16k tokens), well under a minute
    python examples/long_document.py --device cuda       # GPU: 1,048,576 tokens forward; 131,072 and 262,144
                                                         #      tokens forward and backward (bf16, H=8, D=128)

Beyond one GPU, flashport.distributed.ring_attention shards the sequence over ranks (README, "Long context").
"""
from __future__ import annotations

import argparse
import json
import resource
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

import flashport

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU_DEFAULTS = dict(forward=[1 << 20], train=[1 << 17, 1 << 18], heads=8, head_dim=128, dtype="bf16", repeats=2)
CPU_DEFAULTS = dict(forward=[1 << 14], train=[1 << 12, 1 << 13], heads=2, head_dim=64, dtype="fp32", repeats=1)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def flops(a, seqlen: int, backward: bool) -> float:
    f = 4.0 * a.batch * a.heads * seqlen * seqlen * a.head_dim / (2 if a.causal else 1)
    return f * 2.5 if backward else f


def materialised_bytes(a, seqlen: int) -> int:
    """The score matrix [B, H, S, S] in the input dtype: what a materialising attention writes (its backward
    keeps the probabilities too, as much again)."""
    return a.batch * a.heads * seqlen * seqlen * torch.finfo(DTYPES[a.dtype]).bits // 8


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """CUDA: the allocator's peak.  CPU: the peak growth of the process' resident memory over the run, sampled
    every 2 ms from /proc/self/statm (Linux; elsewhere the process' lifetime high-water mark)."""

    def __init__(self, device):
        self.device, self.kind = device, "peak allocated" if device.type == "cuda" else "peak RSS growth"
        self._stop, self._peak, self._thread = threading.Event(), 0, None

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        elif os.path.exists("/proc/self/statm"):
            self._base = self._peak = self._rss()

            def sample():
                while not self._stop.wait(0.002):
                    self._peak = max(self._peak, self._rss())
            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self._thread is not None:
            return max(self._peak, self._rss()) - self._base
        self.kind = "peak RSS of the process"
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def spot_check(a, q, k, v, out, rows=4) -> float:
    """max |out - float32 math| over a few query rows of head 0 (all the keys each row sees)."""
    s = q.shape[1]
    idx = torch.linspace(0, s - 1, rows, device=q.device).long()
    g = a.heads // a.kv_heads
    qr = q[0, idx, 0].float()                                   # [R, D]
    kh, vh = k[0, :, 0 // g].float(), v[0, :, 0 // g].float()   # [S, D]
    sc = (qr @ kh.T) * a.head_dim ** -0.5
    if a.causal:
        sc = sc.masked_fill(torch.arange(s, device=q.device)[None] > idx[:, None], float("-inf"))
    ref = torch.softmax(sc, -1) @ vh
    return (out[0, idx, 0].float() - ref).abs().max().item()


def measure(a, seqlen: int, backward: bool, bar) -> dict:
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    with PeakMemory(device) as mem:
        r = _measure(a, seqlen, backward, bar, device, dtype)
    r.update(peak_bytes=mem.bytes(), peak_kind=mem.kind)
    return r


def _measure(a, seqlen, backward, bar, device, dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(seqlen)

    def rnd(h):
        return torch.randn(a.batch, seqlen, h, a.head_dim, device=device, dtype=dtype, generator=g)

    q, k, v = rnd(a.heads), rnd(a.kv_heads), rnd(a.kv_heads)
    do = rnd(a.heads) if backward else None
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v) + ((do,) if backward else ()))
    for t in (q, k, v):
        t.requires_grad_(backward)
    fwd_s, bwd_s, err = [], [], None
    flashport.reset_stats()
    for it in range(a.repeats + 1):           # the first run compiles and warms up: not timed
        bar.set_postfix_str(f"S={seqlen:,} {'fwd+bwd' if backward else 'fwd'} {'warm-up' if it == 0 else it}")
        _sync(device)
        t0 = time.perf_counter()
        out = flashport.attention(q, k, v, causal=a.causal)
        _sync(device)
        t1 = time.perf_counter()
        if backward:
            out.backward(do)
            _sync(device)
        t2 = time.perf_counter()
        if it == 0:
            err = spot_check(a, q.detach(), k.detach(), v.detach(), out.detach())
        else:
            fwd_s.append(t1 - t0)
            bwd_s.append(t2 - t1)
        for t in (q, k, v):
            t.grad = None
        del out
        bar.update(1)
    served = {name: (s["forward"], s["backward"]) for name, s in flashport.stats().items() if s["calls"]}
    r = dict(seqlen=seqlen, backward=backward, fwd_s=statistics.median(fwd_s),
             fwd_tflops=flops(a, seqlen, False) / statistics.median(fwd_s) / 1e12, input_bytes=inputs,
             materialised_bytes=materialised_bytes(a, seqlen),
             max_abs_err_sampled_rows=err, backends=served)
    if backward:
        r.update(bwd_s=statistics.median(bwd_s), bwd_tflops=flops(a, seqlen, True) / statistics.median(bwd_s) / 1e12)
    return r


def report(a, r: dict) -> str:
    line = (f"S={r['seqlen']:>9,}  forward {r['fwd_s'] * 1e3:9.1f} ms {r['fwd_tflops']:7.1f} TFLOP/s")
    if r["backward"]:
        line += f"  backward {r['bwd_s'] * 1e3:9.1f} ms {r['bwd_tflops']:7.1f} TFLOP/s"
    line += (f"  | {r['peak_kind']} {human(r['peak_bytes'])} (inputs {human(r['input_bytes'])});"
             f" materialised scores would need {human(r['materialised_bytes'])}"
             f" | sampled rows max|err| {r['max_abs_err_sampled_rows']:.2e} | {sorted(r['backends'])}")
    return line


def plot(a, results: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")                # files only, no display needed
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for backward, label in ((False, "forward"), (True, "backward")):
        rs = sorted((r for r in results if backward is False or r["backward"]), key=lambda r: r["seqlen"])
        if rs:
            key = "bwd_s" if backward else "fwd_s"
            ax_t.plot([r["seqlen"] for r in rs], [r[key] for r in rs], "o-", label=label)
            for r in rs:
                tf = r["bwd_tflops"] if backward else r["fwd_tflops"]
                ax_t.annotate(f"{tf:.0f} TF/s" if tf >= 10 else f"{tf:.2f} TF/s", (r["seqlen"], r[key]),
                              textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax_t.set(xscale="log", yscale="log", xlabel="tokens", ylabel="seconds", title="time (median)")
    ax_t.legend()
    rs = sorted(results, key=lambda r: (r["seqlen"], r["backward"]))
    xs = [r["seqlen"] for r in rs]
    ax_m.plot(xs, [r["peak_bytes"] / 2**30 for r in rs], "o-", label=f"flashport ({rs[0]['peak_kind']})")
    ax_m.plot(xs, [r["materialised_bytes"] / 2**30 for r in rs], "s--", label="materialised scores [B,H,S,S]")
    if a.device_memory:
        ax_m.axhline(a.device_memory / 2**30, color="gray", lw=1, ls=":", label="device memory")
    ax_m.set(xscale="log", yscale="log", xlabel="tokens", ylabel="GiB", title="memory")
    ax_m.legend(fontsize=8)
    fig.suptitle(f"exact {'causal ' if a.causal else ''}attention on one {a.device_name}: B={a.batch} "
                 f"H={a.heads}/{a.kv_heads} D={a.head_dim} {a.dtype}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(a, progress: bool = True) -> list:
    jobs = [(s, False) for s in a.forward] + [(s, True) for s in a.train]
    results = []
    with tqdm(total=len(jobs) * (a.repeats + 1), desc="long document", disable=not progress,
              dynamic_ncols=True, file=sys.stdout) as bar:
        for seqlen, backward in jobs:
            r = measure(a, seqlen, backward, bar)
            results.append(r)
            tqdm.write(report(a, r), file=sys.stdout)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_document.json").write_text(json.dumps(
        {"config": {k: v for k, v in vars(a).items()}, "torch": torch.__version__,
         "flashport": flashport.__version__, "results": results}, indent=1))
    plot(a, results, out / "long_document.png")
    print(f"wrote {out / 'long_document.json'} and {out / 'long_document.png'}")
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--forward", type=int, nargs="*", help="lengths run forward only (GPU default 1048576)")
    p.add_argument("--train", type=int, nargs="*", help="lengths run forward and backward (GPU: 131072 262144)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, help="GQA: key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, help="timed runs per length, after one warm-up (median reported)")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="bidirectional (twice the work)")
    p.add_argument("--out", default="results/long_document")
    a = p.parse_args(argv)
    defaults = GPU_DEFAULTS if torch.device(a.device).type == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.kv_heads = a.kv_heads or a.heads
    dev = torch.device(a.device)
    a.device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    a.device_memory = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 0
    return a


def main(argv=None) -> list:
    a = parse_args(argv)
    print(f"{a.device_name}: B={a.batch} H={a.heads}/{a.kv_heads} D={a.head_dim} {a.dtype} "
          f"{'causal' if a.causal else 'bidirectional'}; forward {a.forward}, forward+backward {a.train}")
    return run(a)


if __name__ == "__main__":
    main()

"""What a benchmark run leaves behind: a printed table, a JSON file (results + the exact command,
the card, versions, timestamp, ceilings) and a matplotlib PNG."""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import sys
import tempfile

import torch


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device) -> dict:
    """Device, card and versions: the facts a number means nothing without."""
    import flashport
    env = {"python": platform.python_version(), "torch": torch.__version__, "flashport": flashport.__version__,
           "platform": platform.platform(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "device": str(device),
           "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        from .peers import versions
        env.update(card=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                   memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), peer_versions=versions())
    else:
        env["card"] = env["cpu"]
    from .. import env as switches
    from .. import table
    env["switches"] = switches.snapshot()   # every declared switch, defaults included
    env["switch_sources"] = switches.sources()
    env["env"] = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")
                  if k in os.environ}
    env["selection_table"] = table.describe(device)
    return env


def document(suite: str, device, entries: list[dict], ceilings: dict | None = None, wall_s: float = 0.0) -> dict:
    first = next((e.get("first_call_s") for e in entries if e.get("impl") == "flashport-triton"
                  and e.get("status") == "ok" and e.get("first_call_s") is not None), None)
    return {"suite": suite, "command": shlex.join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            "argv": sys.argv, "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(wall_s, 1), "environment": environment(device), "ceilings": ceilings or {},
            # the very first flashport call of the run: Triton compilation + autotuning included
            "flashport_first_call_s": first, "results": entries}


def write_json(doc: dict, path: str) -> None:
    """Write atomically (temporary file, then rename): a run killed mid-write leaves the last good JSON.

    The temporary file gets a unique name in the target's directory (same file system, so os.replace is
    atomic): two writers of one path -- a checkpoint and the final write, two runs sharing --out -- never
    write into each other's temporary file; the last rename wins with a whole document."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.chmod(tmp, 0o644)   # mkstemp's 0600 would make the results private to this user
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


# ----------------------------------------------------------------------------- tables
def _fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def _table(head, rows) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line("-" * w for w in widths)] + [line(r) for r in rows])


def cpu_table(entries: list[dict], summary: dict | None = None) -> str:
    head = ("row", "impl", "backend", "status", "time s", "GFLOP/s", "vs sdpa-cpu", "peak extra MiB", "err vs fp64",
            "vs naive", "threads", "note")
    rows = [(e.get("label", e["s"]), e["impl"], e.get("backend", "-"), e["status"], _fmt(e.get("time_s")),
             _fmt(e.get("gflops")), _fmt((e.get("paired") or {}).get("vs_sdpa_cpu",
                                                                 (e.get("speedup_vs") or {}).get("sdpa-cpu")), ".2f"),
             _fmt(e.get("peak_extra_mb"), ".1f"), _fmt(e.get("max_err_vs_fp64"), ".1e"),
             _fmt(e.get("max_diff_vs_naive", e.get("max_diff_flashport_vs_naive")), ".1e"), e.get("threads", "-"),
             (e.get("error") or "")[:60]) for e in entries]
    text = _table(head, rows)
    if summary:
        text += (f"\nbackend=None vs SDPA-CPU, min over the rows SDPA serves: {_fmt(summary['min_auto_vs_sdpa'], '.2f')}x; "
                 f"blockwise: {_fmt(summary['min_blockwise_vs_sdpa'], '.2f')}x (threads {summary['threads']})")
    return text


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _graph_cell(e: dict) -> str:
    """Decode entries: CUDA-graph replay median as 'ms GB/s copy%' ('*' = capture failed, eager)."""
    if e.get("graph_ms") is None:
        return "-"
    star = "*" if e.get("graph_fallback") else ""
    return f"{_fmt(e['graph_ms'])}{star} {_fmt(e.get('graph_gbps'), '.0f')} {_pct(e.get('graph_frac_of_copy'))}"


def gpu_table(entries: list[dict]) -> str:
    head = ("shape", "mode", "impl", "status", "ms", "host us", "TFLOP/s | GB/s", "MFU | copy",
            "graph: ms GB/s copy", "first call s", "speedup vs peers (graph)", "note")
    rows = []
    for e in entries:
        rate = e.get("tflops", e.get("gbps"))
        frac = e.get("mfu", e.get("frac_of_copy"))
        graph_sp = e.get("graph_speedup_vs") or {}
        sp = " ".join(f"{k}:{v:.2f}" + (f" ({graph_sp[k]:.2f})" if k in graph_sp else "")
                      for k, v in (e.get("speedup_vs") or {}).items())
        note = e.get("error") or e.get("graph_fallback") or ""
        rows.append((e["label"], e["mode"], e["impl"], e["status"], _fmt(e.get("ms")), _fmt(e.get("host_us"), ".0f"),
                     _fmt(rate, ".1f"),
                     _pct(frac), _graph_cell(e), _fmt(e.get("first_call_s"), ".2f"), sp, note[:70]))
    return _table(head, rows)


# ----------------------------------------------------------------------------- plots
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


_CPU_STYLE = {"flashport": "o-", "sdpa-cpu": "^-", "blockwise": "d:", "naive": "s--"}


def plot_cpu(doc: dict, path: str) -> None:
    """Left: forward time over S (non-causal rows); middle: every row's speed relative to SDPA-CPU (> 1: faster;
    a row SDPA cannot serve is marked); right: peak extra memory over S."""
    plt = _plt()
    entries = doc["results"]
    fig, (ax_t, ax_r, ax_m) = plt.subplots(1, 3, figsize=(17, 5.2))
    dense = [e for e in entries if e.get("mode", "fwd") == "fwd" and not e.get("causal")
             and tuple(e.get("window", (-1, -1))) == (-1, -1) and not e.get("docs")]
    for impl in dict.fromkeys(e["impl"] for e in entries):
        ok = [e for e in dense if e["impl"] == impl and e["status"] == "ok"]
        if impl == "flashport":
            label = f"flashport backend=None ({ok[0].get('backend', 'auto') if ok else 'auto'})"
        else:
            label = {"sdpa-cpu": "torch SDPA (CPU flash)", "blockwise": "flashport blockwise",
                     "naive": "naive materialised"}.get(impl, impl)
        style = _CPU_STYLE.get(impl, ".-")
        ax_t.plot([e["s"] for e in ok], [e["time_s"] for e in ok], style, label=label)
        ax_m.plot([e["s"] for e in ok], [max(e["peak_extra_mb"], 1e-3) for e in ok], style, label=label)
        for e in dense:
            if e["impl"] == impl and e["status"] not in ("ok", "not-served"):
                ax_t.annotate(f"{impl} {e['status']}", (e["s"], 0.5), xycoords=("data", "axes fraction"),
                              rotation=90, fontsize=7, ha="right", va="center", color="grey")
    for ax, title, unit in ((ax_t, "forward time, non-causal", "seconds (best of 3)"),
                            (ax_m, "peak extra memory, forward (fresh process, ru_maxrss)", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    labels = list(dict.fromkeys(e.get("label", str(e["s"])) for e in entries))
    by = {(e.get("label", str(e["s"])), e["impl"]): e for e in entries}
    series = [i for i in ("flashport", "blockwise", "naive") if any(x["impl"] == i for x in entries)]
    width = 0.8 / max(1, len(series))
    for n, impl in enumerate(series):
        vals = [(by.get((lab, impl), {}).get("paired") or {}).get("vs_sdpa_cpu")
                or (by.get((lab, impl), {}).get("speedup_vs") or {}).get("sdpa-cpu") or 0 for lab in labels]
        ax_r.bar([i + n * width for i in range(len(labels))], vals, width,
                 label="backend=None" if impl == "flashport" else impl)
    for i, lab in enumerate(labels):
        sd = by.get((lab, "sdpa-cpu"), {})
        if sd.get("status") != "ok":
            ax_r.annotate(f"SDPA: {sd.get('status', 'n/a')}", (i + 0.4 - width / 2, 0.05),
                          xycoords=("data", "axes fraction"), rotation=90, fontsize=7, ha="center", color="grey")
    ax_r.axhline(1.0, color="grey", ls=":", lw=1)
    ax_r.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax_r.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax_r.set_ylabel("SDPA-CPU time / time  (> 1: faster)")
    ax_r.set_title("speed relative to torch SDPA-CPU (runs alternated with it in one process)", fontsize=9)
    ax_r.grid(True, axis="y", alpha=0.3)
    ax_r.legend(fontsize=7)
    c = next((e for e in entries), {}).get("config", {})
    threads = sorted({e["threads"] for e in entries if "threads" in e}) or ["?"]
    fig.suptitle(f"flashport on a CPU, fp32, B={c.get('b')} H={c.get('h')} D={c.get('d')} -- "
                 f"{doc['environment']['card']} ({'/'.join(map(str, threads))} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gpu(doc: dict, path: str) -> None:
    """Lines of TFLOP/s (or GB/s for decode) against S, one panel per (mode, head dim[, causal])."""
    plt = _plt()
    ok = [e for e in doc["results"] if e["status"] == "ok"]
    decode = any(e["shape"]["kind"] == "decode" for e in doc["results"])
    if not ok:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.text(0.5, 0.5, "no successful measurement", ha="center")
        ax.axis("off")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    if doc["suite"] == "workloads":
        _ratio_bars(plt, doc, ok, path)
        return
    if decode or doc["suite"] == "models":
        _bars(plt, doc, ok, path, "gbps" if decode else "tflops")
        return
    # rows: (mode, causal) with forward first; columns: head dim
    row_keys = sorted({(e["mode"] != "fwd", e["shape"]["causal"]) for e in ok})
    col_keys = sorted({e["shape"]["d"] for e in ok})
    fig, axes = plt.subplots(len(row_keys), len(col_keys), figsize=(5 * len(col_keys), 3.4 * len(row_keys)),
                             squeeze=False)
    panels = [(r, c) for r in range(len(row_keys)) for c in range(len(col_keys))]
    for r, c in panels:
        ax = axes[r][c]
        (is_bwd, causal), d = row_keys[r], col_keys[c]
        mode = "bwd" if is_bwd else "fwd"
        for impl in dict.fromkeys(e["impl"] for e in ok):
            pts = sorted((e["shape"]["sq"], e["tflops"]) for e in ok if e["impl"] == impl and e["mode"] == mode
                         and e["shape"]["d"] == d and e["shape"]["causal"] == causal)
            if pts:
                ax.plot(*zip(*pts), "o-" if impl.startswith("flashport") else ".--", label=impl)
        mm = doc["ceilings"].get("matmul_bf16_tflops")
        if mm:
            ax.axhline(mm, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode} d{d} {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_xlabel("S")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    frontend = f" --frontend {doc['frontend']}" if doc.get("frontend", "torch") != "torch" else ""
    fig.suptitle(f"flashport bench --suite {doc['suite']}{frontend} on {doc['environment']['card']} "
                 f"(matmul ceiling dotted)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio_bars(plt, doc, ok, path):
    """Per cell, each flashport implementation's ratio to the best peer that serves it (best peer ms / ours,
    > 1 is faster); a cell no peer serves (ragged paged decode) shows its fraction of the copy ceiling."""
    mine = [e for e in ok if e["impl"].startswith("flashport")]
    groups = list(dict.fromkeys((e["label"], e["mode"]) for e in mine))
    impls = list(dict.fromkeys(e["impl"] for e in mine))
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(groups)), 5.5))
    for n, impl in enumerate(impls):
        vals = []
        for g in groups:
            e = next((x for x in mine if (x["label"], x["mode"]) == g and x["impl"] == impl), {})
            vals.append(e.get("vs_best_peer") or e.get("graph_frac_of_copy") or e.get("frac_of_copy") or 0)
        ax.bar([i + n * width for i in range(len(groups))], vals, width, label=impl)
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    peerless = {(e["label"], e["mode"]) for e in mine if e.get("vs_best_peer") is None}
    _finish_bars(plt, fig, ax, doc, path, width,
                 [f"{lab}\n{mode}" + (" (of copy)" if (lab, mode) in peerless else "") for lab, mode in groups],
                 "best peer ms / flashport ms  (> 1: faster)")


def _finish_bars(plt, fig, ax, doc, path, width, ticks, ylabel) -> None:
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ticks))])
    ax.set_xticklabels(ticks, rotation=30, ha="right", fontsize=6 if len(ticks) > 16 else 7)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(f"flashport bench --suite {doc['suite']} on {doc['environment']['card']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(plt, doc, ok, path, key):
    groups = list(dict.fromkeys((e["label"], e["mode"]) for e in ok))
    # one series per (implementation, timing): decode entries also carry CUDA-graph replay rates
    series = [(impl, k) for impl in dict.fromkeys(e["impl"] for e in ok)
              for k in (key, "graph_" + key) if any(e["impl"] == impl and e.get(k) is not None for e in ok)]
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(groups)), 5))
    for n, (impl, k) in enumerate(series):
        vals = [next((e.get(k) or 0 for e in ok if (e["label"], e["mode"]) == g and e["impl"] == impl), 0)
                for g in groups]
        ax.bar([i + n * width for i in range(len(groups))], vals, width,
               label=impl + (" (CUDA graph)" if k.startswith("graph_") else ""))
    ceiling = doc["ceilings"].get("copy_gbps" if key == "gbps" else "matmul_bf16_tflops")
    if ceiling:
        ax.axhline(ceiling, color="grey", ls=":", lw=1, label="copy ceiling" if key == "gbps" else "matmul ceiling")
    _finish_bars(plt, fig, ax, doc, path, width, [f"{lab}\n{mode}" for lab, mode in groups],
                 "GB/s of K+V read" if key == "gbps" else "TFLOP/s")

"""`flashport bench`: the benchmark harness (one harness for every platform).

- On a CPU (suite `cpu`): flashport's auto backend against torch SDPA-CPU (its flash kernel), naive
  materialised attention and flashport's blockwise, fp32, H=4, D=64: forward over S from 1k to 16k, and
  forward causal, forward+backward causal and a sliding window at 4k; time and peak memory per
  configuration in a fresh subprocess, the thread count recorded.
- On a GPU (suites `standard`, `models`, `long`, `decode`): flashport's triton backend against
  SDPA cuDNN / FA2 / mem-efficient and compiled FlexAttention in the same process, with ceilings
  (matmul TFLOP/s, copy GB/s) measured in the same run.

Modules: shapes (what), timing (how long, ceilings), peers (the implementations), gpu / cpu (the
jobs), report (table, JSON, PNG).  Results land in --out (default results/) as bench_<suite>.json
and bench_<suite>.png.
"""
from __future__ import annotations

import argparse
import os
import re
import time

SUITES = ("auto", "cpu", "standard", "models", "workloads", "long", "decode", "programmable")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a count of heads, rounds or threads that must do something)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def regex(text: str) -> str:
    """argparse type: a pattern re compiles (checked before any work, not when the first label is matched)."""
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression ({e})") from None
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", choices=SUITES, default="auto",
                   help="auto = standard on a GPU, cpu otherwise")
    p.add_argument("--out", default="results", help="directory for the JSON and PNG (default: results)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of the harness in seconds")
    p.add_argument("--device", default=None, help="cuda[:N] or cpu (default: cuda if available)")
    p.add_argument("--peers", default=None,
                   help="GPU: comma-separated implementations (default: flashport-triton,sdpa-cudnn,sdpa-fa2,"
                        "sdpa-efficient,flex)")
    p.add_argument("--heads", type=positive_int, default=4, help="CPU job: heads H (B=1, D=64)")
    p.add_argument("--max-s", type=positive_int, default=None, help="CPU job: largest sequence length")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="CPU job: wall-clock budget; sizes predicted to overrun it are reported as time-skipped")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU job: torch threads per worker (default: torch's own, all cores); on a shared, busy "
                        "machine 1 avoids OpenMP spin-wait stalls that swamp small tiled ops")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--auto-vs-best", action="store_true",
                   help="GPU: instead of the peers, time every eligible backend and backend=None per cell, forward "
                        "and backward (flashport/tune.py), into bench_<suite>_autobest.json")
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="--auto-vs-best: interleaved timing rounds per cell (default 5)")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="GPU: after the timed runs, one forward+backward of every cell (backend=None) under "
                        "torch.profiler, written as a Chrome trace (.json or .json.gz)")
    p.add_argument("--match", type=regex, default=None, metavar="REGEX",
                   help="GPU: only the suite's shapes whose label matches (e.g. 's1024 h16 d128'), to re-measure a cell")
    p.add_argument("--frontend", choices=("torch", "jax"), default="torch",
                   help="jax: the flashport.jax backends (cudnn, blockwise, xla on a GPU; pallas-tpu on a TPU) on the "
                        "standard suite beside the torch frontend's backend=None, into bench_standard_jax*.json / .png "
                        "(--peers names JAX backends; on a CPU the suite is scaled down)")


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return None, (lambda: None)
    bar = tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True)
    return bar, (lambda: bar.update(1))


def run(args: argparse.Namespace) -> int:
    if getattr(args, "frontend", "torch") == "jax":
        from ..cli import JAX_MISSING, import_jax_frontend
        if import_jax_frontend() is None:
            print(JAX_MISSING)
            return 2
        from ..jax.bench import run_cli
        return run_cli(args)
    import torch

    from . import report
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    suite = args.suite if args.suite != "auto" else ("standard" if device.type == "cuda" else "cpu")
    stem = f"bench_{suite}" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    t0, load0 = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    if suite == "cpu":
        from .cpu import run_cpu
        from .shapes import cpu_sizes
        sizes = cpu_sizes(args.quick, args.max_s)
        from .cpu import summary
        from .shapes import CPU_IMPLS, cpu_rows
        bar, tick = _progress(len(CPU_IMPLS) * len(cpu_rows(sizes, args.quick)), "cpu: flashport vs sdpa-cpu, naive")
        entries = run_cpu(sizes, args.heads, tick, budget_s=args.budget_s, threads=args.threads, quick=args.quick)
        ceil = {}
        table = report.cpu_table(entries, summary(entries))
    else:
        if device.type != "cuda":
            print(f"flashport bench: suite {suite!r} needs a CUDA device (found {device}); use --suite cpu")
            return 2
        from . import gpu, peers
        from .shapes import gpu_suite
        if suite == "programmable":
            return _programmable(device, args, stem, t0, load0)
        from .timing import ceilings
        impls = _impls(args.peers, peers.DENSE, peers.DENSE)
        if impls is None:
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        shapes = gpu_suite(suite, args.quick)
        if args.match:
            shapes = [s for s in shapes if re.search(args.match, s.label())]
        if args.auto_vs_best:
            return _auto_vs_best(suite, shapes, device, args, t0)
        ceil = ceilings(device)
        n = sum(len([i for i in impls if s.kind != "decode" or i in peers.DECODE]) for s in shapes)
        bar, tick = _progress(n, f"{suite}: flashport vs peers")
        partial_path = os.path.join(args.out, stem + ".json")

        def checkpoint(done):  # the JSON so far, marked partial: a cut run keeps what it measured
            part = report.document(suite, device, done, ceil, time.perf_counter() - t0)
            part["partial"] = (f"{len({e['label'] for e in done})} of {len(shapes)} shapes; "
                               f"the run stopped before the rest")
            part["environment"]["loadavg_at_start"] = load0
            report.write_json(part, partial_path)
        entries = gpu.run_suite(suite, shapes, impls, device, ceil, tick, checkpoint)
        table = report.gpu_table(entries)
        if args.trace:
            from .trace import trace
            ranges = trace(shapes, device, args.trace)
            print(f"trace: {args.trace}: " + (", ".join(f"{n} x{c}" for n, c in sorted(ranges.items()))
                                               or "no flashport ranges (FLASHPORT_RANGES=0?)"))
    if bar is not None:
        bar.close()
    doc = report.document(suite, device, entries, ceil, time.perf_counter() - t0)
    doc["environment"]["loadavg_at_start"] = load0   # other work on the machine skews timings
    if suite == "cpu":
        doc["cpu_summary"] = summary(entries)
    json_path, png_path = (os.path.join(args.out, stem + ext) for ext in (".json", ".png"))
    report.write_json(doc, json_path)
    (report.plot_cpu if suite == "cpu" else report.plot_gpu)(doc, png_path)
    print(table)
    if ceil:
        print("ceilings: " + ", ".join(f"{k}={v}" for k, v in ceil.items()))
    if doc.get("flashport_first_call_s") is not None:
        print(f"first flashport call (compile + autotune): {doc['flashport_first_call_s']:.2f} s")
    print(f"wrote {json_path} and {png_path} ({doc['wall_s']} s)")
    return 0


def _impls(peers_arg, default, known):
    """--peers as a list (the suite's default without it), or None after saying which names are unknown."""
    impls = [s.strip() for s in peers_arg.split(",")] if peers_arg else list(default)
    unknown = [i for i in impls if i not in known]
    if unknown:
        print(f"flashport bench: unknown implementation(s) {unknown}; known: {', '.join(known)}")
        return None
    return impls


def _programmable(device, args, stem, t0, load0) -> int:
    import torch

    from . import programmable, report
    impls = _impls(args.peers, programmable.DEFAULT_IMPLS, programmable.IMPLS)
    if impls is None:
        return 2
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    n = len(programmable.cases(device, args.quick)) * len(impls)
    bar, tick = _progress(n, "programmable: flashport vs Flex")
    json_path, png_path = (os.path.join(args.out, stem + ext) for ext in (".json", ".png"))
    n_cases = len({c.label() for c in programmable.cases(device, args.quick)
                   if not args.match or re.search(args.match, c.label())})

    def checkpoint(done):  # the JSON so far, marked partial: a cut run keeps what it measured
        part = report.document("programmable", device, done, {}, time.perf_counter() - t0)
        part["partial"] = f"{len({e['label'] for e in done})} of {n_cases} cases; the run stopped before the rest"
        part["environment"]["loadavg_at_start"] = load0
        report.write_json(part, json_path)
    entries = programmable.run_suite(device, args.quick, impls, tick, args.match, checkpoint)
    if bar is not None:
        bar.close()
    doc = report.document("programmable", device, entries, {}, time.perf_counter() - t0)
    doc["environment"]["loadavg_at_start"] = load0
    report.write_json(doc, json_path)
    programmable.plot(doc, png_path)
    print(programmable.table(entries))
    print(f"wrote {json_path} and {png_path} ({doc['wall_s']} s)")
    return 0


def _auto_vs_best(suite, shapes, device, args, t0) -> int:
    from .. import table as selection
    from .. import tune
    from . import report
    tuned = [s for s in shapes if s.kind in tune.TUNED_KINDS]
    bar, tick = _progress(len(tuned), f"{suite}: auto vs every backend")
    rows = []
    path = os.path.join(args.out, f"bench_{suite}_autobest" + (f"_{args.tag}" if args.tag else "") + ".json")
    for shape in tuned:
        rows.append(tune.measure_shape(shape, device, with_auto=True, rounds=args.rounds))
        tick()
        cells = tune.auto_vs_best(rows)
        doc = report.document(suite, device, [], {}, time.perf_counter() - t0)
        doc["auto_vs_best"] = {"cells": cells, "min_ratio": min((c["ratio"] for c in cells), default=None),
                               "min_ratio_by_mode": {m: min(c["ratio"] for c in cells if c["mode"] == m)
                                                     for m in dict.fromkeys(c["mode"] for c in cells)},
                               "min_ratio_bwd_uncoupled": min((c["ratio"] for c in cells if c["mode"] == "bwd"
                                                               and not c.get("coupled")), default=None),
                               "coupled_bwd_cells": sum(1 for c in cells if c.get("coupled")),
                               "rounds": args.rounds,
                               "min_choice_ratio": min((c["choice_ratio"] for c in cells
                                                        if c["choice_ratio"] is not None), default=None),
                               "table": selection.describe(device), "rows": rows}
        report.write_json(doc, path)
    if bar is not None:
        bar.close()
    for c in cells:
        print(f"{c['label']:<44} {c['mode']}  auto {c['auto_plan']:<14} {c['auto_ms']:8.3f} ms  best {c['best']:<14} "
              f"{c['best_ms']:8.3f} ms  ratio {c['ratio']:.3f} choice {c['choice_ratio'] or 0:.3f}"
              + ("  (coupled: the step is the cell)" if c.get("coupled") else ""))
    avb = doc["auto_vs_best"]
    print(f"min ratio {avb['min_ratio']} (by mode {avb['min_ratio_by_mode']}; backward cells not coupled to a "
          f"slower step: {avb['min_ratio_bwd_uncoupled']}, {avb['coupled_bwd_cells']} coupled); wrote {path}")
    return 0

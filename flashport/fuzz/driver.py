"""The fuzz run: cases 0..n-1 of a seed, in this process or in W spawned workers, a JSON-lines log and a
summary.  `flashport check --fuzz N --seed S --log PATH` and `python -m flashport.fuzz` both land here.

Workers (torch.multiprocessing, 'spawn'): the parent hands each free worker the next case index (all
share Triton's on-disk kernel cache) and receives its result, and writes the log and the summary.
A worker whose CUDA context dies (illegal memory access, ...) or whose process crashes is replaced; the
case it was running is a FAIL.  `max_seconds`: no case starts after that many seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter, defaultdict
from typing import Optional

import torch

from .. import env
from .cases import DTYPE_NAMES, ENTRIES, FOCUS_ENTRIES, draw_case, recipe_pool
from .variants import GPU_CLASSES, Recorder, jit_cache_keys, variant_class

FAILING = ("FAIL", "TIMEOUT", "CRASH")
CASE_TIMEOUT = 900.0     # seconds without a result before a worker is presumed hung and replaced


def _interpreting() -> bool:
    return env.interpreting()


def _dtype_names(dtypes, device: torch.device) -> tuple:
    if dtypes:
        names = [d if isinstance(d, str) else str(d).replace("torch.", "") for d in dtypes]
        bad = [n for n in names if n not in DTYPE_NAMES]
        if bad:
            raise ValueError(f"dtypes: {bad} not among {DTYPE_NAMES}")
        return tuple(n for n in DTYPE_NAMES if n in names)
    if device.type == "cuda":
        return DTYPE_NAMES
    # Triton's interpreter computes bf16 dots wrongly: fp32 / fp16 there
    return ("float16", "float32") if _interpreting() else DTYPE_NAMES


def _default_device() -> str:
    if _interpreting():
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def repro_command(seed: int, index: int, params: dict) -> str:
    cmd = (f"python -m flashport.fuzz --seed {seed} --case {index} --size {params['size']} "
           f"--dtype {','.join(params['dtypes'])} --device {params['device']}")
    if params.get("backend"):
        cmd += f" --backend {params['backend']}"
    if params.get("entries") and tuple(params["entries"]) != ENTRIES:
        cmd += f" --entries {','.join(params['entries'])}"
    if params.get("compiled"):
        cmd += " --compiled"
    return ("TRITON_INTERPRET=1 " if params.get("interpret") else "") + cmd


# ----------------------------------------------------------------------------- one process
def _run_indices(indices, params: dict, deadline: Optional[float], emit) -> dict:
    """Run the cases `indices` (any iterable: a spawned worker's pulls them from the parent) here, calling
    emit(kind, payload) for "start" / "result"; -> hooks and jit stats ("fatal": the index that left the CUDA
    context unusable)."""
    device = params["device"]
    rec = Recorder()
    from .execute import use_compiled
    use_compiled(params.get("compiled", False))
    with rec.hooks(device):
        for i in indices:
            if deadline is not None and time.time() > deadline:
                break
            emit("start", i)
            if params.get("spawned") and os.environ.get("FLASHPORT_FUZZ_TEST_CRASH") == str(i):
                os._exit(3)          # tests only: a worker that dies in this case (tests/test_fuzz.py)
            case = draw_case(params["seed"], i, params["size"], params["dtypes"], params["entries"])
            res = _run_one(case, device, params["backend"], rec)
            res["repro"] = repro_command(params["seed"], i, params)
            emit("result", res)
            if res.get("fatal"):     # the CUDA context is gone: nothing more can run in this process
                return {"hooks": rec.installed, "hooks_missing": rec.missing, "jit_keys": {}, "fatal": i}
    keys = {}
    try:
        keys = jit_cache_keys()
    except Exception:  # noqa: BLE001 - best effort
        pass
    return {"hooks": rec.installed, "hooks_missing": rec.missing, "jit_keys": keys}


def _oom(res: dict) -> bool:
    return res["status"] == "FAIL" and "out of memory" in res.get("note", "")


def _run_one(case, device, backend, rec) -> dict:
    """run_case, once more after releasing cached memory if the first try ran out of GPU memory (the other
    workers' caches, not this case's needs); peak_mb: the case's peak of allocated GPU memory."""
    from .execute import run_case
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    res = run_case(case, device, backend, rec)
    if cuda and _oom(res):
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        res = run_case(case, device, backend, rec)
        res["oom_retry"] = True
    if cuda:
        res["peak_mb"] = round(torch.cuda.max_memory_allocated() / 2 ** 20)
        if _oom(res):
            torch.cuda.empty_cache()
    return res


def _worker(params: dict, conn, threads: int) -> None:
    """Entry point of a spawned worker: asks the parent for a case index ("ready" / a result), runs it, sends
    the result, until told to stop.  A pipe: each send is written before it returns, so what a worker sent
    before dying always arrives."""
    def pull():
        while True:
            kind, index = conn.recv()
            if kind != "case":
                return
            yield index

    try:
        torch.set_num_threads(max(1, threads))
        if torch.device(params["device"]).type == "cuda":
            dev = torch.device(params["device"])
            torch.cuda.set_device(dev.index if dev.index is not None else 0)
            # W workers share one card: each caching allocator keeps to its share (it frees its cache and
            # retries before running out), leaving room for the CUDA contexts and Triton's modules
            torch.cuda.set_per_process_memory_fraction(0.85 / params["workers"])
        conn.send(("ready", None))
        stats = _run_indices(pull(), params, None,
                             lambda kind, payload: conn.send((kind, payload)) if kind == "result" else None)
        conn.send(("dead" if "fatal" in stats else "done", stats))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    finally:
        conn.close()


# ----------------------------------------------------------------------------- the run
class _Run:
    def __init__(self, params: dict, log_path: Optional[str], verbose: bool, out):
        self.params, self.verbose, self.out = params, verbose, out
        self.results: dict[int, dict] = {}
        self.t0 = time.time()
        self.stats: list[dict] = []
        self.log = open(log_path, "w") if log_path else None
        self.total = len(params["indices"])
        self.next_report = max(10, self.total // 20)

    def write(self, obj: dict) -> None:
        if self.log:
            self.log.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
            self.log.flush()

    def add(self, res: dict) -> None:
        self.results[res["index"]] = res
        self.write({"type": "case", **res})
        if res["status"] in FAILING or res["status"] == "BADREF":
            w = res.get("worst") or {}
            self.out(f"[fuzz] {res['status']} case {res['index']} ({res['entry']} {res['dtype']}): "
                     f"{w.get('name', '-')} err {w.get('err', float('nan')):.3e} bound {w.get('bound', float('nan')):.3e}"
                     f"{' -- ' + res['note'] if res.get('note') else ''}\n        {res['case_text']}\n"
                     f"        repro: {res['repro']}")
        done = len(self.results)
        if self.verbose and (done % self.next_report == 0 or done == self.total):
            fails = sum(r["status"] in FAILING for r in self.results.values())
            self.out(f"[fuzz] {done}/{self.total} cases, {fails} failing, {time.time() - self.t0:.0f} s")

    def lost(self, index: int, status: str, note: str) -> None:
        case = draw_case(self.params["seed"], index, self.params["size"], self.params["dtypes"],
                         self.params["entries"])
        self.add({"index": index, "seed": self.params["seed"], "entry": case.entry, "dtype": case.dtype,
                  "regime": case.regime, "case": case.to_dict(), "status": status, "note": note, "seconds": 0.0,
                  "quantities": {}, "worst": None, "variants": [], "served": None,
                  "repro": repro_command(self.params["seed"], index, self.params),
                  "case_text": case.describe()})


def _local(run: _Run, deadline) -> None:
    from .cases import FuzzCase

    def emit(kind, payload):
        if kind == "result":
            payload["case_text"] = FuzzCase.from_dict(payload["case"]).describe()
            run.add(payload)
    stats = _run_indices(run.params["indices"], run.params, deadline, emit)
    run.stats.append(stats)
    if "fatal" in stats:
        run.out(f"[fuzz] case {stats['fatal']} left the CUDA context unusable: the remaining cases were not run "
                f"(with --workers > 1 a fresh worker takes over)")


def _spawned(run: _Run, workers: int, deadline) -> None:
    """W spawned workers, each handed the next case index as soon as it is free (a static split i = w (mod W)
    left one worker with twice the others' compile time in a measured 5000-case run); past the deadline no
    index is handed out."""
    import collections

    import torch.multiprocessing as mp
    from multiprocessing.connection import wait

    from .cases import FuzzCase
    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // workers)
    pending = collections.deque(run.params["indices"])
    procs, conns, inflight, starts = {}, {}, {}, Counter()

    def start(w):
        if not pending or (deadline is not None and time.time() > deadline):
            return
        starts[w] += 1
        if starts[w] > 20:           # it cannot even start (or dies in every case): give the rest up
            if not conns:
                while pending:
                    run.lost(pending.popleft(), "CRASH", "workers could not run (restarted 20 times)")
            return
        here, there = ctx.Pipe(duplex=True)
        p = ctx.Process(target=_worker, args=({**run.params, "spawned": True}, there, threads), daemon=True)
        p.start()
        there.close()                # the parent keeps its end only: EOF once the worker is gone
        procs[w], conns[w] = p, here

    def hand_out(w):
        """The next index to worker w, or stop."""
        if pending and (deadline is None or time.time() <= deadline):
            i = pending.popleft()
            inflight[w] = (i, time.time())
            conns[w].send(("case", i))
        else:
            inflight[w] = (None, time.time())
            conns[w].send(("stop", None))

    def retire(w, why: Optional[str]):
        """Worker w is gone (why: None = finished normally); its case in flight, if any, is reported."""
        conn, p = conns.pop(w), procs.pop(w)
        conn.close()
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join(timeout=30)
        index = inflight.pop(w, (None, 0))[0]
        if why is not None:
            if index is not None and index not in run.results:
                run.lost(index, "TIMEOUT" if why == "hung" else "CRASH",
                         f"worker {'hung' if why == 'hung' else f'exited with code {p.exitcode}'} in this case")
            start(w)

    for w in range(workers):
        start(w)
    while conns:
        ready = wait(list(conns.values()), timeout=1.0)
        for w in [w for w, c in conns.items() if c in ready]:
            try:
                kind, payload = conns[w].recv()
            except (EOFError, OSError):
                retire(w, "crashed")
                continue
            try:
                if kind == "ready":
                    hand_out(w)
                elif kind == "result":
                    payload["case_text"] = FuzzCase.from_dict(payload["case"]).describe()
                    run.add(payload)
                    inflight[w] = (None, time.time())
                    if not payload.get("fatal"):
                        hand_out(w)
                elif kind in ("done", "dead"):   # dead: its CUDA context is gone, a fresh worker takes over
                    run.stats.append(payload)
                    inflight.pop(w, None)
                    retire(w, None if kind == "done" else "dead")
            except (BrokenPipeError, OSError):
                retire(w, "crashed")
        for w in list(conns):
            index, since = inflight.get(w, (None, time.time()))
            if index is not None and time.time() - since > CASE_TIMEOUT:
                procs[w].kill()
                retire(w, "hung")
    while pending and deadline is None:    # every worker gave up (restarted 20 times)
        run.lost(pending.popleft(), "CRASH", "workers could not run (restarted 20 times)")


def summarize(results: list[dict], params: dict, seconds: float, stats: list[dict]) -> dict:
    status = Counter(r["status"] for r in results)
    by_entry, by_dtype, by_variant, by_class = (defaultdict(Counter) for _ in range(4))
    for r in results:
        for table, key in ((by_entry, r["entry"]), (by_dtype, r["dtype"])):
            table[key]["cases"] += 1
            table[key][r["status"]] += 1
            table[key]["seconds"] += r.get("seconds", 0.0)
        classes = set()
        for label in r.get("variants", []):
            by_variant[label]["cases"] += 1
            by_variant[label][r["status"]] += 1
            c = variant_class(label)
            if c:
                classes.add(c)
        for c in classes:
            by_class[c]["cases"] += 1
            by_class[c][r["status"]] += 1
    keys = defaultdict(set)
    for s in stats:
        for fn, ks in (s.get("jit_keys") or {}).items():
            keys[fn].update(ks)
    failures = [{"index": r["index"], "status": r["status"], "entry": r["entry"], "dtype": r["dtype"],
                 "worst": r.get("worst"), "note": r.get("note", ""), "repro": r.get("repro", "")}
                for r in sorted(results, key=lambda r: r["index"]) if r["status"] in FAILING]
    ran = len(results)
    return {
        "type": "summary", "seed": params["seed"], "requested": len(params["indices"]), "ran": ran,
        "not_run": len(params["indices"]) - ran, "seconds": round(seconds, 1),
        "cases_per_second": round(ran / seconds, 2) if seconds > 0 else None,
        "device": params["device"], "backend": params["backend"], "size": params["size"],
        "dtypes": list(params["dtypes"]), "workers": params["workers"],
        "status": dict(status), "failures": failures,
        "by_entry": {k: dict(v) for k, v in sorted(by_entry.items())},
        "by_dtype": {k: dict(v) for k, v in sorted(by_dtype.items())},
        "by_variant": {k: dict(v) for k, v in sorted(by_variant.items())},
        "variant_classes": {k: dict(v) for k, v in sorted(by_class.items())},
        "missing_gpu_classes": [c for c in GPU_CLASSES if c not in by_class],
        "hooks": sorted({h for s in stats for h in s.get("hooks", [])}),
        "hooks_missing": sorted({h for s in stats for h in s.get("hooks_missing", [])}),
        "jit_specialisations": {fn: len(ks) for fn, ks in sorted(keys.items())},
        "peak_mb_max": max((r.get("peak_mb", 0) for r in results), default=0),
        "oom_retries": sum(1 for r in results if r.get("oom_retry")),
        "slowest": [{"index": r["index"], "seconds": r.get("seconds", 0.0)}
                    for r in sorted(results, key=lambda r: -r.get("seconds", 0.0))[:5]],
    }


def format_summary(s: dict) -> str:
    st = s["status"]
    lines = [f"flashport fuzz: seed {s['seed']}, {s['ran']} of {s['requested']} cases in {s['seconds']} s "
             f"({s['workers']} worker{'s' if s['workers'] != 1 else ''}, {s['device']}, backend "
             f"{s['backend'] or 'auto'}, size {s['size']}, dtypes {','.join(s['dtypes'])})",
             "status: " + ", ".join(f"{k} {v}" for k, v in sorted(st.items()))]

    def table(title, rows: dict, cols=("cases", "PASS", "FAIL", "SKIP", "BADREF")):
        if not rows:
            return
        width = max(len(title), *(len(k) for k in rows))
        lines.append("")
        lines.append(title.ljust(width) + "".join(c.rjust(8) for c in cols)
                     + ("seconds".rjust(10) if any("seconds" in v for v in rows.values()) else ""))
        for k, v in rows.items():
            extra = f"{v['seconds']:10.1f}" if "seconds" in v else ""
            lines.append(k.ljust(width) + "".join(str(v.get(c, 0)).rjust(8) for c in cols) + extra)

    table("entry point", s["by_entry"])
    table("dtype", s["by_dtype"])
    table("variant class", s["variant_classes"])
    table("variant", s["by_variant"])
    if s.get("jit_specialisations"):
        lines.append("")
        lines.append("Triton specialisations compiled or loaded: " + ", ".join(
            f"{k} {v}" for k, v in s["jit_specialisations"].items()) + f" (total {sum(s['jit_specialisations'].values())})")
    if s.get("peak_mb_max"):
        lines.append(f"largest case: {s['peak_mb_max']} MiB of GPU memory at its peak; "
                     f"{s['oom_retries']} case(s) retried after running out of memory")
    if s.get("hooks_missing"):
        lines.append("variant hooks missing: " + ", ".join(s["hooks_missing"]))
    if s["failures"]:
        lines.append("")
        lines.append(f"{len(s['failures'])} failing case(s):")
        for f in s["failures"]:
            w = f.get("worst") or {}
            lines.append(f"  #{f['index']} {f['status']} {f['entry']} {f['dtype']} "
                         f"{w.get('name', '-')} err {w.get('err', float('nan')):.3e} bound "
                         f"{w.get('bound', float('nan')):.3e} {f['note'][:160]}")
            lines.append(f"      {f['repro']}")
    if s["not_run"]:
        lines.append(f"{s['not_run']} case(s) not run (--max-seconds)")
    return "\n".join(lines)


def run_fuzz(n: int = 100, seed: int = 0, device=None, dtypes=None, backend: Optional[str] = None,
             log: Optional[str] = None, workers: Optional[int] = None, case=None, size: Optional[str] = None,
             max_seconds: Optional[float] = None, entries=None, verbose: bool = True, out=print,
             compiled: bool = False):
    """Run the fuzzer -> (results sorted by index, summary dict).  Arguments as `main`."""
    device = str(device or _default_device())
    dev = torch.device(device)
    size = size or ("full" if dev.type == "cuda" else "small")
    if size not in ("small", "full"):
        raise ValueError(f"size must be 'small' or 'full', got {size!r}")
    if case is not None:
        indices = [int(case)] if isinstance(case, (int, str)) else [int(i) for i in case]
    else:
        indices = list(range(int(n)))
    if workers is None:
        workers = min(8, os.cpu_count() or 1) if dev.type == "cuda" else 1
    workers = max(1, min(int(workers), len(indices) or 1))
    if isinstance(entries, str):
        entries = [e.strip() for e in entries.split(",")]
    unknown = set(entries or ()) - set(ENTRIES + FOCUS_ENTRIES)
    if unknown:
        raise ValueError(f"entries: unknown {sorted(unknown)}; choose from {', '.join(ENTRIES + FOCUS_ENTRIES)}")
    entries = tuple(e for e in ENTRIES + FOCUS_ENTRIES if e in (entries or ENTRIES))
    names = _dtype_names(dtypes, dev)
    empty = [e for e in entries if not recipe_pool(int(seed), size, tuple(names))[e]]
    if empty:   # found here, before any worker draws a case
        raise ValueError(f"entries {empty}: no recipes at size {size!r} for dtypes {list(names)} (the hopper focus "
                         "needs size 'full' and a 16-bit dtype)")
    params = dict(seed=int(seed), size=size, dtypes=names, backend=backend, device=device,
                  indices=indices, workers=workers, entries=entries, interpret=_interpreting(),
                  compiled=bool(compiled))
    run = _Run(params, log, verbose, out)
    run.write({"type": "header", "seed": params["seed"], "n": len(indices), "device": device, "backend": backend,
               "size": size, "dtypes": list(params["dtypes"]), "workers": workers, "entries": list(entries),
               "torch": torch.__version__, "interpret": params["interpret"], "max_seconds": max_seconds,
               "compiled": params["compiled"],
               "triton": _triton_version()})
    deadline = time.time() + max_seconds if max_seconds else None
    if workers == 1:
        _local(run, deadline)
    else:
        _spawned(run, workers, deadline)
    results = [run.results[i] for i in sorted(run.results)]
    summary = summarize(results, params, time.time() - run.t0, run.stats)
    run.write(summary)
    if run.log:
        run.log.close()
    return results, summary


def _triton_version():
    try:
        import triton
        return triton.__version__
    except Exception:  # noqa: BLE001
        return None


def main(n: int = 100, seed: int = 0, device=None, dtypes=None, backend: Optional[str] = None,
         log: Optional[str] = None, workers: Optional[int] = None, case=None, size: Optional[str] = None,
         max_seconds: Optional[float] = None, entries=None, compiled: bool = False) -> int:
    """Run cases 0..n-1 of `seed` (or only `case`: an index or a list) against the float64 reference, print
    every failure's reproduction command and the summary table, write JSON lines to `log` (a header, one
    line per case, the summary last).  device: "cuda" / "cpu" (default: cuda if available); dtypes: torch
    dtypes or names (default: bf16, fp16, fp32 on CUDA; fp16, fp32 under TRITON_INTERPRET=1); backend: a
    name or None (auto); workers: spawned processes (default 1 on CPU, min(8, cpu_count) on CUDA);
    size: "small" (CI shapes; default on CPU) or "full" (default on CUDA); max_seconds: no case starts after
    that; compiled: every call through torch.compile(fullgraph=True) (the custom ops).  -> exit code: 1 if
    any case failed, else 0."""
    _, summary = run_fuzz(n=n, seed=seed, device=device, dtypes=dtypes, backend=backend, log=log, workers=workers,
                          case=case, size=size, max_seconds=max_seconds, entries=entries, compiled=compiled)
    print()
    print(format_summary(summary))
    return 1 if any(summary["status"].get(s, 0) for s in FAILING) else 0


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashport.fuzz",
                                description="random calls of the whole flashport contract against the float64 "
                                            "reference under the tolerance rule")
    p.add_argument("--n", type=int, default=100, help="cases 0..N-1 (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", default=None, help="run only these case indices (comma-separated): a failure's repro")
    p.add_argument("--workers", type=int, default=None, help="spawned processes (default 1 on CPU, min(8, cores) "
                                                             "on CUDA)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="comma-separated dtypes to draw from, e.g. float16,bfloat16")
    p.add_argument("--backend", default=None, help="backend name (default: auto selection)")
    p.add_argument("--log", default=None, help="write JSON lines here")
    p.add_argument("--size", choices=("small", "full"), default=None,
                   help="small: CI shapes (default on CPU); full: up to 8192 keys (default on CUDA)")
    p.add_argument("--max-seconds", type=float, default=None, help="start no case after this many seconds")
    p.add_argument("--entries", default=None, help="comma-separated subset of " + ",".join(ENTRIES) + "; or hopper: "
                   "attention calls from the Gluon kernels' recipes only (size full)")
    p.add_argument("--compiled", action="store_true", help="call the entry points through torch.compile")
    a = p.parse_args(argv)
    cases = [int(x) for x in a.case.split(",")] if a.case else None
    dtypes = [x.strip() for x in a.dtype.split(",")] if a.dtype else None
    entries = [x.strip() for x in a.entries.split(",")] if a.entries else None
    return main(n=a.n, seed=a.seed, device=a.device, dtypes=dtypes, backend=a.backend, log=a.log, workers=a.workers,
                case=cases, size=a.size, max_seconds=a.max_seconds, entries=entries, compiled=a.compiled)


if __name__ == "__main__":
    sys.exit(cli())

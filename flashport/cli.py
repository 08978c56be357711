"""Command line: `flashport info | check | bench` (also `python -m flashport ...`)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys

def info_dict() -> dict:
    """Device, versions and every backend with availability, reasons and capabilities."""
    import torch

    import flashport
    from .bench.report import cpu_name
    d = {"flashport": flashport.__version__, "python": platform.python_version(), "torch": torch.__version__,
         "platform": platform.platform(), "cpu": cpu_name(), "cpu_count": os.cpu_count()}
    try:
        import triton
        d["triton"] = triton.__version__
    except ImportError:
        d["triton"] = None
    from .backend import fa4
    d["flash-attn-4"] = fa4.version()   # from its metadata; flash_attn.cute is not imported
    if torch.cuda.is_available():
        d["device"] = "cuda"
        d["gpus"] = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            d["gpus"].append({"index": i, "name": p.name, "sm_count": p.multi_processor_count,
                              "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)})
        d["cuda"] = torch.version.cuda
    else:
        d["device"] = "cpu"
    from . import env, table
    d["switches"] = {name: {"value": env.value(name), "set": env.raw(name) is not None, "default": sw.default,
                            "source": env.source(name), "meaning": sw.meaning} for name, sw in env.SWITCHES.items()}
    d["config_file"] = {"path": env.config_path(), "exists": os.path.exists(env.config_path()),
                        "notes": list(env.config_notes())}
    d["selection_table"] = table.describe("cuda" if torch.cuda.is_available() else "cpu")
    from .integrations import sdpa
    d["sdpa_hook"] = sdpa.status()
    d["backends"] = [{"name": b.name, "available": b.available, "reasons": b.reasons,
                      "capabilities": b.capabilities} for b in flashport.backends()]
    d["jax"] = jax_info()
    return d


# ----------------------------------------------------------------------------- the JAX frontend
JAX_MISSING = "JAX: not installed (pip install flashport[jax])"


def import_jax_frontend():
    """flashport.jax, or None when jax is not installed.  XLA must not preallocate the GPU's memory: the torch
    frontend shares the card in the same process (bench), and `info` / `check` should not hold it either."""
    import importlib.util
    if importlib.util.find_spec("jax") is None:
        return None
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import flashport.jax as fj
    return fj


def jax_info() -> dict:
    """For `info`: jax's versions, platform and devices, and every JAX backend (name, available, reasons,
    auto platforms, capabilities); {"installed": False} without jax."""
    try:
        fj = import_jax_frontend()
    except Exception as e:  # noqa: BLE001 - a broken jax install is reported, not a traceback
        return {"installed": True, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    if fj is None:
        return {"installed": False, "hint": "pip install flashport[jax]"}
    return {"installed": True, **fj.environment(), "backends": fj.describe()}


def print_jax_info(j: dict) -> None:
    if not j.get("installed"):
        print(JAX_MISSING)
        return
    if "error" in j:
        print(f"JAX: installed but flashport.jax failed to import: {j['error']}")
        return
    print(f"JAX: jax {j['jax']} (jaxlib {j['jaxlib']}), platform {j['platform']}, devices {', '.join(j['devices'])}")
    print("JAX backends (flashport.jax, auto order):")
    for b in j["backends"]:
        state = "available" if b["available"] else "unavailable: " + "; ".join(b["reasons"])
        auto = "auto on " + "/".join(b["auto_platforms"] or ["any"]) if b["auto"] else "named only"
        print(f"  {b['name']:<17} {state} ({auto})")
        caps = ", ".join(f"{k}={v}" for k, v in b["capabilities"].items() if k != "auto_platforms")
        if caps:
            print(f"  {'':<17} {caps}")


def cmd_info(args) -> int:
    d = info_dict()
    if args.json:
        print(json.dumps(d, indent=1, default=str))
        return 0
    print(f"flashport {d['flashport']}  python {d['python']}  torch {d['torch']}  triton {d['triton'] or 'not installed'}"
          f"  flash-attn-4 {d['flash-attn-4'] or 'not installed'}")
    print(f"platform  {d['platform']}  ({d['cpu']}, {d['cpu_count']} cores)")
    if d["device"] == "cuda":
        print(f"device    cuda {d['cuda']}")
        for g in d["gpus"]:
            print(f"  gpu {g['index']}: {g['name']}  sm_{g['capability'].replace('.', '')} ({g['capability']}), "
                  f"{g['sm_count']} SMs, {g['memory_gib']} GiB")
    else:
        print("device    cpu (no CUDA device)")
    cf = d["config_file"]
    print(f"config file: {cf['path']}" + ("" if cf["exists"] else " (none)"))
    for n in cf["notes"]:
        print(f"  note: {n}")
    print("effective configuration (value, where it comes from, meaning):")
    for name, sw in d["switches"].items():
        mark = "*" if sw["set"] else " "
        print(f" {mark}{name:<32} {sw['value'] or '-':<8} {sw['source']:<12} {sw['meaning']}")
    t = d["selection_table"]
    print(f"selection table: {t['status']}" + (f" ({t['path']}, {t['buckets']} buckets)" if t.get("path") else ""))
    for w in t.get("warnings", []):
        print(f"  note: {w}")
    h = d["sdpa_hook"]
    print("sdpa hook: " + {"active": 'active (F.scaled_dot_product_attention\'s flash path runs flashport)',
                           "registered": 'registered (torch.nn.attention.activate_flash_attention_impl("flashport"))',
                           "missing": f"missing: {h['reason']}"}[h["hook"]])
    print("backends (auto order):")
    for b in d["backends"]:
        state = "available" if b["available"] else "unavailable: " + "; ".join(b["reasons"])
        print(f"  {b['name']:<10} {state}")
        caps = ", ".join(f"{k}={v}" for k, v in b["capabilities"].items())
        if caps:
            print(f"  {'':<10} {caps}")
    print_jax_info(d["jax"])
    return 0


# ----------------------------------------------------------------------------- argument checks
# Checked before any work, so a typo ends in one line and exit status 2 (argparse's convention), not in a
# traceback from deep inside a run -- or, for --out, after a whole benchmark has been measured.
DTYPES = ("float16", "bfloat16", "float32", "float64")


def parse_dtypes(p: argparse.ArgumentParser, text: str | None):
    """--dtype a,b -> [torch.dtype] (None when not given)."""
    if text is None:
        return None
    import torch
    names = [t.strip() for t in text.split(",")]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        p.error(f"--dtype: unknown dtype(s) {', '.join(map(repr, bad))}; valid: {', '.join(DTYPES)}")
    return [getattr(torch, n) for n in names]


def check_backends(p: argparse.ArgumentParser, names) -> None:
    from . import dispatch
    known = list(dispatch._REGISTRY)
    bad = [n for n in names or () if n not in known]
    if bad:
        p.error(f"--backend: unknown backend(s) {', '.join(map(repr, bad))}; valid: {', '.join(known)}")


def check_device(p: argparse.ArgumentParser, text: str | None) -> None:
    """--device: cpu, cuda or cuda:N for a CUDA device this process has."""
    if text is None:
        return
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    valid = "cpu" + (f", cuda, cuda:0..{n - 1}" if n else " (no CUDA device here)")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        p.error(f"--device: {text!r} is not a device; valid: {valid}")
    if dev.type == "cpu" and dev.index in (None, 0):
        return
    if dev.type != "cuda" or not n or (dev.index is not None and not 0 <= dev.index < n):
        p.error(f"--device: {text!r} is not available; valid: {valid}")


def check_jax_args(p: argparse.ArgumentParser, args) -> None:
    """check --frontend jax: JAX backend names, dtypes JAX computes in by default; no --device / --fuzz (JAX runs
    on its default platform: choose it with JAX_PLATFORMS=cpu|cuda|tpu)."""
    if args.fuzz is not None or args.log is not None:
        p.error("--fuzz / --log apply to the torch frontend")
    if args.device is not None:
        p.error("--device does not apply to --frontend jax (JAX runs on its default platform; set JAX_PLATFORMS)")
    args.dtypes = parse_dtypes(p, args.dtype)
    if args.dtypes and any(str(d).endswith("float64") for d in args.dtypes):
        p.error("--dtype: float64 is not checked with --frontend jax (needs jax_enable_x64)")
    try:
        fj = import_jax_frontend()
    except Exception as e:  # noqa: BLE001
        p.error(f"--frontend jax: flashport.jax failed to import: {type(e).__name__}: {e}")
    if fj is None:
        return      # cmd_check says JAX is not installed
    from .jax import registry
    bad = [n for n in args.backend or () if n not in registry.names()]
    if bad:
        p.error(f"--backend: unknown JAX backend(s) {', '.join(map(repr, bad))}; valid: {', '.join(registry.names())}")


def check_out_dir(p: argparse.ArgumentParser, out: str) -> None:
    """--out must be a directory we can create and write into: probed with a temporary file."""
    import tempfile
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".flashport-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        p.error(f"--out: cannot write into {out!r}: {e.strerror or e}")


def check_log_path(p: argparse.ArgumentParser, path: str) -> None:
    """--log must be a file we can write (its folder exists): checked before the fuzz runs its first case."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        p.error(f"--log: cannot write {path!r} (a folder, or its folder {folder!r} is missing or read-only)")


# ----------------------------------------------------------------------------- commands
def cmd_check(args) -> int:
    import time

    from .check import format_table, run_check
    if args.frontend == "jax":
        return check_jax(args)
    if args.fuzz is not None:
        from flashport.fuzz import main as fuzz_main
        return fuzz_main(n=args.fuzz, seed=args.seed, device=args.device, dtypes=args.dtypes,
                         backend=args.backend[0] if args.backend else None, log=args.log)
    t0 = time.perf_counter()
    results = run_check(args.backend or None, args.device, args.dtypes)
    print(format_table(results))
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {time.perf_counter() - t0:.1f} s")
    import importlib.util
    if importlib.util.find_spec("jax") is not None:
        print("JAX is installed: `flashport check --frontend jax` checks the flashport.jax backends")
    return 1 if counts["FAIL"] else 0


def check_jax(args) -> int:
    """`check --frontend jax`: the JAX backends against the float64 reference (flashport.jax.check), the table,
    then one PASS / FAIL / SKIP line per backend (a backend not run says why); exit 1 on any FAIL."""
    import time

    from .check import format_table
    fj = import_jax_frontend()
    if fj is None:
        print(JAX_MISSING)
        return 2
    from .jax import registry
    t0 = time.perf_counter()
    platform = fj.environment()["platform"]
    names = args.backend or [b.name for b in fj.backends_for(platform)]
    dtypes = [str(d).split(".")[-1] for d in args.dtypes] if args.dtypes else None
    print(f"flashport.jax check on {platform}: {', '.join(names)} (one line per case as it ends, then the table)",
          flush=True)

    def progress(r):   # a run cut by a time limit still leaves its verdicts in the log
        print(f"  {r.backend:<17} {r.case:<44} {r.status}  {r.worst or '-'} {r.err:.2e} <= {r.bound:.2e}  "
              f"{r.seconds:.1f}s {r.note[:90]}", flush=True)
    results = fj.check(names, dtypes, progress=progress, match=args.match)
    print()
    print(format_table(results))
    print(f"\nJAX {fj.environment()['jax']} on {platform}, per backend:")
    for name in registry.names():
        rs = [r for r in results if r.backend == name]
        if rs:
            c = {s: sum(r.status == s for r in rs) for s in ("PASS", "FAIL", "SKIP")}
            verdict = "FAIL" if c["FAIL"] else ("PASS" if c["PASS"] else "SKIP")
            why = "" if c["PASS"] or c["FAIL"] else f" ({next(r.note for r in rs if r.note)})"
            print(f"  {name:<17} {verdict}: {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped{why}")
            continue
        b = registry.get(name)
        why = b.availability()
        if why:
            print(f"  {name:<17} not run: unavailable ({'; '.join(why)})")
        elif b.auto_platforms and platform not in b.auto_platforms:
            print(f"  {name:<17} not run: a {'/'.join(b.auto_platforms)} backend (name it with --backend {name}"
                  + (", runs in interpret mode here)" if name.startswith("pallas-tpu") else ")"))
        else:
            print(f"  {name:<17} not run (not named)")
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {time.perf_counter() - t0:.1f} s")
    return 1 if counts["FAIL"] else 0


def cmd_bench(args) -> int:
    from . import bench
    return bench.run(args)


def cmd_tune(args) -> int:
    import torch

    from .bench.shapes import gpu_suite
    from .tune import tune
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        print("flashport tune: needs a CUDA device (the table selects among GPU backends)")
        return 2
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    suites = ("standard", "models", "workloads") if args.suite == "all" else (args.suite,)
    shapes = [s for name in suites for s in gpu_suite(name, args.quick)
              if args.match is None or re.search(args.match, s.label())]
    try:
        path, rows = tune(shapes, device, args.out, rounds=args.rounds)
    except ValueError as e:   # e.g. --out names a table measured on another card
        print(f"flashport tune: {e}")
        return 2
    for r in rows:
        fwd = min(r["fwd"], key=r["fwd"].get) if r["fwd"] else "-"
        bwd = min(r["bwd"], key=r["bwd"].get) if r["bwd"] else "-"
        print(f"{r['label']:<44} fwd {fwd:<14} bwd {bwd:<14} {r['bucket']}")
        for name, err in r["errors"].items():
            print(f"  {name}: {err}")
    print(f"wrote {path} ({len(rows)} shapes)")
    return 0


def _non_negative(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="flashport", description="exact FlashAttention-style attention, portable backends")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="device, versions, backends with reasons and capabilities")
    pi.add_argument("--json", action="store_true")
    pc = sub.add_parser("check", help="conformance of every available backend against `reference`")
    pc.add_argument("--backend", action="append", help="check only this backend (repeatable)")
    pc.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    pc.add_argument("--dtype", default=None, help="comma-separated, e.g. float16,bfloat16 (default per device)")
    pc.add_argument("--fuzz", type=_non_negative, default=None, metavar="N",
                    help="run N random cases against `reference` (flashport.fuzz) instead of the fixed grid")
    pc.add_argument("--seed", type=int, default=0, help="--fuzz: seed of the random cases (default 0)")
    pc.add_argument("--log", default=None, metavar="PATH", help="--fuzz: write one JSON line per case to PATH")
    pc.add_argument("--frontend", choices=("torch", "jax"), default="torch",
                    help="jax: the flashport.jax backends on JAX's default platform (needs flashport[jax])")
    from .bench import add_arguments, positive_int, regex
    pc.add_argument("--match", type=regex, default=None, metavar="REGEX",
                    help="--frontend jax: only the grid cases whose name matches")
    pb = sub.add_parser("bench", help="benchmark on the hardware present (JSON + PNG into --out)")
    add_arguments(pb)
    pt = sub.add_parser("tune", help="measure every eligible backend on this card and write the selection table")
    pt.add_argument("--suite", choices=("standard", "models", "workloads", "all"), default="all",
                    help="the bench suites whose dense shapes are measured (workloads: GQA training, sliding "
                         "windows, head dims 72 / 80 / 96, MLA 192/128, D=256)")
    pt.add_argument("--quick", action="store_true", help="the suites' smoke sizes")
    pt.add_argument("--device", default=None, help="cuda[:N] (default: cuda if available)")
    pt.add_argument("--match", type=regex, default=None, metavar="REGEX",
                    help="only the shapes whose label matches; merged into the table at --out")
    pt.add_argument("--rounds", type=positive_int, default=3, help="interleaved timing rounds per shape (default 3)")
    pt.add_argument("--out", default=None, metavar="PATH",
                    help="table path (default: the cache directory, FLASHPORT_CACHE_DIR or ~/.cache/flashport)")
    args = p.parse_args(argv)
    parser = {"check": pc, "bench": pb, "tune": pt}.get(args.cmd)
    if args.cmd == "check" and args.frontend == "jax":
        check_jax_args(pc, args)
    elif args.cmd == "check":
        if args.match is not None:
            pc.error("--match applies to --frontend jax")
        args.dtypes = parse_dtypes(pc, args.dtype)
        check_backends(pc, args.backend)
        if args.log is not None:
            check_log_path(pc, args.log)
    if parser is not None and getattr(args, "frontend", "torch") != "jax":
        check_device(parser, args.device)
    if args.cmd == "bench":
        check_out_dir(pb, args.out)
    return {"info": cmd_info, "check": cmd_check, "bench": cmd_bench, "tune": cmd_tune}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

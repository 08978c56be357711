"""The auto-selection table: measured forward and backward times per backend, per bucket of calls.

A bucket groups calls that cost alike: entry point, head dims, dtype, mask kind and features, GQA
ratio, and log2 of Sq, Sk and batch x heads (rounded).  `flashport tune` measures every eligible
backend and writes the table (JSON, never code) to the cache directory; a default table per card is
shipped in flashport/configs.  A table counts only on the machine it describes: its key (flashport,
torch, Triton, CUDA driver, cuDNN, GPU) must match, else it is ignored with a warning.  Where no
bucket fits, dispatch's static priority applies.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path

import torch

from . import env
from .capabilities import mask_kind

FORMAT = 1
ROLES = ("fwd", "fwd_train", "bwd")   # inference forward, forward with grads, backward; ms per backend
SHIPPED = Path(__file__).parent / "configs"


def bucket(spec) -> str:
    """The bucket of a call, e.g. "dense|d128|dv128|bfloat16|causal|g4|q13|k13|bh5|grad"."""
    # return_lse is no feature here: every backend that returns the lse computes it anyway (options() keeps only
    # those for such a call), so a call asking for it costs what the measured call cost -- and the calls
    # backend=None rewrites into built-in ones (which ask for it to merge or return it) find their measurements
    feats = [f for f, on in (("softcap", spec.softcap > 0), ("alibi", spec.alibi is not None),
                             ("dropout", spec.dropout_p > 0),
                             ("det", spec.deterministic and spec.needs_grad),
                             ("paged", spec.paged)) if on]
    lg = lambda n: round(math.log2(n)) if n > 0 else -1  # noqa: E731
    return "|".join([spec.kind, f"d{spec.head_dim}", f"dv{spec.head_dim_v}", str(spec.dtype).replace("torch.", ""),
                     mask_kind(spec), *feats, f"g{spec.group_size}", f"q{lg(spec.seqlen_q)}",
                     f"k{lg(spec.seqlen_k)}", f"bh{lg(spec.batch * spec.heads_q)}"])


def machine_key(device) -> dict:
    """What a measurement is only valid for."""
    import flashport
    key = {"flashport": flashport.__version__, "torch": torch.__version__}
    try:
        import triton
        key["triton"] = triton.__version__
    except ImportError:
        key["triton"] = None
    dev = torch.device(device)
    if dev.type == "cuda":
        key["gpu"] = env.device_name(dev)
        key["driver"] = _driver_version()
        key["cudnn"] = torch.backends.cudnn.version()
    else:
        key["gpu"] = None
    return key


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version (e.g. "580.159.04"), from /proc on Linux; None elsewhere."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module(?: for [a-z0-9_]+)?\s+([0-9.]+)", text)
    return m.group(1) if m else None


def _slug(name: str | None) -> str:
    return re.sub(r"[^a-z0-9]+", "-", (name or "cpu").lower()).strip("-")


def user_path(device) -> Path:
    return Path(env.cache_dir()) / f"selection-{_slug(machine_key(device)['gpu'])}.json"


def shipped_path(device) -> Path:
    return SHIPPED / f"selection-{_slug(machine_key(device)['gpu'])}.json"


NEAREST = 3   # how far (in log2 steps of Sq, Sk, batch x heads and GQA ratio, summed) a bucket may stand in


def _split(name: str) -> tuple[str, tuple[int, ...]] | None:
    """"dense|d128|...|g4|q13|k13|bh5" -> ("dense|d128|...", (log2 g, 13, 13, 5)); None if malformed."""
    parts = name.split("|")
    try:
        g, q, k, bh = int(parts[-4][1:]), int(parts[-3][1:]), int(parts[-2][1:]), int(parts[-1][2:])
    except (IndexError, ValueError):
        return None
    return "|".join(parts[:-4]), (round(math.log2(g)) if g > 0 else 0, q, k, bh)


class Table:
    def __init__(self, path: str, key: dict, buckets: dict):
        self.path, self.key, self.buckets = path, key, buckets
        self._by_kind: dict = {}
        for name in buckets:
            split = _split(name)
            if split:
                self._by_kind.setdefault(split[0], []).append((split[1], name))

    def entry(self, spec) -> dict | None:
        """The call's bucket, else the nearest measured bucket of the same kind (entry point, head dims, dtype,
        mask, features) within NEAREST log2 steps: the ranking of backends moves slowly with size, so a
        Llama layer at B=4 is better served by the B=2 measurement than by the static priority."""
        name = bucket(spec)
        if name in self.buckets:
            return self.buckets[name]
        kind, at = _split(name)
        near = [(sum(abs(a - b) for a, b in zip(at, pos)), other) for pos, other in self._by_kind.get(kind, ())]
        near = [n for n in near if n[0] <= NEAREST]
        return self.buckets[min(near)[1]] if near else None


def card_of(path: Path) -> str | None:
    """The GPU a selection table file was measured on (None: no such file, not a table, or a CPU table)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    key = doc.get("key") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    return key.get("gpu") if isinstance(key, dict) else None


def _read(path: Path, want: dict) -> tuple[Table | None, str | None]:
    """(table, None) or (None, why it is not used)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{path}: unreadable ({type(e).__name__}: {e})"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("buckets"), dict):
        return None, f"{path}: not a flashport selection table of format {FORMAT}"
    key = doc.get("key") or {}
    if key.get("gpu") != want.get("gpu"):
        return None, f"{path}: measured on {key.get('gpu')!r}, this is {want.get('gpu')!r} (foreign table ignored)"
    stale = [f"{k} {key.get(k)!r} != {want[k]!r}" for k in want if key.get(k) != want[k]]
    if stale:
        return None, f"{path}: stale ({', '.join(stale)}); run `flashport tune` to measure this setup"
    buckets = {}
    for name, entry in doc["buckets"].items():
        if isinstance(entry, dict):
            buckets[str(name)] = {role: {str(b): float(ms) for b, ms in (entry.get(role) or {}).items()
                                         if isinstance(ms, (int, float)) and ms > 0} for role in ROLES}
    return Table(str(path), key, buckets), None


_loaded: dict = {}


def active(device) -> tuple[Table | None, list[str]]:
    """The table in force for `device` and the notes on every candidate skipped (FLASHPORT_TABLE, then the
    user's cache, then the shipped default)."""
    dev = torch.device(device)
    setting = env.value("FLASHPORT_TABLE")
    ck = (str(dev), setting, env.cache_dir())
    if ck in _loaded:
        return _loaded[ck]
    if setting == "off":
        result = (None, [])
    else:
        want = machine_key(dev)
        paths = [Path(setting)] if setting else [user_path(dev), shipped_path(dev)]
        notes, table = [], None
        for p in paths:
            if not setting and not p.exists():
                continue
            table, why = _read(p, want)
            if table is not None:
                break
            notes.append(why)
        for n in notes:
            env.warn_once(f"flashport: selection table {n}", stacklevel=3)
        result = (table, notes)
    _loaded[ck] = result
    return result


def reload() -> None:
    _loaded.clear()


def best(spec, plans):
    """The plan with the smallest measured time among `plans` -- the inference forward; or, when the call
    needs grads, the training forward (the inference one where that was not measured) plus the backward --
    or None when the table has no bucket for the call or no measurement of any plan."""
    table, _ = active(spec.device)
    entry = table.entry(spec) if table is not None else None
    if not entry:
        return None
    fwd = {**entry["fwd"], **entry["fwd_train"]} if spec.needs_grad else entry["fwd"]
    bwd = entry["bwd"]
    scored = []
    for i, plan in enumerate(plans):
        if plan.fwd.name not in fwd or (spec.needs_grad and plan.bwd.name not in bwd):
            continue
        scored.append((fwd[plan.fwd.name] + (bwd[plan.bwd.name] if spec.needs_grad else 0.0), i, plan))
    return min(scored)[2] if scored else None


def describe(device) -> dict:
    """For `flashport info` and bench JSON: which table is in force and why others are not."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table, notes = active(device)
    if table is None:
        status = "off (FLASHPORT_TABLE=off)" if env.value("FLASHPORT_TABLE") == "off" else "none: static priority"
        return {"status": status, "path": None, "buckets": 0, "warnings": notes}
    return {"status": "in force", "path": table.path, "buckets": len(table.buckets), "key": table.key,
            "warnings": notes}


def save(path, device, buckets: dict, meta: dict | None = None) -> str:
    """Write a table measured on `device`: {bucket: {role: {backend: ms}}} for the roles in ROLES."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "key": machine_key(device), "meta": meta or {}, "buckets": buckets}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)
    reload()
    from . import dispatch
    dispatch.clear_cache()
    return str(path)

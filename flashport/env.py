"""Environment switches and device facts, in one place.

Every environment variable flashport reads is declared here with its default and meaning; the
switches are read at each call (a test or a serving process may flip one between calls), and
`snapshot()` is what `flashport info` and every bench JSON record.  Device facts (compute
capability, SM count, shared memory) cannot change inside a process, so they are cached.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    meaning: str


SWITCHES = {s.name: s for s in (
    Switch("FLASHPORT_BACKEND", "", "name a backend (or 'fwd/bwd' pair) for every call: strict, like backend="),
    Switch("FLASHPORT_DISABLE", "", "comma-separated backends removed from every choice, auto and named"),
    Switch("FLASHPORT_CHECKS", "0", "1: check index contents (cu_seqlens, cache_seqlens, block_table) on the host "
                                    "before a GPU launch (synchronises); 0: clamp and flag them on the device"),
    Switch("FLASHPORT_ALLOW_TF32", "0", "1: fp32 inputs may use TF32 dot products (not exact to fp32 tolerance)"),
    Switch("FLASHPORT_ALLOW_UNTESTED_TRITON", "0", "1: try the Triton kernels on a Triton release they were not tested on"),
    Switch("FLASHPORT_HOPPER_FWD", "1", "0: the gluon backend refuses forwards (rollback switch for the Hopper forward)"),
    Switch("FLASHPORT_HOPPER_BWD", "1", "0: the gluon backend refuses backwards (rollback switch for the Hopper backward)"),
    Switch("FLASHPORT_TABLE", "", "path of an auto-selection table to use instead of the cache's or the shipped one; "
                                  "'off': static priority only"),
    Switch("FLASHPORT_CACHE_DIR", "", "cache directory (tuned tables); default ~/.cache/flashport"),
    Switch("TRITON_INTERPRET", "0", "1: Triton's interpreter runs the kernels on CPU tensors (tests)"),
)}


def raw(name: str) -> str | None:
    """The variable as set, or None when unset (an empty string is a value, e.g. an unknown backend name)."""
    if name not in SWITCHES:
        raise KeyError(f"undeclared switch {name!r}: declare it in flashport.env.SWITCHES")
    return os.environ.get(name)


def value(name: str) -> str:
    v = raw(name)
    return SWITCHES[name].default if v is None else v


def flag(name: str) -> bool:
    """A 0/1 switch.  Only "1" turns a default-off switch on, only "0" turns a default-on one off."""
    v = value(name)
    return v != "0" if SWITCHES[name].default == "1" else v == "1"


def interpreting() -> bool:
    return flag("TRITON_INTERPRET")


def cache_dir() -> str:
    return value("FLASHPORT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flashport")


def snapshot() -> dict:
    """Every switch's value in force (defaults included), for reports."""
    return {name: value(name) for name in SWITCHES}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _props(index: int):
    return torch.cuda.get_device_properties(index)


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device."""
    p = _props(_index(device))
    return (p.major, p.minor)


def sm_count(device: torch.device) -> int:
    return _props(_index(device)).multi_processor_count


def smem_per_block(device: torch.device) -> int:
    """Opt-in shared memory per block, bytes (what a kernel may allocate)."""
    p = _props(_index(device))
    return int(getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 0))


def device_name(device: torch.device) -> str:
    return _props(_index(device)).name

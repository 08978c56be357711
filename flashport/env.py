"""Environment switches, the config file, and device facts, in one place.

Every switch flashport reads is declared here with its default and meaning.  A switch's value comes
from the environment, else from the TOML config file (`FLASHPORT_CONFIG`, else
$XDG_CONFIG_HOME/flashport/config.toml or ~/.config/flashport/config.toml), else its default; the
environment is read at each call (a test or a serving process may flip one between calls), the file
once per path (`reload_config()` re-reads it).  `snapshot()` and `sources()` are what `flashport info`
and every bench JSON record.  Device facts (compute capability, SM count, shared memory) cannot change
inside a process, so they are cached.

Config file keys are the switch names, or the same names lower-case without the prefix:
    disable = ["sdpa-flash", "triton"]     # lists join with ","; true/false become "1"/"0"
    FLASHPORT_TABLE = "off"
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
    Switch("FLASHPORT_HOPPER_FWD_ALIBI", "1", "0: the Hopper forward leaves ALiBi slopes to the Triton kernel "
                                              "(rollback switch; PERFLOG rows 82, 95)"),
    Switch("FLASHPORT_HOPPER_BWD_ALIBI", "1", "0: the Hopper backward leaves ALiBi slopes to the Triton kernels "
                                              "(rollback switch; PERFLOG rows 83, 95)"),
    Switch("FLASHPORT_HOPPER_FWD_SPLIT", "1", "0: the Hopper forward leaves head dims 80 and 96 (two power-of-two "
                                              "column parts, no padded dots) to the Triton kernel (rollback switch; "
                                              "PERFLOG rows 81, 95)"),
    Switch("FLASHPORT_HOPPER_BWD_SPLIT", "1", "0: the Hopper backward leaves head dims 80 and 96 (two power-of-two "
                                              "column parts, no padded dots) to the Triton kernels (rollback switch; "
                                              "PERFLOG rows 86, 95)"),
    Switch("FLASHPORT_HOPPER_FWD_PIN", "0", "1: the Hopper forward holds its wait for P V after the softmax of the next "
                                            "key tile (a shared-memory store of the row sums), so the exp2 overlap the "
                                            "P V matmul (off until a GPU run times it: PERFLOG row 87)"),
    Switch("FLASHPORT_HOPPER_FWD_PINGPONG", "0", "1: the Hopper forward's two consumer warpgroups take turns issuing "
                                                 "their matmuls (FA3's ping-pong), where a key tile spans the Q tile "
                                                 "(off until a GPU run times it: PERFLOG row 88)"),
    Switch("FLASHPORT_HOPPER_BWD_DQ_FIRST", "0", "1: the Hopper backward issues dQ_j's matmul before dK's, so dK runs "
                                                 "while dQ_j is stored, and dK reads dS from registers (FA3's and FA4's "
                                                 "step; off until a GPU run times it: PERFLOG row 89)"),
    Switch("FLASHPORT_HOPPER_FWD_WINDOW", "1", "0: the Hopper forward leaves sliding windows (Sq == Sk; key tiles "
                                               "outside the band skipped) to the Triton kernel (rollback switch; "
                                               "PERFLOG rows 79, 95)"),
    Switch("FLASHPORT_HOPPER_BWD_WINDOW", "1", "0: the Hopper backward leaves sliding windows (Sq == Sk; tiles outside "
                                               "the band skipped) to the Triton kernels (rollback switch; PERFLOG "
                                               "rows 78, 95)"),
    Switch("FLASHPORT_CUDNN_FIRST", "1", "0: where no selection-table bucket fits, static priority on Hopper puts "
                                         "flashport's kernels first again (D=256 training aside) instead of cuDNN's "
                                         "plan for dense 16-bit training calls under 64k keys, short inference "
                                         "calls at D <= 128 and padded head dims but a split D=96 (rollback switch; "
                                         "PERFLOG row 97)"),
    Switch("FLASHPORT_TRITON_DIRECT", "1", "0: the portable Triton kernels (forward, dK/dV, dQ) go through "
                                           "JITFunction.run at every call instead of direct launches after their "
                                           "first (rollback switch; PERFLOG row 96)"),
    Switch("FLASHPORT_DECODE_FIXED_CHUNKS", "0", "1: the KV-cache kernel cuts every sequence into key chunks of one size "
                                                 "(the capacity's share per split), not each sequence's own keys "
                                                 "into num_splits shares: ragged batches run fewer, fuller programs "
                                                 "(off until a GPU run times it: PERFLOG row 93)"),
    Switch("FLASHPORT_HOPPER_BWD_M128", "0", "1: the Hopper backward at D=64 takes 128 query rows per step (FA3's and "
                                             "FA4's tile: half the steps, and their fixed costs, per K/V tile; off "
                                             "until a GPU run checks and times it: PERFLOG row 91)"),
    Switch("FLASHPORT_HOPPER_BWD_GROUP_LOOP", "0", "1: under GQA the Hopper backward runs one program per K/V head and "
                                                   "tile, walking its group's query heads: dK / dV summed in registers "
                                                   "and written once, no float32 partials (off until a GPU run checks "
                                                   "and times it: PERFLOG row 90)"),
    Switch("FLASHPORT_GQA_GROUP_LOOP", "0", "1: the Triton dK/dV kernel loops over a GQA group's query heads in one "
                                            "program (K, V read once; no float32 partials to sum)"),
    Switch("FLASHPORT_CAP_GRAD_SUMS", "1", "0: the Triton kernels add captured tensors' gradients element by element "
                                           "(no per-tile sums first; for A/B timing), read when a mod is compiled"),
    Switch("FLASHPORT_BWD_Q_CHUNKS", "auto", "the Triton dK/dV kernel's programs per K/V tile, each over its own run "
                                            "of Q tiles: 'auto' splits only where few key tiles leave SMs idle "
                                            "(kernels/attn_bwd.q_chunks); N forces N (tests, A/B)"),
    Switch("FLASHPORT_CPU_COMPILE", "auto", "blockwise on a CPU: 'auto' compiles its tile steps (torch.compile) for "
                                             "calls of >= 2^25 scores, '1' always, '0' never"),
    Switch("FLASHPORT_TABLE", "", "path of an auto-selection table to use instead of the cache's or the shipped one; "
                                  "'off': static priority only"),
    Switch("FLASHPORT_CACHE_DIR", "", "cache directory (tuned tables); default ~/.cache/flashport"),
    Switch("FLASHPORT_GUARD", "0", "fraction of calls the guard re-checks against `reference` (0: off; "
                                   "flashport.guard() overrides it)"),
    Switch("FLASHPORT_GUARD_TOLERANCE", "", "the guard's largest allowed max |error| (empty: the contract's rule)"),
    Switch("FLASHPORT_RANGES", "1", "0: no profiler / NVTX ranges around calls (to measure what they cost)"),
    Switch("FLASHPORT_CONFIG", "", "path of the TOML config file (default ~/.config/flashport/config.toml)"),
    Switch("TRITON_INTERPRET", "0", "1: Triton's interpreter runs the kernels on CPU tensors (tests)"),
)}
_ENV_ONLY = ("FLASHPORT_CONFIG", "TRITON_INTERPRET")   # never read from the file


# The environment is read on every call, so the read must be cheap: os.environ.get() encodes the key and
# decodes the value (~0.5 us each, ~30 per call); a lookup in os.environ's own mapping with pre-encoded
# keys is a dict get.  os.environ's writes (monkeypatch.setenv, os.environ[...] = ...) go through it too.
_ENVIRON = getattr(os.environ, "_data", None)
_KEYS = {}


def _getenv(name: str) -> str | None:
    if _ENVIRON is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = os.environ.encodekey(name)
    v = _ENVIRON.get(key)
    return None if v is None else os.environ.decodevalue(v)


@functools.lru_cache(maxsize=16)
def _default_config_path(xdg: str | None, home: str | None) -> str:
    base = xdg or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "flashport", "config.toml")


def config_path() -> str:
    return _getenv("FLASHPORT_CONFIG") or _default_config_path(_getenv("XDG_CONFIG_HOME"), _getenv("HOME"))


def _as_str(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


@functools.lru_cache(maxsize=8)
def _config(path: str) -> tuple[dict, tuple[str, ...]]:
    """({switch name: value}, notes) from the file at `path`; no file -> ({}, ()).  A file that does not
    parse, or an unknown key, is a note (warned once per load), not an error: a typo must not stop every
    call."""
    values, notes = _parse(path)
    if notes:
        import warnings
        for n in notes:
            warnings.warn(f"flashport config: {n}", RuntimeWarning, stacklevel=3)
    return values, notes


def _parse(path: str) -> tuple[dict, tuple[str, ...]]:
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return {}, ()
    except OSError as e:
        return {}, (f"{path}: unreadable ({e}); ignored",)
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        doc = tomllib.loads(text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        return {}, (f"{path}: not valid TOML ({e}); ignored",)
    values, notes = {}, []
    for key, v in doc.items():
        name = key if key in SWITCHES else "FLASHPORT_" + key.upper()
        if name not in SWITCHES or name in _ENV_ONLY:
            notes.append(f"{path}: unknown key {key!r} ignored (known: "
                         f"{', '.join(n.removeprefix('FLASHPORT_').lower() for n in SWITCHES if n not in _ENV_ONLY)})")
        elif isinstance(v, dict):
            notes.append(f"{path}: key {key!r} must be a string, number, boolean or list; ignored")
        else:
            values[name] = _as_str(v)
    return values, tuple(notes)


def reload_config() -> None:
    _config.cache_clear()
    _loads[0] += 1


_loads = [0]   # reload_config() calls: part of state_key, since a reload may change every file-set switch
# What state_key reads: every switch and what locates the config file, as os.environ's own (encoded) keys.
_STATE_NAMES = (*SWITCHES, "XDG_CONFIG_HOME", "HOME")
_STATE_KEYS = tuple(map(os.environ.encodekey, _STATE_NAMES)) if _ENVIRON is not None else ()


def state_key() -> tuple:
    """A value that changes whenever any switch's value may have (the environment's raw values, the config file's
    location and reloads), cheap enough for every call: the launch-plan cache's key (flashport/plan_cache.py)."""
    if _ENVIRON is None:
        return (*map(os.environ.get, _STATE_NAMES), _loads[0])
    return (*map(_ENVIRON.get, _STATE_KEYS), _loads[0])


def config_values() -> dict:
    return _config(config_path())[0]


def config_notes() -> tuple[str, ...]:
    return _config(config_path())[1]


def raw(name: str) -> str | None:
    """The switch as set in the environment, else in the config file; None when neither sets it (an empty
    string is a value, e.g. an unknown backend name)."""
    if name not in SWITCHES:
        raise KeyError(f"undeclared switch {name!r}: declare it in flashport.env.SWITCHES")
    v = _getenv(name)
    if v is None and name not in _ENV_ONLY:
        v = _config(config_path())[0].get(name)
    return v


def raws(names: tuple) -> tuple:
    """raw() of several switches, reading the config file's values once (the dispatcher's memo key)."""
    cfg = _config(config_path())[0]
    get = _getenv
    return tuple(v if (v := get(n)) is not None else (None if n in _ENV_ONLY else cfg.get(n)) for n in names)


def source(name: str) -> str:
    """Where a switch's value comes from: "environment", "config <path>" or "default"."""
    if _getenv(name) is not None:
        return "environment"
    if name not in _ENV_ONLY and name in config_values():
        return f"config {config_path()}"
    return "default"


def value(name: str) -> str:
    v = raw(name)
    return SWITCHES[name].default if v is None else v


_ON, _OFF = frozenset(("1", "true", "yes", "on")), frozenset(("0", "false", "no", "off"))
_warned: set = set()


def warn_once(message: str, stacklevel: int = 2) -> None:
    """A RuntimeWarning the first time this message comes up in the process (a setting read on every call must not
    repeat it); stacklevel as warnings.warn counts it from the caller."""
    if message not in _warned:
        _warned.add(message)
        import warnings
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def flag(name: str) -> bool:
    """A 0/1 switch; true / yes / on and false / no / off (any case) read as 1 and 0, as Triton reads its own.
    Anything else keeps the switch's default, with a warning once per value: a typo must not pass unnoticed."""
    v = value(name)
    if v == "1" or v == "0":
        return v == "1"
    low = v.strip().lower()
    if low in _ON or low in _OFF:
        return low in _ON
    if not low:                   # set but empty: as if unset
        return SWITCHES[name].default == "1"
    warn_once(f"{name}={v!r} is not a 0/1 switch value (0, 1, true, false, yes, no, on, off); its default "
              f"{SWITCHES[name].default} is in force", stacklevel=2)
    return SWITCHES[name].default == "1"


def interpreting() -> bool:
    return flag("TRITON_INTERPRET")


def cache_dir() -> str:
    return value("FLASHPORT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flashport")


def snapshot() -> dict:
    """Every switch's value in force (defaults included), for reports."""
    return {name: value(name) for name in SWITCHES}


def sources() -> dict:
    """Every switch's origin (see `source`), for reports."""
    return {name: source(name) for name in SWITCHES}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=64)
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

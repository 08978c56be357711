"""The Triton versions flashport's kernels are tested on (one definition for the triton backend's gate and
the Gluon kernels').  Plain data: importing it imports no Triton.

The kernels lean on young or private Triton API (Gluon, knobs, the compiled kernel's launcher), which
changes between minor releases; torch >= 2.4 may bring an older Triton (torch 2.10 and 2.11 bundle 3.6.0,
2.12 brings 3.7.0).  An untested Triton is refused with a reason, not tried."""
from __future__ import annotations

TESTED_TRITON = ("3.6",)   # major.minor releases the kernels are tested on


def tested_text() -> str:
    """'3.6.x' (or '3.6.x, 3.7.x'): for messages."""
    return ", ".join(f"{v}.x" for v in TESTED_TRITON)


def is_tested(version) -> bool:
    """True for a Triton version string whose major.minor is in TESTED_TRITON ('3.6.0', '3.6.1+git...')."""
    if not isinstance(version, str):
        return False
    parts = version.split(".")
    return len(parts) >= 2 and ".".join(parts[:2]) in TESTED_TRITON

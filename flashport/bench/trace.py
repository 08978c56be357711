"""`flashport bench --trace PATH`: one forward and backward of every cell of the suite, as a user calls
it (backend=None), under torch.profiler, written as a Chrome trace (gzipped when PATH ends in .gz).
The timed runs stay unprofiled: the trace is what a user's profiler shows, not where the numbers
come from."""
from __future__ import annotations

import collections
import gzip
import json
import os
import shutil
import tempfile

import torch

import flashport

from .peers import dense_fn, make_cache, make_inputs
from .shapes import Shape


def _step(shape: Shape, device) -> None:
    if shape.kind == "decode":
        q, kc, vc, lens, table = make_cache(shape, device)
        flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)
        return
    q, k, v = make_inputs(shape, device, requires_grad="bwd" in shape.modes)
    out = dense_fn("flashport", shape, q, k, v)()
    if out.requires_grad:
        out.backward(torch.ones_like(out))


def trace(shapes: list[Shape], device, path: str) -> dict[str, int]:
    """Profile every shape once (after one unprofiled warm call each, so compiles stay out) and write
    the trace to `path`.  Returns {flashport range name: count} found in the trace."""
    for s in shapes:
        _step(s, device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for s in shapes:
            _step(s, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    raw = path[:-3] if path.endswith(".gz") else path
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = os.path.join(tmp, os.path.basename(raw))
        prof.export_chrome_trace(tmp_path)
        with open(tmp_path) as f:
            events = json.load(f).get("traceEvents", [])
        if path.endswith(".gz"):
            with open(tmp_path, "rb") as src, gzip.open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy(tmp_path, path)
    return dict(collections.Counter(e["name"] for e in events
                                    if isinstance(e.get("name"), str) and e["name"].startswith("flashport::")))

"""Which kernel variant served each call: module attributes wrapped inside the fuzzer's process only
(`Recorder.hooks()` patches them and restores them on exit; no library file changes).

Labels (one case may hit several):
  backend:<name>            dispatch.select_counted's answer (the backend that served the call)
  fwd:<cfg> / bwd_dkdv:<cfg> / bwd_dq:<cfg>
                            the KernelConfig tuning.launch_with_fallback launched, as seen by
                            kernels/attn_fwd.py and attn_bwd.py, e.g. "fwd:128x64w8s3" (+"split")
  gluon_fwd / gluon_bwd     attn_fwd_hopper.forward / attn_bwd_hopper.backward served (returned non-None), with
                            gluon_fwd:<feature> / gluon_bwd:<feature> for the variants behind switches it ran
                            (window, alibi, split: head dims 80 / 96; the backward's m128 and group_loop), so a
                            run counts the hits of each
  gluon_fwd_declined / ..   they returned None (failed to compile; the Triton kernels served)
  decode:single / decode:splitkv
                            the KV-cache kernel's launch plan (decode.plan_for) had 1 / > 1 key splits
  merge:triton / merge:torch
                            merge_attention_states ran the Triton merge kernel / the PyTorch merge
The kernel modules are only imported (and wrapped) where the triton backend can run: on CUDA, or under
TRITON_INTERPRET=1 (importing them elsewhere would fix triton.jit's compiled-or-interpreted choice).
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch
from .. import env

# label prefix -> variant class (the GPU tier asserts that each class was hit)
CLASSES = {"fwd:": "triton_fwd", "bwd_dkdv:": "triton_bwd", "bwd_dq:": "triton_bwd", "gluon_fwd": "gluon_fwd",
           "gluon_bwd": "gluon_bwd", "decode:single": "decode_single", "decode:splitkv": "decode_splitkv",
           "merge:triton": "merge_triton", "merge:torch": "merge_torch"}
GPU_CLASSES = ("triton_fwd", "triton_bwd", "gluon_fwd", "gluon_bwd", "decode_single", "decode_splitkv",
               "merge_triton")


def variant_class(label: str):
    if label.endswith("_declined"):
        return None
    for prefix, cls in CLASSES.items():
        if label.startswith(prefix):
            return cls
    return None


def config_label(kernel: str, cfg) -> str:
    try:
        return f"{kernel}:{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}" + \
            ("split" if getattr(cfg, "split", False) else "")
    except AttributeError:
        return f"{kernel}:{cfg}"


class Hits:
    """The labels of one capture and the last backend dispatch chose."""

    def __init__(self):
        self.labels: set = set()
        self.served = None


class Recorder:
    def __init__(self):
        self.current = None
        self.last = None
        self.installed: list[str] = []
        self.missing: list[str] = []

    def hit(self, label: str) -> None:
        if self.current is not None:
            self.current.labels.add(label)

    @contextlib.contextmanager
    def capture(self):
        hits = Hits()
        self.current, self.last = hits, hits
        try:
            yield hits
        finally:
            self.current = None

    # ------------------------------------------------------------------------- hooks
    @contextlib.contextmanager
    def hooks(self, device):
        """Wrap the variant-deciding functions for the duration of the block (restored afterwards)."""
        saved = []

        def patch(module, name, make):
            real = getattr(module, name, None)
            where = f"{module.__name__}.{name}"
            if real is None:
                self.missing.append(where)
                return
            saved.append((module, name, real))
            setattr(module, name, functools.wraps(real)(make(real)))
            self.installed.append(where)

        from flashport import api, dispatch
        patch(dispatch, "select_counted", self._select)
        patch(api, "merge_states_torch", lambda real: self._labelled(real, "merge:torch"))
        if _kernels_usable(device):
            try:
                mods = {n: importlib.import_module(f"flashport.kernels.{n}")
                        for n in ("attn_fwd", "attn_bwd", "attn_fwd_hopper", "attn_bwd_hopper", "decode", "merge")}
            except Exception as e:  # noqa: BLE001 - no Triton / a broken install: nothing to wrap
                self.missing.append(f"flashport.kernels ({type(e).__name__}: {e})")
                mods = {}
            if mods:
                patch(mods["attn_fwd"], "launch_with_fallback", self._launch)
                patch(mods["attn_bwd"], "launch_with_fallback", self._launch)
                patch(mods["attn_fwd_hopper"], "forward", lambda real: self._gluon(real, "gluon_fwd"))
                patch(mods["attn_bwd_hopper"], "backward", lambda real: self._gluon(real, "gluon_bwd"))
                patch(mods["decode"], "plan_for", self._plan)
                patch(mods["merge"], "merge_states_triton", lambda real: self._labelled(real, "merge:triton"))
        try:
            yield self
        finally:
            for module, name, real in reversed(saved):
                setattr(module, name, real)

    def _select(self, real):
        def select_counted(spec, backend=None, *a, **kw):
            impl, fallback = real(spec, backend, *a, **kw)
            if self.current is not None:
                self.current.served = impl.name
                self.current.labels.add(f"backend:{impl.name}")
            return impl, fallback
        return select_counted

    def _labelled(self, real, label):
        def wrapper(*a, **kw):
            self.hit(label)
            return real(*a, **kw)
        return wrapper

    def _launch(self, real):
        def launch_with_fallback(kernel, *a, **kw):
            cfg = real(kernel, *a, **kw)
            self.hit(config_label(kernel, cfg))
            return cfg
        return launch_with_fallback

    def _gluon(self, real, label):
        def wrapper(*a, **kw):
            result = real(*a, **kw)
            if not kw.get("warmup"):
                self.hit(label if result is not None else label + "_declined")
                if result is not None and a:
                    for feature in gluon_features(a[0], backward=label == "gluon_bwd"):
                        self.hit(f"{label}:{feature}")
            return result
        return wrapper

    def _plan(self, real):
        def plan_for(*a, **kw):
            plan = real(*a, **kw)
            if plan is not None:
                self.hit("decode:single" if plan.num_splits == 1 else "decode:splitkv")
            return plan
        return plan_for


def gluon_features(spec, backward: bool) -> list[str]:
    """The switched variants of the Gluon kernels a served call ran (kernels/attn_{fwd,bwd}_hopper.py)."""
    out = [name for name, on in (("window", spec.visibility.kind == "window"), ("alibi", spec.alibi is not None),
                                 ("split", spec.head_dim in (80, 96))) if on]
    if backward:
        if spec.head_dim == 64 and env.flag("FLASHPORT_HOPPER_BWD_M128"):
            out.append("m128")
        if spec.group_size > 1 and env.flag("FLASHPORT_HOPPER_BWD_GROUP_LOOP"):
            out.append("group_loop")
    return out


def _kernels_usable(device) -> bool:
    dev = torch.device(device)
    if env.interpreting():
        return dev.type == "cpu"
    return dev.type == "cuda"


def jit_cache_keys() -> dict:
    """{kernel name: [specialisation keys]} of the Triton kernels compiled (or loaded from the disk cache) in
    this process: best effort, from JITFunction.device_caches (Triton 3.x); {} when unavailable."""
    import sys
    names = {"attn_fwd": ("_attn_fwd",), "attn_bwd": ("_bwd_preprocess", "_bwd_dkdv", "_bwd_dq"),
             "decode": ("_kvcache_split_kernel",), "merge": ("_merge_kernel",)}
    out = {}
    for mod_name, fns in names.items():
        mod = sys.modules.get(f"flashport.kernels.{mod_name}")
        for fn_name in fns:
            fn = getattr(mod, fn_name, None) if mod is not None else None
            caches = getattr(fn, "device_caches", None)
            if not caches:
                continue
            keys = []
            try:
                for entry in caches.values():
                    cache = entry[0] if isinstance(entry, tuple) else entry
                    keys += [str(k) for k in cache.keys()]
            except Exception:  # noqa: BLE001 - private Triton structure
                continue
            out[fn_name] = keys
    return out

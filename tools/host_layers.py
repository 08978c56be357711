"""Host time of flashport's own layers around a kernel, on a CPU: a null backend (its forward and backward return
tensors made once, so no kernel runs) served through flashport.attention, against F.scaled_dot_product_attention at
a tiny shape.  What a GPU call pays in Python on top of its kernels' launches (spec, plan cache, serve, monitor, the
autograd Function and the engine), measured where no device is needed; and the two ways an SDPA backend's backward
is bracketed (Functions, node hooks) and its kernel chosen (sdpa_kernel, sdpa.allowing).  PERFLOG row 98.

    PYTHONPATH=. python tools/host_layers.py             # µs per call, best of 5 loops
    PYTHONPATH=. python tools/host_layers.py --profile   # and a cProfile of each path, top 25 by own time
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import flashport  # noqa: E402
from flashport import dispatch  # noqa: E402
from flashport.capabilities import Capabilities  # noqa: E402
from host_cpu import per_call_us  # noqa: E402  (tools/host_cpu.py: best of 5 loops of n calls, after 200 warm)


class NullBackend(dispatch.Backend):
    """`null`: returns tensors made on its first call (wrong values: timing only, never registered for users)."""

    name = "null"
    auto = False
    caps = Capabilities(devices=("cpu",), dtypes=("float32",))

    def __init__(self):
        self.made = {}

    def forward(self, spec, inputs):
        key = ("fwd", spec)
        if key not in self.made:
            self.made[key] = (torch.zeros_like(inputs.q), torch.zeros(spec.batch, spec.heads_q, spec.seqlen_q))
        out, lse = self.made[key]
        return out, lse, None

    def backward(self, spec, inputs, saved, dout, dlse):
        key = ("bwd", spec)
        if key not in self.made:
            self.made[key] = tuple(torch.zeros_like(t) for t in (saved.q, saved.k, saved.v))
        return self.made[key]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dispatch.register(NullBackend())
    q, k, v = (torch.randn(1, 16, 4, 64) for _ in range(3))
    t = [x.transpose(1, 2) for x in (q, k, v)]
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    tg = [x.transpose(1, 2) for x in (qg, kg, vg)]
    do, do_t = torch.randn(1, 16, 4, 64), torch.randn(1, 4, 16, 64)

    def fwd():
        with torch.no_grad():
            return flashport.attention(q, k, v, backend="null")

    def train():
        out = flashport.attention(qg, kg, vg, backend="null")
        return torch.autograd.grad(out, (qg, kg, vg), do)

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(*t)

    def sdpa_train():
        return torch.autograd.grad(F.scaled_dot_product_attention(*tg), tg, do_t)

    def sdpa_train_through_flashport():
        out = flashport.attention(qg, kg, vg, backend="sdpa")
        return torch.autograd.grad(out, (qg, kg, vg), do)

    from flashport import monitor
    from flashport.spec import dense_spec
    spec, _ = dense_spec(qg, kg, vg, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)

    def sdpa_train_functions():   # an "own" backend's backward bracketed by two autograd Functions (serve's way)
        rng, *qkv = monitor.bracket_inputs(spec, "x", *tg)
        out = monitor.bracket_output(rng, F.scaled_dot_product_attention(*qkv))
        return torch.autograd.grad(out, tg, do_t)

    def sdpa_train_hooks():       # ... by hooks on the fused op's node (the SDPA kernels on CUDA: bracket_node)
        out = F.scaled_dot_product_attention(*tg)
        monitor.bracket_node(spec, "x", out.grad_fn)
        return torch.autograd.grad(out, tg, do_t)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashport.backend.sdpa import allowing

    def context_sdpa_kernel():   # what an SDPA backend's CUDA call entered before row 98
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION], set_priority=True):
            pass

    def context_allowing():      # ... and since
        with allowing(("cudnn",)):
            pass

    paths = {"flashport (null kernel) forward": fwd, "flashport (null kernel) forward + backward": train,
             "F.sdpa forward (its kernel included)": sdpa_fwd, "F.sdpa forward + backward": sdpa_train,
             "F.sdpa fwd + bwd, bracketed by Functions": sdpa_train_functions,
             "F.sdpa fwd + bwd, bracketed by node hooks": sdpa_train_hooks,
             "flashport backend='sdpa' forward + backward": sdpa_train_through_flashport,
             "context: sdpa_kernel([cuDNN], set_priority=True)": context_sdpa_kernel,
             "context: sdpa.allowing(('cudnn',))": context_allowing}
    for name, fn in paths.items():
        print(f"{name:48} {per_call_us(fn, 1000):8.1f} µs", flush=True)
        if a.profile and name.startswith("flashport"):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(2000):
                fn()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())

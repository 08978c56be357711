"""Issue [7]: host microseconds per public call with the instrumentation on and off, same process,
configurations interleaved over rounds (medians).  Configurations: ranges on (the default: a profiler
check + NVTX push/pop), ranges off (FLASHPORT_RANGES=0), guard at 1% (ranges on), and ranges on under
an active torch.profiler (what a profiled run pays).  Calls: a small forward (host-bound: the kernel
is a few microseconds) and a small forward+backward, each through the kernels auto picks and through a
null backend (returns preallocated outputs: the host cost of flashport's own layer, without launch noise).
Writes $OUT/instrument_cost.json."""
import json
import os
import statistics
import time

import torch

import flashport
from flashport import dispatch
from flashport.backend.blockwise import BlockwiseBackend

DEV = "cuda"
N, ROUNDS = 500, 9
q = torch.randn(1, 128, 8, 64, device=DEV, dtype=torch.bfloat16)
k, v = torch.randn_like(q), torch.randn_like(q)
qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
ones = torch.ones_like(q)



class Null(BlockwiseBackend):
    """Serves any call blockwise serves, in no time: the output and lse are preallocated."""
    name, state_family, slow_on_gpu = "null", "null", False
    out, lse = torch.zeros_like(q), torch.zeros(1, 8, 128, device=DEV)

    def forward(self, spec, inputs):
        return self.out, self.lse, None


NULL = Null()


def fwd():
    flashport.attention(q, k, v, causal=True)


def step():
    flashport.attention(qg, kg, vg, causal=True).backward(ones)


def null_fwd():
    flashport.attention(q, k, v, causal=True, backend="null")


CONFIGS = {
    "ranges on": dict(ranges="1", guard=0.0, profiler=False),
    "ranges off": dict(ranges="0", guard=0.0, profiler=False),
    "ranges on, guard 1%": dict(ranges="1", guard=0.01, profiler=False),
    "ranges off, guard 1%": dict(ranges="0", guard=0.01, profiler=False),
    "ranges on, torch.profiler recording": dict(ranges="1", guard=0.0, profiler=True),
}


def host_us(fn, cfg) -> float:
    os.environ["FLASHPORT_RANGES"] = cfg["ranges"]
    flashport.guard(sample_rate=cfg["guard"], tolerance=1e30)   # its cost, not its verdict (null is wrong)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if cfg["profiler"] else None
    if prof:
        prof.__enter__()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    t = (time.perf_counter() - t0) / N * 1e6
    torch.cuda.synchronize()
    if prof:
        prof.__exit__(None, None, None)
    flashport.guard(sample_rate=0.0)
    return t


res = {}
dispatch.register(NULL)
for call, fn in (("forward b1 s128 h8 d64 causal", fwd), ("forward+backward b1 s128 h8 d64 causal", step),
                 ("null backend, forward", null_fwd)):
    samples = {name: [] for name in CONFIGS}
    for r in range(ROUNDS):
        names = list(CONFIGS)[r % len(CONFIGS):] + list(CONFIGS)[:r % len(CONFIGS)]
        for name in names:
            samples[name].append(host_us(fn, CONFIGS[name]))
    res[call] = {name: {"median_us": round(statistics.median(s), 2), "samples_us": [round(x, 2) for x in s]}
                 for name, s in samples.items()}
    base = res[call]["ranges off"]["median_us"]
    for name, d in res[call].items():
        d["minus_ranges_off_us"] = round(d["median_us"] - base, 2)
        print(f"{call:42s} {name:38s} {d['median_us']:8.2f} us  ({d['minus_ranges_off_us']:+.2f})")
os.environ.pop("FLASHPORT_RANGES", None)
doc = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "calls_per_sample": N,
       "rounds": ROUNDS, "backends": sorted(flashport.stats()), "results": res}
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "instrument_cost.json"), "w") as f:
        json.dump(doc, f, indent=1)

"""The Hopper kernels' variants built without a GPU (22nd and 23rd sessions), each against what serves the call
with its switch off, one process, bf16: sliding windows (FLASHPORT_HOPPER_FWD_WINDOW, FLASHPORT_HOPPER_BWD_WINDOW;
PERFLOG rows 78, 79), the two-part head dims 80 and 96 (FLASHPORT_HOPPER_FWD_SPLIT, FLASHPORT_HOPPER_BWD_SPLIT;
rows 81, 86), ALiBi in both directions (FLASHPORT_HOPPER_FWD_ALIBI, FLASHPORT_HOPPER_BWD_ALIBI; rows 82, 83) and
the forward's wait for P V held after the softmax and its warpgroups' ping-pong (FLASHPORT_HOPPER_FWD_PIN,
FLASHPORT_HOPPER_FWD_PINGPONG; rows 87, 88, the standard grid's cells) and the backward's dQ-first order
(FLASHPORT_HOPPER_BWD_DQ_FIRST; row 89), the backward's GQA group loop (FLASHPORT_HOPPER_BWD_GROUP_LOOP; row 90)
and its 128-row Q tile at D=64 (FLASHPORT_HOPPER_BWD_M128; row 91).  Per
case and setting: forward and backward milliseconds and TFLOP/s (visible pairs, FlashAttention's 2.5x convention
for the backward), which kernels served, and the largest difference between each run's output and gradients and
those of the first setting, relative to their scale.  Cases: issue [14]'s window 2048 over 16k (GQA 16/4),
issue [8]'s window 4096 over 16k (GQA 32/8), the programmable suite's window + 4 sinks (B=2, H=16, S=16384)
as a whole, and a two-sided band at D=64.  JSON lines to --out."""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import flashport
from flashport import dispatch, mods
from flashport.bench.timing import gpu_ms

WINDOWS = (("triton", {}), ("gluon bwd", {"FLASHPORT_HOPPER_BWD_WINDOW": "1"}),
           ("gluon both", {"FLASHPORT_HOPPER_BWD_WINDOW": "1", "FLASHPORT_HOPPER_FWD_WINDOW": "1"}))
SPLIT = (("triton", {}), ("gluon fwd", {"FLASHPORT_HOPPER_FWD_SPLIT": "1"}),
         ("gluon both", {"FLASHPORT_HOPPER_FWD_SPLIT": "1", "FLASHPORT_HOPPER_BWD_SPLIT": "1"}))
ALIBI = (("triton", {}), ("gluon fwd", {"FLASHPORT_HOPPER_FWD_ALIBI": "1"}),
         ("gluon both", {"FLASHPORT_HOPPER_FWD_ALIBI": "1", "FLASHPORT_HOPPER_BWD_ALIBI": "1"}))
PIN = (("gluon", {}), ("gluon pin", {"FLASHPORT_HOPPER_FWD_PIN": "1"}),
       ("gluon pingpong", {"FLASHPORT_HOPPER_FWD_PINGPONG": "1"}),
       ("gluon pin+pingpong", {"FLASHPORT_HOPPER_FWD_PIN": "1", "FLASHPORT_HOPPER_FWD_PINGPONG": "1"}))
DQ_FIRST = (("gluon", {}), ("gluon dq first", {"FLASHPORT_HOPPER_BWD_DQ_FIRST": "1"}))
GROUP_LOOP = (("gluon", {}), ("gluon group loop", {"FLASHPORT_HOPPER_BWD_GROUP_LOOP": "1"}))
GROUP_LOOP_WINDOW = tuple((label, {**sw, "FLASHPORT_HOPPER_BWD_WINDOW": "1", "FLASHPORT_HOPPER_FWD_WINDOW": "1"})
                          for label, sw in GROUP_LOOP)
M128 = (("gluon", {}), ("gluon m128", {"FLASHPORT_HOPPER_BWD_M128": "1"}))
SWITCHES = ("FLASHPORT_HOPPER_BWD_GROUP_LOOP", "FLASHPORT_HOPPER_BWD_M128", "FLASHPORT_HOPPER_FWD_PIN", "FLASHPORT_HOPPER_FWD_PINGPONG", "FLASHPORT_HOPPER_BWD_DQ_FIRST", "FLASHPORT_HOPPER_FWD_WINDOW", "FLASHPORT_HOPPER_BWD_WINDOW", "FLASHPORT_HOPPER_FWD_SPLIT",
            "FLASHPORT_HOPPER_FWD_ALIBI", "FLASHPORT_HOPPER_BWD_ALIBI", "FLASHPORT_HOPPER_BWD_SPLIT")
CASES = [   # name, B, S, Hq, Hkv, D, call keywords, settings
    ("pin: D=128, S=8k, H=16", 2, 8192, 16, 16, 128, {}, PIN),
    ("pin: D=128, S=16k, causal, H=16", 1, 16384, 16, 16, 128, dict(causal=True), PIN),
    ("pin: D=128, S=2k, causal, GQA 32/8", 4, 2048, 32, 8, 128, dict(causal=True), PIN),
    ("pin: D=64, S=16k, H=16", 1, 16384, 16, 16, 64, {}, PIN),
    ("pin: D=256, S=4k, H=16", 2, 4096, 16, 16, 256, {}, PIN),
    ("dq first: D=128, S=8k, H=16", 2, 8192, 16, 16, 128, {}, DQ_FIRST),
    ("dq first: D=128, S=4k, causal, GQA 32/8", 2, 4096, 32, 8, 128, dict(causal=True), DQ_FIRST),
    ("dq first: D=64, S=16k, H=16", 1, 16384, 16, 16, 64, {}, DQ_FIRST),
    ("window 2048 / 16k, GQA 16/4, D=128", 1, 16384, 16, 4, 128, dict(window_size=(2048, 0)), WINDOWS),
    ("window 4096 / 16k, GQA 32/8, D=128", 1, 16384, 32, 8, 128, dict(window_size=(4096, 0)), WINDOWS),
    ("window 2048 + 4 sinks, B=2, H=16, D=128", 2, 16384, 16, 16, 128, "sinks", WINDOWS),
    ("band (256, 256) / 8k, H=16, D=64", 2, 8192, 16, 16, 64, dict(window_size=(256, 256)), WINDOWS),
    ("D=96, S=4k, causal, H=16", 2, 4096, 16, 16, 96, dict(causal=True), SPLIT),        # issue [14]'s cell
    ("D=96, S=8k, H=16", 1, 8192, 16, 16, 96, {}, SPLIT),
    ("D=80, S=1024, H=16 (DiT)", 16, 1024, 16, 16, 80, {}, SPLIT),
    ("D=80, S=4k, causal, GQA 16/4", 2, 4096, 16, 4, 80, dict(causal=True), SPLIT),
    ("ALiBi, S=16k, causal, H=16, D=128", 2, 16384, 16, 16, 128, dict(causal=True, alibi_slopes="per head"), ALIBI),
    ("group loop: llama3-8b, B=4, S=4k, causal, GQA 32/8", 4, 4096, 32, 8, 128, dict(causal=True), GROUP_LOOP),
    ("group loop: S=8k, causal, GQA 32/8", 1, 8192, 32, 8, 128, dict(causal=True), GROUP_LOOP),
    ("group loop: D=64, S=4k, GQA 32/8", 2, 4096, 32, 8, 64, {}, GROUP_LOOP),
    ("group loop: window 4096 / 16k, GQA 32/8", 1, 16384, 32, 8, 128, dict(window_size=(4096, 0)), GROUP_LOOP_WINDOW),
    ("m128: D=64, S=16k, H=16", 1, 16384, 16, 16, 64, {}, M128),                 # issue [14]'s D=64 cell
    ("m128: D=64, S=4k, causal, H=32", 4, 4096, 32, 32, 64, dict(causal=True), M128),
    ("m128: D=64, S=1024, H=32", 16, 1024, 32, 32, 64, {}, M128),
]


def visible_pairs(s, left, right):
    left = s if left < 0 else left
    right = s if right < 0 else right
    return sum(min(i + right, s - 1) - max(i - left, 0) + 1 for i in range(s))


def _set(switches: dict) -> None:
    for name in SWITCHES:
        os.environ[name] = switches.get(name, "0")
    dispatch.clear_cache()   # (the switches are in the memo's key too; a plan is never carried over)


def main():
    os.environ["FLASHPORT_TABLE"] = "off"   # static priority: the new variants first where their switches allow
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds per case (settings in alternating order)")
    ap.add_argument("--only", nargs="*", default=None, help="cases whose name contains one of these (default: all)")
    args = ap.parse_args()
    with open(args.out, "w") as out:
        out.write(json.dumps({"card": torch.cuda.get_device_name()}) + "\n")
        for name, b, s, hq, hkv, d, kw, settings in CASES:
            if args.only and not any(part in name for part in args.only):
                continue
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                    for _ in range(2))
            do = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            if kw == "sinks":
                bm = flashport.create_block_mask(mods.sliding_window(2048, sinks=4), None, None, s, s, device="cuda")
                call, left, right = dict(block_mask=bm), 2048, 0
            else:
                call, (left, right) = dict(kw), kw.get("window_size", (-1, 0) if kw.get("causal") else (-1, -1))
                if call.get("alibi_slopes") == "per head":   # ALiBi's usual geometric slopes
                    call["alibi_slopes"] = torch.exp2(-8.0 * torch.arange(1, hq + 1, device="cuda") / hq)
            flops = 4 * b * hq * d * visible_pairs(s, left, right)
            fn = lambda: flashport.attention(q, k, v, **call)                                   # noqa: E731
            step = lambda: torch.autograd.grad(fn(), (q, k, v), do)                             # noqa: E731
            results, rows = {}, {}
            first = settings[0][0]
            for label, switches in settings:   # compile, check against the first setting, note who served
                _set(switches)
                try:
                    flashport.reset_stats()
                    o = fn()
                    results[label] = (o.detach(), *torch.autograd.grad(o, (q, k, v), do))
                    served = {n: (c["forward"], c["backward"]) for n, c in flashport.stats().items()
                              if c["forward"] or c["backward"]}
                    rows[label] = dict(case=name, run=label, served=str(served), fwd_ms=[], bwd_ms=[])
                    if label != first and first in results:
                        rows[label]["relative_max_difference"] = max(
                            float((a.float() - c.float()).abs().max() / c.float().abs().max().clamp_min(1e-6))
                            for a, c in zip(results[label], results[first]))
                except Exception as e:  # noqa: BLE001 - reported, the next run goes on
                    out.write(json.dumps(dict(case=name, run=label, error=f"{type(e).__name__}: {e}"[:400])) + "\n")
            # Timed in rounds that alternate the settings' order (A B C, C B A, ...): a card that slows as it
            # warms (the 23rd session's H100 read the same kernel 695 and 629 TFLOP/s minutes apart) then biases
            # no setting; the median of the rounds is reported.
            for r in range(args.rounds):
                for label in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
                    _set(dict(settings)[label])
                    f_ms = gpu_ms(fn)
                    rows[label]["fwd_ms"].append(f_ms)
                    rows[label]["bwd_ms"].append(gpu_ms(step) - f_ms)
            for row in rows.values():
                f_ms, b_ms = statistics.median(row["fwd_ms"]), statistics.median(row["bwd_ms"])
                row.update(fwd_tflops=flops / f_ms / 1e9, bwd_tflops=2.5 * flops / b_ms / 1e9)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                       if k not in ("fwd_ms", "bwd_ms")}, flush=True)
            for name_ in SWITCHES:
                os.environ.pop(name_, None)


if __name__ == "__main__":
    main()

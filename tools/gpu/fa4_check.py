"""Issue [14]'s `fa4` backend on the GPU, in three parts (run by tools/gpu/fa4_check.sh; each prints as it goes, so a
timeout still leaves a log):

  compile   FA4's import time, then first-call (compile + run) and warm times of one shape through
            flashport.attention(backend="fa4"), forward and backward;
  probes    FA4 called directly on KV-cache and varlen layouts whose unused rows hold NaN (dense cache with
            seqused_k, paged cache with page_table at a page size of 64 and 128, varlen with a NaN tail): whether
            its output stays finite and exact there -- the evidence for serving KV-cache calls through it, and for
            (or against) the zero-tailed copies the varlen path makes;
  check     the grid of `flashport check --backend fa4` (flashport/check.py, the same run_check) with one line per
            case as it finishes, then the CLI's table and summary.

    python tools/gpu/fa4_check.py [compile] [probes] [check] [--dtype bfloat16,float16]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch


def _sync():
    torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    r = fn()
    _sync()
    return r, time.perf_counter() - t0


def part_compile() -> None:
    import flashport
    from flashport.backend import fa4
    t0 = time.perf_counter()
    import flash_attn.cute  # noqa: F401
    print(f"flash-attn-4 {fa4.version()}: import flash_attn.cute {time.perf_counter() - t0:.1f} s", flush=True)
    info = {b.name: b for b in flashport.backends()}["fa4"]
    print(f"fa4 available={info.available} reasons={info.reasons}", flush=True)
    if not info.available:
        return
    b, s, h, d = 2, 2048, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    label = f"B={b} S={s} H={h} D={d} bf16 causal"
    run = lambda: flashport.attention(q, k, v, causal=True, backend="fa4")  # noqa: E731
    _, cold = _timed(run)
    _, warm = _timed(run)
    print(f"compile fwd  {label}: first call {cold:.2f} s, warm {warm * 1e3:.2f} ms -> compile ~{cold - warm:.2f} s",
          flush=True)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def train():
        out = flashport.attention(qg, kg, vg, causal=True, backend="fa4")
        return torch.autograd.grad(out, (qg, kg, vg), do)
    _, cold = _timed(train)
    _, warm = _timed(train)
    print(f"compile fwd+bwd {label}: first call {cold:.2f} s, warm {warm * 1e3:.2f} ms -> compile ~{cold - warm:.2f} s "
          f"(the forward with lse for training may be a kernel of its own)", flush=True)
    fwd = 4 * b * h * s * s * d / 2
    print(f"warm fwd+bwd {fwd * 3.5 / warm / 1e12:.0f} TFLOP/s (FlashAttention convention)", flush=True)


def _verdict(name, out, ref):
    finite = bool(torch.isfinite(out).all())
    err = (out.float() - ref.float()).abs().max().item() if finite else float("nan")
    ok = finite and err < 2e-2
    print(f"probe {name:<44} finite={finite} max|err|={err:.2e} -> {'OK' if ok else 'NOT SAFE'}", flush=True)


def part_probes() -> None:
    from flash_attn.cute import interface as fa

    from flashport.backend.reference import materialized_attention
    dt, hq, hkv, d = torch.bfloat16, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=dt, generator=g)  # noqa: E731
    lens = torch.tensor([37, 200], dtype=torch.int32, device="cuda")
    bsz, cap, sq = 2, 256, 1
    q = rnd(bsz, sq, hq, d)
    kd, vd = rnd(bsz, cap, hkv, d), rnd(bsz, cap, hkv, d)
    valid = torch.arange(cap, device="cuda")[None, :] < lens[:, None]
    kn = torch.where(valid[..., None, None], kd, float("nan"))
    vn = torch.where(valid[..., None, None], vd, float("nan"))
    ref, _ = materialized_attention(q, torch.nan_to_num(kn), torch.nan_to_num(vn), scale=d ** -0.5,
                                    seqlens_k=lens, compute_dtype=torch.float32)
    tries = [("dense cache, seqused_k, NaN past lengths",
              lambda: fa.flash_attn_varlen_func(q, kn, vn, seqused_k=lens, causal=True))]
    for page in (64, 128):
        n = cap // page
        perm = torch.randperm(bsz * n + 2, device="cuda")[: bsz * n]
        table = perm.view(bsz, n).to(torch.int32)
        kc = torch.full((bsz * n + 2, page, hkv, d), float("nan"), device="cuda", dtype=dt)
        vc = kc.clone()
        kc[perm.long()] = kn.reshape(bsz * n, page, hkv, d)
        vc[perm.long()] = vn.reshape(bsz * n, page, hkv, d)
        tries.append((f"paged cache, page {page}, NaN past lengths",
                      lambda kc=kc, vc=vc, table=table: fa.flash_attn_varlen_func(q, kc, vc, seqused_k=lens,
                                                                                  page_table=table, causal=True)))
    for name, fn in tries:
        try:
            r = fn()
            _verdict(name, r[0] if isinstance(r, tuple) else r, ref)
        except Exception as e:  # noqa: BLE001 - a refusal is an answer too
            print(f"probe {name:<44} raised {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
    # varlen: the last sequence's key tile reads past cu_seqlens_k[-1] into a NaN tail
    seq, tail = [100, 77], 40
    cu = torch.tensor([0, seq[0], sum(seq)], dtype=torch.int32, device="cuda")
    qv, kv, vv = rnd(sum(seq), hq, d), rnd(sum(seq) + tail, hkv, d), rnd(sum(seq) + tail, hkv, d)
    kv[sum(seq):], vv[sum(seq):] = float("nan"), float("nan")
    outs = []
    for i in range(2):
        a, b = cu[i].item(), cu[i + 1].item()
        outs.append(materialized_attention(qv[None, a:b], kv[None, a:b], vv[None, a:b], scale=d ** -0.5, right=0,
                                           compute_dtype=torch.float32)[0][0])
    try:
        out = fa.flash_attn_varlen_func(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(seq),
                                        max_seqlen_k=max(seq), causal=True)
        _verdict("varlen, NaN past cu_seqlens_k[-1] (raw FA4)", out[0] if isinstance(out, tuple) else out,
                 torch.cat(outs))
    except Exception as e:  # noqa: BLE001
        print(f"probe varlen raised {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)


def part_check(dtypes) -> int:
    from flashport.check import format_table, grid, run_check
    device = torch.device("cuda")
    print(f"check: the grid of `flashport check --backend fa4` ({len(grid(device))} cases x "
          f"{', '.join(str(t).replace('torch.', '') for t in dtypes)})", flush=True)
    t0 = time.perf_counter()

    def progress(r):
        err = f"{r.err:.2e}/{r.bound:.2e}" if not math.isnan(r.err) else "-"
        print(f"  {r.status:<4} {r.case:<34} {r.checked:<18} {r.worst:<4} {err:<20} {r.seconds:6.1f} s  {r.note}",
              flush=True)
    results = run_check(["fa4"], device, dtypes, progress=progress)
    print(format_table(results))
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if counts["FAIL"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("parts", nargs="*", default=["compile", "probes", "check"])
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rc = 0
    for part in a.parts:
        print(f"\n== {part}", flush=True)
        if part == "compile":
            part_compile()
        elif part == "probes":
            part_probes()
        elif part == "check":
            rc |= part_check([getattr(torch, t.strip()) for t in a.dtype.split(",")])
    return rc


if __name__ == "__main__":
    sys.exit(main())

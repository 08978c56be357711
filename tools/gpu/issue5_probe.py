"""Probe of the two GPU-only wrong answers of issue [5] (window (0, 0) gradients; fp16 large logits with a narrow
causal window): error / bound per quantity for the default path and for every forward / backward candidate config.
Writes JSON lines to $OUT/issue5_probe.jsonl."""
import json, os, sys, time, itertools
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import flashport
from flashport.kernels import attn_fwd, attn_bwd, tuning
from flashport.spec import dense_spec
from flashport.check import rule_error, magnitude
from conformance import Case, _math

out_path = os.path.join(os.environ.get("OUT", "/tmp"), "issue5_probe.jsonl")
f = open(out_path, "w")
def emit(**kw):
    print(json.dumps(kw), flush=True); f.write(json.dumps(kw) + "\n"); f.flush()

def inputs(case, amp, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = case.dv or case.d
    r = lambda *s: torch.randn(*s, generator=g).to(case.dtype).cuda()
    q = (r(case.b, case.sq, case.hq, case.d).float() * amp).to(case.dtype)
    k = (r(case.b, case.sk, case.hkv, case.d).float() * amp).to(case.dtype)
    return q, k, r(case.b, case.sk, case.hkv, dv), r(case.b, case.sq, case.hq, dv)

def ratios(case, q, k, v, do, out, grads):
    rl = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = _math(*rl, case, None, torch.float64)
    ll = [t.clone().requires_grad_() for t in (q, k, v)]
    low, _ = _math(*ll, case, None, case.dtype)
    res = {"out": rule_error(out, ref, low, case.dtype, 2)}
    if grads is not None:
        rg = torch.autograd.grad(ref, rl, do.double()); lg = torch.autograd.grad(low, ll, do)
        mag = magnitude(q, k, v, do)
        for n, a, r_, l_ in zip(("dq", "dk", "dv"), grads, rg, lg):
            res[n] = rule_error(a, r_, l_, case.dtype, 3, mag)
    return {n: (round(e / b, 3), e) for n, (e, b) in res.items()}

def default_path(case, amp):
    q, k, v, do = inputs(case, amp)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashport.attention(*leaves, causal=case.causal, window_size=case.window, softmax_scale=case.scale,
                              backend="triton")
    grads = torch.autograd.grad(out, leaves, do)
    return ratios(case, q, k, v, do, out, grads)

def per_config(case, amp):
    q, k, v, do = inputs(case, amp)
    spec, _ = dense_spec(q, k, v, causal=case.causal, softmax_scale=case.scale, window_size=case.window, softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    rows = []
    fcands = tuning.candidates("fwd", spec, q.device)
    for cfg in fcands:
        out, lse, lse2 = attn_fwd.forward(spec, q, k, v, config=cfg)
        rows.append(("fwd", str(cfg), ratios(case, q, k, v, do, out, None)["out"]))
    out, lse, lse2 = attn_fwd.forward(spec, q, k, v, config=fcands[0])
    for kern in ("bwd_dkdv", "bwd_dq"):
        for cfg in tuning.candidates(kern, spec, q.device):
            grads = attn_bwd.backward(spec, do, q, k, v, out, lse2, configs={kern: cfg})
            r = ratios(case, q, k, v, do, out, grads)
            rows.append((kern, str(cfg), {n: r[n] for n in ("dq", "dk", "dv")}))
    return rows

t0 = time.time()
for dt, d, sq, win, scale, amp in itertools.product((torch.float16, torch.bfloat16), (64, 96, 128, 256), (113, 256, 1024),
                                                     ((0, 0), (1, 0)), (None, 0.3), (1.0, 3.0)):
    if (sq != 113 and amp == 3.0 and d not in (64, 128)) or (sq == 1024 and d == 96):
        continue
    if os.environ.get("PROBE_QUICK") == "1" and (sq == 1024 or d == 96):
        continue
    case = Case(b=1, sq=sq, sk=sq, hq=2, hkv=1, d=d, causal=True, window=win, dtype=dt, scale=scale)
    try:
        emit(case=str(case), amp=amp, scale=scale, default=default_path(case, amp))
    except Exception as e:
        emit(case=str(case), amp=amp, error=repr(e)[:300])
emit(phase="default done", s=time.time() - t0)
if os.environ.get("PROBE_QUICK") == "1":
    sys.exit(0)
for dt, d, win, amp in itertools.product((torch.float16, torch.bfloat16), (64, 128), ((0, 0), (1, 0)), (3.0,)):
    case = Case(b=1, sq=113, sk=113, hq=2, hkv=1, d=d, causal=True, window=win, dtype=dt)
    try:
        emit(case=str(case), amp=amp, configs=per_config(case, amp))
    except Exception as e:
        emit(case=str(case), amp=amp, error=repr(e)[:300])
# window (0, 0) at amp 1: per-config backward too
for dt, d in itertools.product((torch.bfloat16,), (64, 128)):
    case = Case(b=1, sq=256, sk=256, hq=2, hkv=1, d=d, causal=True, window=(0, 0), dtype=dt)
    emit(case=str(case), amp=1.0, configs=per_config(case, 1.0))
emit(phase="all done", s=time.time() - t0)

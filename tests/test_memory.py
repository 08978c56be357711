"""Linear memory: `blockwise` forward AND backward at S = 65536 (an S x S float32 score matrix would be
16 GiB) must grow the peak RSS by less than 1.5 GiB.  Runs in a fresh subprocess so that the peak
belongs to this computation alone.  Causal halves the work so it fits the CPU tier's time budget."""
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_BYTES = int(1.5 * 2**30)

SCRIPT = textwrap.dedent("""
    import json, time
    import psutil, torch
    import flashport
    from flashport.backend.reference import reference_attention

    def vm_hwm():
        # This address space's peak RSS.  Not getrusage's ru_maxrss: the kernel carries that across exec,
        # so it starts at the peak of the (vforked) pytest worker that launched this process.
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

    S, H, D, TAIL = 65536, 1, 64, 4
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, S, H, D, generator=g) for _ in range(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    before = psutil.Process().memory_info().rss
    t0 = time.time()
    out = flashport.attention(q, k, v, causal=True, backend="blockwise")
    out.backward(do)
    seconds = time.time() - t0
    peak = vm_hwm()

    # The last TAIL rows see every key: check them (and their dq) against the materialised reference.
    qt = q.detach()[:, -TAIL:].clone().requires_grad_()
    ref = reference_attention(qt, k.detach(), v.detach(), causal=True)
    (ref_dq,) = torch.autograd.grad(ref, qt, do[:, -TAIL:])
    err_out = (out.detach()[:, -TAIL:] - ref).abs().max().item()
    err_dq = (q.grad[:, -TAIL:] - ref_dq).abs().max().item()
    finite = all(bool(torch.isfinite(t).all()) for t in (out, q.grad, k.grad, v.grad))
    print(json.dumps(dict(growth=peak - before, seconds=seconds, err_out=err_out, err_dq=err_dq, finite=finite)))
""")


def test_blockwise_fwd_bwd_memory_is_linear_at_64k():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    # Use every core, but let OpenMP threads sleep rather than spin when another process (an xdist
    # worker) holds a core: spinning barriers make a contended run many times slower.
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    assert res["finite"]
    assert res["growth"] < LIMIT_BYTES, f"peak RSS grew by {res['growth'] / 2**30:.2f} GiB"
    assert res["err_out"] < 1e-4 and res["err_dq"] < 1e-3, res

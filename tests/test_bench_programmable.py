"""The `programmable` bench suite's cases and mappings, on a CPU: for every quick case, the implementations that
run on a CPU (flashport with its mods, the built-in equivalent, SDPA with the mask materialised) compute the same
attention, so the suite's GPU ratios compare like with like; and the report writes its table and PNG."""
import pytest
import torch

from flashport.bench import programmable
from flashport.bench.report import document


@pytest.mark.parametrize("index", range(len(programmable.cases(torch.device("cpu"), quick=True))))
def test_cpu_implementations_agree(index):
    case = programmable.cases(torch.device("cpu"), quick=True)[index]
    g = torch.Generator().manual_seed(index)
    q, k, v = (torch.randn(case.b, case.s, case.h, case.d, generator=g) * 0.5 for _ in range(3))
    outs = {}
    for impl in ("flashport", "builtin", "sdpa-mask"):
        try:
            fn = programmable.implementation(impl, case, q, k, v)
        except programmable.NotServed:
            continue
        with torch.no_grad():
            outs[impl] = fn(q, k, v).float()
    import flashport
    bm = None if case.mask_mod is None else flashport.create_block_mask(case.mask_mod, None, None, case.s, case.s)
    with torch.no_grad():   # the float64-exact reference with the same mods
        outs["reference"] = flashport.attention(q, k, v, score_mod=case.score_mod, block_mask=bm,
                                                attn_bias=case.bias, backend="reference").float()
    assert "flashport" in outs and len(outs) >= 2
    for impl, out in outs.items():
        torch.testing.assert_close(out, outs["flashport"], rtol=0, atol=2e-5, msg=f"{case.name}: {impl}")
    frac = programmable.visible_pairs(case, torch.device("cpu")) / case.s ** 2
    assert 0 < frac <= 1


def test_report(tmp_path):
    entries = [dict(suite="programmable", label=f"c{n} b2 s64 h4 d128", shape={}, impl=i, mode=m, status="ok",
                    ms=1.0 + n, tflops=100.0 / (1 + n)) for n in range(2) for i in ("flashport", "flex")
               for m in ("fwd", "bwd")]
    entries.append(dict(suite="programmable", label="c2 b2 s64 h4 d128", shape={}, impl="fa4", mode="fwd",
                        status="n/a", error="no FA4 built-in equal to this mask"))
    programmable._ratios(entries)
    assert entries[0]["vs"]["flex"] == 1.0
    doc = document("programmable", torch.device("cpu"), entries)
    programmable.plot(doc, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "no FA4 built-in" in programmable.table(entries)


def test_triton_column_serves_every_case():
    cases = programmable.cases(torch.device("cpu"), quick=True)
    q = torch.zeros(1, 8, 1, 16)
    for case in cases:
        assert callable(programmable.implementation("flashport-triton", case, q, q, q))
    assert "flashport-triton" in programmable.DEFAULT_IMPLS


def test_run_suite_records_which_backends_served_flashport(monkeypatch):
    """run_suite's rows (timed on the CPU with a stand-in timer): flashport's cells say which backends ran one
    training step (a rewritten call's built-in calls included); a peer's cells carry none."""
    import time

    from flashport.bench import timing

    def cpu_ms(fn, *a, **kw):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    monkeypatch.setattr(timing, "gpu_ms", cpu_ms)
    rows = programmable.run_suite(torch.device("cpu"), True, ("flashport", "builtin"), match="prefix-lm")
    fwd = {r["impl"]: r for r in rows if r["mode"] == "fwd" and r["status"] == "ok"}
    assert set(fwd) == {"flashport"}   # builtin: no built-in equals prefix-LM
    served = fwd["flashport"]["served_by"]
    assert served and sum(c["forward"] for c in served.values()) == 2   # the prefix split: two built-in calls
    assert all(c["backward"] >= 1 for c in served.values())

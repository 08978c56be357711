"""The programmable calls under the fuzzer (flashport/fuzz/mods.py): random mods from flashport.mods, block
masks, attn_bias shapes and GQA over odd shapes, on blockwise against the float64 reference."""
import collections

import pytest

from flashport.fuzz import mods as fuzz_mods

SEED = 20261206


def test_the_draw_is_a_pure_function_of_seed_and_index():
    assert fuzz_mods.draw(SEED, 3) == fuzz_mods.draw(SEED, 3)
    assert fuzz_mods.draw(SEED, 3) != fuzz_mods.draw(SEED, 4)


def test_blockwise_passes_150_fuzzed_programmable_calls():
    cases = [fuzz_mods.draw(SEED, i) for i in range(150)]
    seen = collections.Counter((c["mask"], c["score"] != "none", c["bias"] != "none") for c in cases)
    assert len({m for m, _, _ in seen}) == len(fuzz_mods.ALL_MASKS)   # every mask kind drawn
    failed = []
    for c in cases:
        r = fuzz_mods.run(c, "blockwise", "cpu")
        if r["status"] != "PASS":
            failed.append((c["seed"], c["index"], r["problems"]))
    assert not failed, f"replay with flashport.fuzz.mods.run(draw(seed, index)): {failed[:5]}"


def test_auto_passes_fuzzed_programmable_calls():
    # backend=None: auto's choice per case (sdpa-cpu where it serves the mods, else blockwise) after its input check
    failed = []
    for i in range(40):
        c = fuzz_mods.draw(SEED, i)
        r = fuzz_mods.run(c, None, "cpu")
        if r["status"] != "PASS":
            failed.append((c["seed"], c["index"], r["problems"]))
    assert not failed, failed[:5]


def test_the_fuzzer_catches_a_wrong_bias_gradient(monkeypatch):
    """A defect in the chain through the mods (a gradient 1% off) must fail the rule: the check can fail."""
    from flashport.backend import blockwise
    real = blockwise._through_mods

    def off(prog, pre, ds, grads):
        out = real(prog, pre, ds, grads)
        for n, g in enumerate(grads):
            grads[n] = None if g is None else g * 1.01
        return out
    monkeypatch.setattr(blockwise, "_through_mods", off)
    c = dict(fuzz_mods.draw(SEED, 0), sq=40, sk=40, dtype="float32", bias="full", grad_bias=True, score="none")
    assert fuzz_mods.run(c, "blockwise", "cpu")["status"] == "FAIL"


def test_the_fuzzer_catches_a_memo_that_keeps_a_stale_window(monkeypatch):
    """A stateful lambda case (its window changed in place after a first call) must fail when the band reader's
    memo matches mods by identity, as it did before mod_state, and pass as shipped."""
    from flashport import mask_rules
    c = dict(fuzz_mods.draw(SEED, 0), mask="lambda", lam="window", stateful=True, block=False, sq=40, sk=40,
             window=5, causal=False, score="none", bias="none", dtype="float32")
    assert fuzz_mods.run(c, None, "cpu")["status"] == "PASS"
    monkeypatch.setattr(mask_rules, "_memo", type(mask_rules._memo)())
    monkeypatch.setattr(mask_rules, "same", lambda a, b: len(a) == len(b) and all(x is y for x, y in zip(a, b)))
    monkeypatch.setattr(mask_rules, "fingerprint", lambda fn: (fn.__code__, *(x.cell_contents for x in fn.__closure__)))
    assert fuzz_mods.run(c, None, "cpu")["status"] == "FAIL"


def test_a_case_that_raises_is_a_fail_naming_the_error(monkeypatch):
    """A backend that raises (not a declared refusal) is one FAIL with the error's name, and the run goes on: in
    the 21st session's GPU tier an exception out of one flex case ended the whole test unnamed."""
    from flashport.backend import blockwise

    def broken(*a, **k):
        raise RuntimeError("donated buffers")
    monkeypatch.setattr(blockwise.BlockwiseBackend, "forward", broken)
    r = fuzz_mods.run(dict(fuzz_mods.draw(SEED, 0), sq=16, sk=16), "blockwise", "cpu")
    assert r["status"] == "FAIL" and "RuntimeError: donated buffers" in r["problems"][0]


def test_a_refusal_outside_the_call_is_a_skip(monkeypatch):
    """An UnsupportedError raised anywhere in the case (here by the block mask's construction) is a declared refusal,
    a SKIP, not a FAIL."""
    import flashport

    def refuse(*a, **k):
        raise flashport.UnsupportedError("pretend: no block masks here")
    monkeypatch.setattr(flashport, "create_block_mask", refuse)
    c = next(c for c in (fuzz_mods.draw(SEED, i) for i in range(200)) if c["block"] and c["mask"] != "none")
    assert fuzz_mods.run(c, "blockwise", "cpu")["status"] == "SKIP"


def test_a_backend_is_fuzzed_on_the_features_it_declares():
    """A backend's cases turn off what it does not declare (else they would SKIP): sdpa-cpu computes no gradient into a
    captured table; triton and blockwise declare every feature and keep every drawn case."""
    cases = [fuzz_mods.draw(SEED, i) for i in range(40)]
    assert any(c["bias"] != "none" for c in cases) and any(c["grad_table"] for c in cases)
    for c in cases:
        t = fuzz_mods.served(c, "sdpa-cpu")
        assert not t["grad_table"]
        assert {k: v for k, v in t.items() if k != "grad_table"} == {k: v for k, v in c.items() if k != "grad_table"}
        assert fuzz_mods.served(c, "triton") == c
        assert fuzz_mods.served(c, "blockwise") == c

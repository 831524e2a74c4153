"""attnopt_dnas / attnopt_sinkhorn / attnopt_hnas in Hugging Face causal decoders do not leak the future.

Random small GPT-2 and Llama (grouped-query attention: 4 query heads, 2 KV heads) configs built
with ``_from_config`` (nothing downloaded): changing a later token leaves every earlier position
bit for bit; cached step-by-step decoding (also of a left-padded batch) gives the full forward;
``attnopt_causal="plan"`` keeps the masked plan, which does leak; a cache attnopt cannot follow
is refused, not silently misread.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel  # noqa: E402

from attnopt.integrations import hf  # noqa: E402
from attnopt.integrations._hf_prefix import STATE  # noqa: E402

NAMES = ["attnopt_dnas", "attnopt_sinkhorn", "attnopt_hnas"]
CONFIGS = {
    "gpt2": (GPT2Model, GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=32,
                                   bos_token_id=0, eos_token_id=0, attn_pdrop=0.0)),
    "llama-gqa": (LlamaModel, LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                          max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                          pad_token_id=0)),
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()


def _model(arch, name):
    cls, cfg = CONFIGS[arch]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls._from_config(copy.deepcopy(cfg), attn_implementation=name).double().eval()


def _ids(n=10, seed=0):
    return torch.randint(1, 50, (2, n), generator=torch.Generator().manual_seed(seed))


def _decode(model, ids, mask=None, prefill=4):
    """Prefill ``prefill`` tokens, then one token per step through the KV cache."""
    with torch.no_grad():
        kw = {} if mask is None else {"attention_mask": mask[:, :prefill]}
        out = model(input_ids=ids[:, :prefill], use_cache=True, **kw)
        states, cache = [out.last_hidden_state], out.past_key_values
        for t in range(prefill, ids.shape[1]):
            kw = {} if mask is None else {"attention_mask": mask[:, : t + 1]}
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True, **kw)
            states.append(out.last_hidden_state)
            cache = out.past_key_values
    return torch.cat(states, dim=1)


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("name", NAMES)
def test_later_token_changes_no_earlier_position_and_plan_still_leaks(arch, name):
    m = _model(arch, name)
    ids = _ids()
    ids2 = ids.clone()
    ids2[:, 7:] = (ids[:, 7:] + 5) % 49 + 1
    with torch.no_grad():
        a, b = m(input_ids=ids).last_hidden_state, m(input_ids=ids2).last_hidden_state
        pa = m(input_ids=ids, attnopt_causal="plan").last_hidden_state
        pb = m(input_ids=ids2, attnopt_causal="plan").last_hidden_state
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.equal(a[:, 7:], b[:, 7:])
    assert (pa[:, :7] - pb[:, :7]).abs().max() > 1e-6  # the masked plan: earlier positions read later ones


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("name", NAMES)
def test_cached_decoding_equals_the_full_forward(arch, name):
    m = _model(arch, name)
    ids = _ids(seed=1)
    with torch.no_grad():
        full = m(input_ids=ids).last_hidden_state
    torch.testing.assert_close(_decode(m, ids), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_cached_decoding_of_a_left_padded_batch_equals_the_full_forward(arch):
    m = _model(arch, "attnopt_dnas")
    ids = _ids(seed=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the second sequence starts at position 3
    ids[1, :3] = 0
    with torch.no_grad():
        full = m(input_ids=ids, attention_mask=mask).last_hidden_state
        # the padded sequence alone, at the positions it has in the padded batch
        alone = m(input_ids=ids[1:, 3:], position_ids=torch.arange(3, ids.shape[1])[None]).last_hidden_state
    dec = _decode(m, ids, mask, prefill=5)
    torch.testing.assert_close(dec[:, 3:], full[:, 3:], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(full[1:, 3:], alone, rtol=1e-9, atol=1e-10)  # padding takes no part


def test_a_cache_attnopt_cannot_follow_is_refused():
    m = _model("llama-gqa", "attnopt_dnas")
    ids, other = _ids(seed=3), _ids(seed=4)
    with torch.no_grad():
        cache = m(input_ids=ids[:, :5], use_cache=True).past_key_values
        m(input_ids=other[:, :5])  # another sequence: the modules now hold its queries
        with pytest.raises(ValueError, match="use_cache=False.*attnopt_causal='plan'"):
            m(input_ids=ids[:, 5:6], past_key_values=cache, use_cache=True)
        # reordering the batch (as beam search does) is refused too
        cache = m(input_ids=ids[:, :5], use_cache=True).past_key_values
        cache.reorder_cache(torch.tensor([1, 0]))
        with pytest.raises(ValueError, match="needs the queries of the 5 cached positions"):
            m(input_ids=ids[:, 5:6], past_key_values=cache, use_cache=True)
    # the masked plan asks for nothing of the past
    with torch.no_grad():
        cache = m(input_ids=ids[:, :5], use_cache=True).past_key_values
        out = m(input_ids=ids[:, 5:6], past_key_values=cache, use_cache=True, attnopt_causal="plan")
    assert torch.isfinite(out.last_hidden_state).all()


def test_training_forward_keeps_no_state_and_register_option():
    m = _model("gpt2", "attnopt_hnas")
    ids = _ids()
    m.train()
    m(input_ids=ids).last_hidden_state.sum().backward()
    assert all(getattr(mod, STATE, None) is None for mod in m.modules())
    with pytest.raises(ValueError, match="causal must be"):
        hf.register(dn_causal="strict")
    hf.register(dn_causal="plan")
    try:
        m.eval()
        ids2 = ids.clone()
        ids2[:, -1] = (ids[:, -1] + 1) % 49 + 1
        with torch.no_grad():
            a, b = m(input_ids=ids).last_hidden_state, m(input_ids=ids2).last_hidden_state
        assert not torch.equal(a[:, :-1], b[:, :-1])  # the registered default is now the masked plan
    finally:
        hf.register()


def test_encoder_is_unaffected():
    from attnopt.functional import doubly_normalized_attention
    from tests.reference.hf_tiny import tiny_bert

    m = tiny_bert(attn="attnopt_dnas")
    att = hf.attention_modules(m)[0][1]
    assert not getattr(att, "is_causal", False)
    calls = []
    orig = doubly_normalized_attention

    def spy(*a, **kw):
        calls.append(kw.get("causal"))
        return orig(*a, **kw)

    import attnopt.functional as AF
    mp = pytest.MonkeyPatch()
    mp.setattr(AF, "doubly_normalized_attention", spy)
    try:
        hf.register()
        with torch.no_grad():
            m(input_ids=_ids())
    finally:
        mp.undo()
        hf.register()
    assert calls and set(calls) == {"plan"}  # the ordinary mechanism; no causal mask in an encoder


@pytest.mark.parametrize("name", [NAMES[0]] + [pytest.param(n, marks=pytest.mark.slow) for n in NAMES[1:]])
def test_generate_with_cache_equals_generate_without(name):
    """Greedy generation through the KV cache (the modules' kept queries) = recomputing every prefix.

    Sinkhorn and HNAS: ``pytest -m slow``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = LlamaForCausalLM._from_config(copy.deepcopy(CONFIGS["llama-gqa"][1]),
                                          attn_implementation=name).double().eval()
        ids = _ids(6, seed=5)
        kw = {"max_new_tokens": 5, "do_sample": False, "output_scores": True, "return_dict_in_generate": True,
              "pad_token_id": 0}
        cached = m.generate(ids, use_cache=True, **kw)
        fresh = m.generate(ids, use_cache=False, **kw)
    assert torch.equal(cached.sequences, fresh.sequences)
    for a, b in zip(cached.scores, fresh.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)

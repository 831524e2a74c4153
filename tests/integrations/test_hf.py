"""Hugging Face AttentionInterface integration: equality with eager attention, masks honoured."""
import pytest
import torch

from attnopt.integrations import hf
from tests.reference.hf_tiny import padded_batch, tiny_bert, tiny_t5

NAMES = [m.name for m in hf.MECHANISMS]


@pytest.fixture(scope="module")
def registered():
    report = hf.register()
    return report


def _hidden(model, ids, mask, **kw):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **kw).last_hidden_state


def test_register_reports_every_mechanism(registered):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert registered.registered == NAMES and registered.missing == {}
    for name in NAMES:  # each attention comes with its mask function
        assert name in AttentionInterface._global_mapping and name in AttentionMaskInterface._global_mapping
    assert hf.registered_names() == NAMES


def test_missing_mechanism_is_reported_not_raised(monkeypatch):
    bogus = hf.Mechanism("attnopt_nothing", "attnopt.functional:no_such_attention")
    monkeypatch.setattr(hf, "MECHANISMS", (*hf.MECHANISMS[:1], bogus))
    report = hf.register()
    assert report.registered == ["attnopt_generalized"] and "attnopt_nothing" in report.missing


@pytest.mark.parametrize("name,kw", [
    ("attnopt_generalized", {}),
    ("attnopt_dnas", {"attnopt_iterations": 0}),
    ("attnopt_sinkhorn", {"attnopt_iterations": 0}),
    ("attnopt_hnas", {"attnopt_weight": 0.0}),
])
def test_equals_eager_where_it_should(registered, name, kw):
    model = tiny_bert(init_range=0.2)  # peaked attention, so that the mechanisms differ
    ids, mask = padded_batch()
    ref = _hidden(model, ids, mask)
    model.set_attn_implementation(name)
    out = _hidden(model, ids, mask, **kw)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=2e-5, rtol=1e-4)
    if name != "attnopt_generalized":  # the default options really change the model
        assert (_hidden(model, ids, mask)[real] - ref[real]).abs().max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_equals_unpadded_runs(registered, name):
    model = tiny_bert(attn=name)
    ids, mask = padded_batch(3)
    out = _hidden(model, ids, mask)
    single = _hidden(model, ids[1:, :5], mask[1:, :5])
    torch.testing.assert_close(out[1, :5], single[0], atol=2e-5, rtol=1e-4)
    assert torch.isfinite(out).all()


def test_t5_generalized_uses_position_bias_as_preference(registered):
    model = tiny_t5()
    ids, mask = padded_batch(4)
    dec = ids[:, :5]
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        model.set_attn_implementation("attnopt_generalized")
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        model.set_attn_implementation("attnopt_dnas")
        dn0 = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, attnopt_iterations=0).logits
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(dn0, ref, atol=2e-5, rtol=1e-4)


def test_from_pretrained_and_embedding_shift(registered, tmp_path):
    from transformers import AutoModel

    tiny_bert(init_range=0.2).save_pretrained(tmp_path)
    model = AutoModel.from_pretrained(tmp_path, attn_implementation="attnopt_dnas").eval()
    assert model.config._attn_implementation == "attnopt_dnas"
    ids, mask = padded_batch(5)
    model.set_attn_implementation("eager")
    same = hf.embedding_shift(model, ids, mask, "attnopt_generalized")
    moved = hf.embedding_shift(model, ids, mask, "attnopt_sparsemax")
    torch.testing.assert_close(same, torch.ones(2), atol=1e-5, rtol=0)
    assert float(moved.min()) < 0.9999 and model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="unknown attention"):
        hf.embedding_shift(model, ids, mask, "no_such_attention")


def test_dropout_in_training_is_refused_and_bad_options(registered):
    model = tiny_bert(attn="attnopt_dnas").train()
    model.config.attention_probs_dropout_prob = 0.1
    for layer in model.encoder.layer:
        layer.attention.self.dropout.p = 0.1
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="hnas_weight"):
        hf.register(hnas_weight=2.0)
    with pytest.raises(ValueError, match="entmax_alpha"):
        hf.register(entmax_alpha=0.0)


def test_hf_names_are_registry_names() -> None:
    from attnopt.nn import attention_names

    reg = set(attention_names())
    for name in NAMES:
        assert name == "attnopt_generalized" or name.removeprefix("attnopt_") in reg, name

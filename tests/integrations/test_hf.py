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


def _train_with_attention_dropout(model, p: float):
    """train() with dropout ``p`` on the attention weights only (hidden dropout off)."""
    model.train()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    for _, m in hf.attention_modules(model):
        m.dropout.p = p  # BertSelfAttention passes dropout=self.dropout.p if training
    return model


@pytest.mark.parametrize("name", NAMES)
def test_fine_tuning_with_attention_dropout(registered, name):
    """Every name trains with attention dropout: random in train(), deterministic without it."""
    ids, mask = padded_batch()
    real = mask.bool()
    model = _train_with_attention_dropout(tiny_bert(attn=name, init_range=0.2), 0.0)
    plain = model(input_ids=ids, attention_mask=mask).last_hidden_state[real]
    torch.testing.assert_close(plain, _hidden(model.eval(), ids, mask)[real])
    _train_with_attention_dropout(model, 0.3)
    torch.manual_seed(0)
    a = model(input_ids=ids, attention_mask=mask).last_hidden_state[real]
    torch.manual_seed(0)
    b = model(input_ids=ids, attention_mask=mask).last_hidden_state[real]
    torch.testing.assert_close(a, b)  # the same seed, the same draw
    assert (a - plain).abs().max() > 1e-3  # dropout acted
    a.square().sum().backward()
    assert all(p.grad is not None for p in model.encoder.layer[0].attention.self.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_attention_function_passes_dropout(registered, name):
    """The registered function with ``dropout=p`` is its functional op with ``dropout_p=p``."""
    from transformers import AttentionInterface

    fn = AttentionInterface._global_mapping[name]
    model = tiny_bert(attn=name)
    module = hf.attention_modules(model)[0][1]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    torch.manual_seed(5)
    out, _ = fn(module, q, k, v, None, scaling=0.3, dropout=0.4)
    torch.manual_seed(5)
    again, _ = fn(module, q, k, v, None, scaling=0.3, dropout=0.4)
    clean, _ = fn(module, q, k, v, None, scaling=0.3, dropout=0.0)
    torch.testing.assert_close(out, again)
    assert (out - clean).abs().max() > 1e-3
    # the mean over many draws is the output without dropout (E[out] = π v)
    qs, ks, vs = (x[:1].expand(800, -1, -1, -1) for x in (q, k, v))
    many, _ = fn(module, qs, ks, vs, None, scaling=0.3, dropout=0.4)
    err = (many.mean(0) - clean[0]).abs()
    assert bool((err <= 5 * many.std(0) / 800**0.5 + 1e-6).all())


def test_misspelled_attnopt_keyword_is_refused(registered):
    model = tiny_bert(attn="attnopt_dnas")
    ids, mask = padded_batch()
    with pytest.raises(TypeError, match=r"attnopt_iteratons.*attnopt_iterations"):
        model(input_ids=ids, attention_mask=mask, attnopt_iteratons=0)
    model.set_attn_implementation("attnopt_sparsemax")
    with pytest.raises(TypeError, match=r"attnopt_iterations.*keywords for attnopt_sparsemax: none"):
        model(input_ids=ids, attention_mask=mask, attnopt_iterations=0)
    model.set_attn_implementation("attnopt_entmax")  # a valid keyword and HF's own pass
    out = _hidden(model, ids, mask, attnopt_alpha=2.0, output_attentions=False)
    assert torch.isfinite(out).all()


def test_bad_register_options():
    with pytest.raises(ValueError, match="hnas_weight"):
        hf.register(hnas_weight=2.0)
    with pytest.raises(ValueError, match="entmax_alpha"):
        hf.register(entmax_alpha=0.0)


def test_hf_names_are_registry_names() -> None:
    from attnopt.nn import attention_names

    reg = set(attention_names())
    for name in NAMES:
        assert name == "attnopt_generalized" or name.removeprefix("attnopt_") in reg, name


def test_learned_hnas_weight_per_layer(registered):
    """add_hnas_weights: one trained u_l per layer, equal to the fixed-weight HNAS at the same u."""
    from attnopt.experiments._diagnostics import hnas_weights

    model = tiny_bert(init_range=0.2, layers=3)
    ids, mask = padded_batch()
    real = mask.bool()
    ws = hf.add_hnas_weights(model, init_weight=0.3)
    assert len(ws) == 3 and model.config._attn_implementation == "attnopt_hnas"
    assert all(abs(float(w.mixing_weight) - 0.3) < 1e-6 for w in ws)
    assert sum(k.endswith("attnopt_hnas_weight.weight_logit") for k in model.state_dict()) == 3
    learned = _hidden(model, ids, mask)
    fixed = _hidden(model, ids, mask, attnopt_weight=0.3)
    torch.testing.assert_close(learned[real], fixed[real])  # with u attached the layer's u is used
    with torch.no_grad():  # a different u per layer really changes the output
        ws[1].weight_logit.fill_(3.0)
    assert (_hidden(model, ids, mask)[real] - learned[real]).abs().max() > 1e-3
    # trained with the model: every u gets a gradient and moves after one optimizer step
    model.train()
    for _, m in hf.attention_modules(model):
        m.dropout.p = 0.0  # deterministic: the gradient check below compares one draw
    params = [p for n, p in model.named_parameters() if n.endswith("weight_logit")]
    assert len(params) == 3
    before = [float(p.detach()) for p in params]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state[real]
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    ((out - target) ** 2).sum().backward()
    assert all(p.grad is not None and float(p.grad.abs()) > 0 for p in params)
    opt.step()
    after = hnas_weights(model)
    assert list(after) == ["hnas_w/0", "hnas_w/1", "hnas_w/2"]
    assert all(0 < v < 1 for v in after.values())
    assert all(float(p.detach()) != b for p, b in zip(params, before))
    assert hf.add_hnas_weights(model) == ws  # idempotent: the trained weights are kept


def test_add_hnas_weights_bad_input():
    with pytest.raises(ValueError, match="no attention modules"):
        hf.add_hnas_weights(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="init_weight"):
        hf.HNASWeight(1.0)

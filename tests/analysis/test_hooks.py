"""Hooks capture the tensors each attention layer really used (BERT and T5, random init)."""
import pytest
import torch
from torch import nn

from attnopt.analysis.hooks import capture_attention, find_attention_sites, to_additive_mask
from attnopt.analysis.pretrained import model_inputs
from tests.reference.hf_tiny import padded_batch, tiny_bert, tiny_t5


def _run(model, ids, mask, **kw):
    with capture_attention(model, **kw) as cap, torch.no_grad():
        out = model(**model_inputs(model, ids, mask))
    return cap, out


def test_bert_sites_and_rebuilt_outputs():
    model = tiny_bert()
    ids, mask = padded_batch()
    cap, _ = _run(model, ids, mask)
    assert [r.site.name for r in cap.records] == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    for rec in cap.records:
        assert rec.site.kind == "self" and rec.q.shape == (2, 4, 7, 8)
        lin = rec.site.projection("query")
        q_again = lin(rec.x_query).reshape(2, 7, 4, 8).transpose(1, 2)
        torch.testing.assert_close(q_again, rec.q)
        # the module's own output is rebuilt from captured q, k, v and mask
        torch.testing.assert_close(rec.rebuild_output(), rec.output, atol=1e-6, rtol=1e-5)
        # padding keys are excluded with -inf, real keys get 0
        assert torch.isinf(rec.attn_mask[1, 0, :, 5:]).all() and (rec.attn_mask[0] == 0).all()
        assert rec.weights is not None and rec.weights[1, :, :, 5:].abs().max() == 0


def test_capture_matches_output_attentions_and_restores_sdpa():
    model = tiny_bert(attn="sdpa")
    ids, mask = padded_batch(1)
    cap, out = _run(model, ids, mask)
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    for rec, w in zip(cap.records, ref):
        torch.testing.assert_close(rec.weights, w)


def test_t5_all_three_kinds_with_position_bias():
    model = tiny_t5()
    ids, mask = padded_batch(2)
    cap, _ = _run(model, ids, mask)
    kinds = [r.site.kind for r in cap.records]
    assert kinds.count("self") == 2 and kinds.count("decoder_self") == 2 and kinds.count("cross") == 2
    for rec in cap.records:
        assert rec.site.scaling == 1.0 and rec.position_bias is not None
        torch.testing.assert_close(rec.rebuild_output(), rec.output, atol=1e-6, rtol=1e-5)
        if rec.site.kind == "cross":
            assert rec.x_key.shape[1] == 7 and (rec.position_bias == 0).all()
        else:  # relative position bias: depends on j - i only
            pb = rec.position_bias[0, 0]
            assert torch.allclose(pb.diagonal(1), pb.diagonal(1)[:1].expand_as(pb.diagonal(1)))
            assert pb.std() > 0


def test_hooks_are_removed_and_sites_can_be_selected():
    model = tiny_bert()
    ids, mask = padded_batch()
    sites = find_attention_sites(model)[1:]
    cap, _ = _run(model, ids, mask, sites=sites)
    assert len(cap.records) == 1 and cap.records[0].site.layer == 1
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert len(cap.records) == 1


def test_unsupported_model_and_masks():
    with pytest.raises(ValueError, match="no supported attention"):
        find_attention_sites(nn.Sequential(nn.Linear(3, 3)))
    m = to_additive_mask(torch.tensor([[True, False]]))
    assert m[0, 0] == 0 and torch.isneginf(m[0, 1])
    f = to_additive_mask(torch.tensor([[0.0, torch.finfo(torch.float32).min, -1.0]]))
    assert f[0, 0] == 0 and torch.isneginf(f[0, 1]) and f[0, 2] == -1.0
    with pytest.raises(TypeError):
        to_additive_mask(torch.tensor([[1, 0]]))


@pytest.mark.parametrize("family", ["distilbert", "roberta"])
def test_other_bert_family_adapters(family):
    from transformers import DistilBertConfig, DistilBertModel, RobertaConfig, RobertaModel

    from attnopt.analysis.dual_deviation import dual_deviation, map_captured

    torch.manual_seed(0)
    if family == "distilbert":
        cfg = DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=37, vocab_size=99,
                               attn_implementation="eager")
        model = DistilBertModel(cfg).eval()
    else:
        cfg = RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                            vocab_size=99, attn_implementation="eager")
        model = RobertaModel(cfg).eval()
    ids, mask = padded_batch(4)
    cap, _ = _run(model, ids, mask)
    expected = "distilbert" if family == "distilbert" else "bert"
    assert len(cap.records) == 2 and cap.records[0].site.adapter.name == expected
    for rec in cap.records:
        torch.testing.assert_close(rec.rebuild_output(), rec.output, atol=1e-6, rtol=1e-5)
        dev = dual_deviation(map_captured(rec, query_mask=mask.bool()), model_weights=rec.weights)
        assert dev.reconstruction_ok and dev.converged

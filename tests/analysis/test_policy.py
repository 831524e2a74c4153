"""Tests of attnopt.analysis.policy (Thm 5.2, Thm 7.3, Cor. 7.5)."""
from __future__ import annotations

import pytest
import torch

from attnopt.analysis.policy import (
    advantages,
    fisher_matrix,
    logsumexp_hessian,
    natural_gradient_form,
    policy_gradient,
    policy_probe,
    policy_view,
)


def _layer(tau=1.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64)
    s = q @ k.transpose(-2, -1)
    mask = torch.zeros(5, 6, dtype=torch.float64)
    mask[:, -1] = float("-inf")
    p = torch.softmax(s / tau + mask, -1)
    loss = torch.tanh(p @ v).pow(2).sum()
    return s, p, loss


@pytest.mark.parametrize("tau", [1.0, 1.7, 0.3])
def test_theorems_match_autograd(tau):
    s, p, loss = _layer(tau)
    view = policy_view(s, p, loss, temperature=tau)
    assert view.thm52_rel_err < 1e-12 and view.thm73_rel_err < 1e-12
    assert view.score_grad.abs().max() > 1e-3  # not trivially zero
    baseline = (view.weights * view.advantages).sum(-1)
    torch.testing.assert_close(baseline, torch.zeros(2, 3, 5, dtype=torch.float64))
    assert (view.score_grad[..., -1] == 0).all()


def test_wrong_temperature_is_detected():
    s, p, loss = _layer(1.7)
    assert policy_view(s, p, loss, temperature=1.0).thm52_rel_err > 0.1


def test_fisher_properties_and_hessian_corollary():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 7, generator=g, dtype=torch.float64) * 2
    tau = 0.8
    p = torch.softmax(s / tau, -1)
    f = fisher_matrix(p, temperature=tau)
    torch.testing.assert_close(f, f.transpose(-2, -1))
    assert (torch.linalg.eigvalsh(f) > -1e-12).all()
    torch.testing.assert_close(f.sum(-1), torch.zeros(4, 7, dtype=torch.float64))
    torch.testing.assert_close(logsumexp_hessian(s, temperature=tau), tau * f, atol=1e-12, rtol=0)
    u = torch.randn(4, 7, generator=g, dtype=torch.float64)
    natural = natural_gradient_form(p, u, temperature=tau)
    torch.testing.assert_close(natural, policy_gradient(p, u, temperature=tau))
    torch.testing.assert_close(advantages(p, u + 3.0), advantages(p, u))


def test_policy_probe_on_tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).double().eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, -2:] = 0
    with policy_probe(model) as records:
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        loss = out.pow(2).mean()
    assert len(records) == 2
    for r in records:
        assert r.temperature == pytest.approx(8 ** 0.5)
        view = policy_view(r.scores, r.weights, loss, temperature=r.temperature)
        assert view.thm52_rel_err < 1e-10 and view.thm73_rel_err < 1e-10
        assert (view.weights[1, :, :, -2:] == 0).all()
    assert model.config._attn_implementation != "attnopt_policy_probe"


def test_bad_inputs():
    s, p, loss = _layer()
    with pytest.raises(ValueError, match="match"):
        policy_view(s, p[..., :3], loss)
    with pytest.raises(ValueError, match="scalar"):
        policy_view(s, p, torch.ones(2))
    with pytest.raises(ValueError, match="temperature"):
        fisher_matrix(p, temperature=0.0)

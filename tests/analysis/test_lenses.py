"""Per-head lenses: entropy, effective support, column mass / explaining away, Prop. 1 split."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnopt.analysis.lenses import attention_entropy, effective_support, head_lenses, similarity_magnitude
from attnopt.functional import doubly_normalized_weights


def test_entropy_and_support_extremes():
    uniform = torch.full((1, 1, 2, 5), 0.2, dtype=torch.float64)
    onehot = torch.zeros(1, 1, 2, 5, dtype=torch.float64)
    onehot[..., 2] = 1
    expected = torch.full((1, 1, 2), math.log(5), dtype=torch.float64)
    torch.testing.assert_close(attention_entropy(uniform), expected)
    torch.testing.assert_close(effective_support(uniform), torch.full((1, 1, 2), 5.0, dtype=torch.float64))
    assert (attention_entropy(onehot) == 0).all() and (effective_support(onehot) == 1).all()
    half = onehot.half()
    assert torch.isfinite(attention_entropy(half)).all()


@settings(max_examples=20)
@given(seed=st.integers(0, 10_000))
def test_head_lenses_against_manual(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    w = torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1)
    lens = head_lenses(w, q, k, scale=0.5)
    mass = w.sum(-2)  # (B, H, Nk)
    torch.testing.assert_close(lens.column_mass_min, mass.amin((0, 2)))
    torch.testing.assert_close(lens.column_mass_mean, torch.ones(3, dtype=torch.float64))  # Nq == Nk
    torch.testing.assert_close(lens.explained_away, (mass < 1 / 5).double().mean((0, 2)))
    ent = -(w * w.log()).sum(-1)
    torch.testing.assert_close(lens.entropy, ent.mean((0, 2)))
    torch.testing.assert_close(lens.effective_support, ent.exp().mean((0, 2)))
    assert ((lens.magnitude_share >= 0) & (lens.magnitude_share <= 1)).all()
    # DNAS never explains a key away (Lemma 1): every column mass >= 1/Nk
    dn = doubly_normalized_weights(q, k, scale=0.5)
    assert float(head_lenses(dn, q, k, scale=0.5).explained_away.max()) == 0.0


def test_prop1_split_reproduces_logits_up_to_row_constant():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64)
    log_sim, log_mag = similarity_magnitude(q, k, scale=0.7)
    logits = 0.7 * q @ k.transpose(-1, -2)
    diff = logits - (log_sim + log_mag)  # = 0.7 ||q_i||^2 / 2, constant along each row
    torch.testing.assert_close(diff, (0.35 * q.pow(2).sum(-1, keepdim=True)).expand_as(diff))


def test_equal_key_norms_give_zero_magnitude_share_and_masks():
    q = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(1, 1, 4, 3, dtype=torch.float64), dim=-1)
    w = torch.softmax(q @ k.transpose(-1, -2), -1)
    assert float(head_lenses(w, q, k, scale=1.0).magnitude_share.max()) < 1e-12
    # a query mask removes rows; masked keys are excluded from mass statistics
    qm = torch.tensor([[True, True, False, False]])
    km = torch.tensor([[True, True, True, False]])
    lens = head_lenses(w, q, k, scale=1.0, query_mask=qm, key_mask=km)
    mass = w[0, 0, :2].sum(0)[:3]
    torch.testing.assert_close(lens.column_mass_min, mass.min().reshape(1))
    ent = -(w[0, 0, :2] * w[0, 0, :2].log()).sum(-1).mean()
    torch.testing.assert_close(lens.entropy, ent.reshape(1))


def test_bad_shapes_and_half_precision():
    w = torch.softmax(torch.randn(1, 2, 3, 4), -1)
    with pytest.raises(ValueError, match="do not match"):
        head_lenses(w, torch.randn(1, 2, 3, 5), torch.randn(1, 2, 5, 5), scale=1.0)
    q, k = torch.randn(1, 2, 3, 4).half(), torch.randn(1, 2, 4, 4).half()
    lens = head_lenses(w.half(), q, k, scale=0.5)
    assert all(torch.isfinite(getattr(lens, f)).all() for f in lens.__dataclass_fields__)

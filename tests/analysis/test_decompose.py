"""Prop. 1 and Prop. 2 decompositions: exact identities, logs, errors."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from attnopt.analysis.decompose import decompose, decompose_gat


def _qk(seed, b=2, h=3, nq=4, nk=5, d=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=dtype)
    return q, torch.randn(b, h, nk, d, generator=g, dtype=dtype)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_prop1_product_is_exp_score(scale):
    q, k = _qk(0)
    s = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    sim, mag = decompose(q, k, scale=scale)
    torch.testing.assert_close(sim * mag, torch.exp(s * q @ k.transpose(-1, -2)), rtol=1e-12, atol=0)
    assert (sim <= 1).all() and (sim > 0).all()


def test_prop1_similarity_is_rbf_and_weights_match_softmax():
    q, k = _qk(1)
    d = q.shape[-1]
    sim, mag = decompose(q, k)
    rbf = torch.exp(-torch.cdist(q, k).pow(2) / (2 * math.sqrt(d)))
    torch.testing.assert_close(sim, rbf)
    w = sim * mag
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    torch.testing.assert_close(w / w.sum(-1, keepdim=True), ref)


def test_log_mode_matches_and_does_not_overflow():
    q, k = _qk(2, dtype=torch.float32)
    q = q * 40
    ls, lm = decompose(q, k, log=True)
    assert torch.isfinite(ls).all() and torch.isfinite(lm).all()
    s = 1 / math.sqrt(q.shape[-1])
    torch.testing.assert_close(ls + lm, s * q @ k.transpose(-1, -2), rtol=1e-4, atol=1e-2)


def test_half_precision_returns_float32_without_nan():
    q, k = _qk(3, dtype=torch.float16)
    sim, mag = decompose(q, k)
    assert sim.dtype == torch.float32 and not torch.isnan(sim).any() and not torch.isnan(mag).any()


@given(st.integers(0, 10_000), st.floats(0.05, 0.9))
def test_prop2_gat_identity(seed, slope):
    g = torch.Generator().manual_seed(seed)
    xq = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    xk = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    att = torch.randn(2, 6, generator=g, dtype=torch.float64)
    sim, mag = decompose_gat(xq, xk, att, negative_slope=slope)
    raw = (xq @ att[:, :3].unsqueeze(-1)) + (xk @ att[:, 3:].unsqueeze(-1)).transpose(-1, -2)
    torch.testing.assert_close(sim * mag, torch.exp(F.leaky_relu(raw, slope)), rtol=1e-10, atol=0)


def test_prop2_similarity_terms_are_rbf_through_ca():
    g = torch.Generator().manual_seed(5)
    xq = torch.randn(3, 2, generator=g, dtype=torch.float64)
    xk = torch.randn(4, 2, generator=g, dtype=torch.float64)
    z = torch.zeros(2, dtype=torch.float64)
    att = torch.randn(4, generator=g, dtype=torch.float64)
    sim, _ = decompose_gat(xq, xk, att, negative_slope=0.2)
    for i in range(3):
        for j in range(4):
            qi, kj = torch.cat([xq[i], z]), torch.cat([z, xk[j]])
            c = 1.0 if att @ (qi + kj) >= 0 else 0.2
            ref = torch.exp(-(qi - c * att).pow(2).sum() / 2) * torch.exp(-(c * att - kj).pow(2).sum() / 2)
            torch.testing.assert_close(sim[i, j], ref)


def test_bad_inputs():
    q, k = _qk(0)
    with pytest.raises(ValueError, match="scale"):
        decompose(q, k, scale=-1.0)
    with pytest.raises(ValueError):
        decompose(q, k[..., :3])
    with pytest.raises(TypeError):
        decompose(q.numpy(), k)
    with pytest.raises(ValueError, match="att"):
        decompose_gat(q, k, torch.randn(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="negative_slope"):
        decompose_gat(q, k, torch.randn(12, dtype=torch.float64), negative_slope=0.0)

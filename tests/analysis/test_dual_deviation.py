"""Eq. (19) mapping and the dual deviation: exact reduction vs full-space solves, reconstruction."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnopt.analysis.dual_deviation import dual_deviation, eq19_mapping, map_captured
from attnopt.analysis.hooks import capture_attention
from attnopt.analysis.pretrained import model_inputs
from attnopt.dual import solve_mem
from tests.reference.hf_tiny import padded_batch, tiny_bert, tiny_t5
from tests.reference.mem import dual_oracle


def _records(model, seed=0):
    ids, mask = padded_batch(seed)
    kwargs = model_inputs(model, ids, mask)
    with capture_attention(model) as cap, torch.no_grad():
        model(**kwargs)
    return cap.records, kwargs


def _random_mapping(seed, b=2, h=2, nq=3, nk=4, d=6, mask_last=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, nk, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, h, nq, 3, generator=g, dtype=torch.float64)
    wk = torch.randn(h * 3, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    bias = torch.randn(1, h, nq, nk, generator=g, dtype=torch.float64)
    if mask_last:
        bias[..., -1] = float("-inf")
    return eq19_mapping(x, q, wk, scaling=3**-0.5, score_bias=bias)


@pytest.mark.parametrize("factory", [tiny_bert, tiny_t5])
def test_mapping_reproduces_model_weights(factory):
    records, kwargs = _records(factory())
    for rec in records:
        qm = kwargs["attention_mask"].bool() if rec.site.kind == "self" else None
        mp = map_captured(rec, query_mask=qm)
        torch.testing.assert_close(mp.weights()[mp.query_mask.unsqueeze(1).expand(-1, 4, -1)],
                                   rec.weights.double()[mp.query_mask.unsqueeze(1).expand(-1, 4, -1)],
                                   atol=1e-5, rtol=0)
        dev = dual_deviation(mp, model_weights=rec.weights)
        assert dev.reconstruction_ok is True and dev.reconstruction_error < 1e-5
        assert dev.converged and torch.isfinite(dev.deviation).all()
        assert (dev.deviation[~mp.query_mask.unsqueeze(1).expand(-1, 4, -1)] == 0).all()
        assert dev.values().shape == (4, int(mp.query_mask.sum()))


def test_padding_queries_are_not_covered():
    records, _ = _records(tiny_bert())
    mp = map_captured(records[0])  # query mask inferred from the self-attention mask diagonal
    assert mp.query_mask[0].all() and mp.query_mask[1, :5].all() and not mp.query_mask[1, 5:].any()


def test_failed_reconstruction_is_reported():
    records, _ = _records(tiny_bert())
    rec = records[0]
    wrong = rec.weights.roll(1, dims=-1)
    dev = dual_deviation(map_captured(rec), model_weights=wrong)
    assert dev.reconstruction_ok is False and dev.reconstruction_error > 1e-3
    assert torch.isfinite(dev.deviation).all()  # still measured, flagged rather than skipped


@pytest.mark.parametrize("seed", [0, 1])
def test_reduction_equals_full_space_oracle(seed):
    mp = _random_mapping(seed)
    dev = dual_deviation(mp, solver="shared")
    t, z, log_u = mp.templates, mp.z, mp.log_preference
    for b in range(t.shape[0]):
        for h in range(z.shape[1]):
            for i in range(z.shape[2]):
                u = log_u[b, h, i].exp().numpy()
                lam = dual_oracle(t[b].numpy(), z[b, h, i].numpy(), u, 1.0)
                ref = np.linalg.norm(lam - z[b, h, i].numpy()) / np.linalg.norm(lam)
                assert abs(float(dev.deviation[b, h, i]) - ref) < 1e-6
                assert abs(float(dev.lam_norm[b, h, i]) - np.linalg.norm(lam)) < 1e-6


def test_solvers_agree_with_full_solve_mem():
    mp = _random_mapping(3, nk=5, d=8)
    a = dual_deviation(mp, solver="solve_mem")
    b = dual_deviation(mp, solver="shared")
    torch.testing.assert_close(a.deviation, b.deviation, atol=1e-9, rtol=1e-7)
    c = dual_deviation(mp, solver="full")
    torch.testing.assert_close(a.deviation, c.deviation, atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(a.lam_norm, c.lam_norm, atol=1e-9, rtol=1e-7)
    full = solve_mem(mp.templates[:, None, None], mp.z, preference=mp.log_preference.exp(), alpha=1.0)
    ref = (full.lam - mp.z).norm(dim=-1) / full.lam.norm(dim=-1)
    torch.testing.assert_close(a.deviation, ref, atol=1e-9, rtol=1e-7)
    assert a.solver == "attnopt.dual.solve_mem" and b.solver.endswith("_reduced_mem")


@settings(max_examples=10)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.1, 3.0))
def test_deviation_properties(seed, scale):
    mp = _random_mapping(seed, mask_last=False)
    dev = dual_deviation(mp, solver="shared")
    assert torch.isfinite(dev.deviation).all() and (dev.deviation >= 0).all()
    # z = 0: the preference itself is optimal (gradient mu - E_u[t] = 0), lambda* = 0, finite 0
    zero = type(mp)(mp.templates, mp.z * 0, mp.log_preference, 1.0, mp.query_mask)
    d0 = dual_deviation(zero, solver="shared")
    assert float(d0.lam_norm.max()) < 1e-9 and (d0.deviation == 0).all()
    # first-order exactness: templates all equal => Cov = 0 and lambda* = alpha z exactly
    same = mp.templates[:, :1].expand_as(mp.templates) * scale
    one = type(mp)(same.contiguous(), mp.z, mp.log_preference, 1.0, mp.query_mask)
    assert float(dual_deviation(one, solver="shared").deviation.max()) < 1e-9


def test_bad_inputs():
    x = torch.randn(1, 4, 6)
    q = torch.randn(1, 2, 3, 3)
    with pytest.raises(ValueError, match="key_weight"):
        eq19_mapping(x, q, torch.randn(5, 6), scaling=1.0)
    with pytest.raises(ValueError, match="x_key"):
        eq19_mapping(x[0], q, torch.randn(6, 6), scaling=1.0)
    mp = eq19_mapping(x, q, torch.randn(6, 6), scaling=1.0)
    with pytest.raises(ValueError, match="solver"):
        dual_deviation(mp, solver="nope")


def test_half_precision_inputs_give_finite_deviations():
    mp = eq19_mapping(torch.randn(1, 4, 6).half(), torch.randn(1, 2, 3, 3).half(),
                      torch.randn(6, 6).half(), scaling=0.5)
    dev = dual_deviation(mp)
    assert mp.z.dtype == torch.float64 and torch.isfinite(dev.deviation).all()

import pytest
import torch

from attnopt.analysis import column_mass


def test_column_mass_sums_over_queries():
    w = torch.rand(2, 3, 5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    m = column_mass(w)
    assert m.shape == (2, 3, 4)
    torch.testing.assert_close(m, w.sum(-2))
    # row-stochastic weights: column masses sum to Nq
    p = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(column_mass(p).sum(-1), torch.full((2, 3), 5.0, dtype=torch.float64))


def test_column_mass_half_no_overflow():
    w = torch.full((1, 1, 3000, 2), 0.5, dtype=torch.float16)
    m = column_mass(w)
    assert m.dtype == torch.float16
    assert torch.equal(m, torch.full((1, 1, 2), 1500.0, dtype=torch.float16))


def test_column_mass_bad_input():
    with pytest.raises(TypeError):
        column_mass(torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(ValueError):
        column_mass(torch.ones(3))
    with pytest.raises(TypeError):
        column_mass([[1.0]])

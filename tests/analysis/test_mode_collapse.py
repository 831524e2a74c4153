import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnopt.analysis import count_clusters, iterate_attention, mode_collapse_distance


def _two_points_clusters(n0, n1, a):
    f64 = torch.float64
    return torch.cat([torch.full((n0, 1), a, dtype=f64), torch.full((n1, 1), -a, dtype=f64)])


@given(n0=st.integers(1, 30), n1=st.integers(1, 30), a=st.floats(0.2, 2.5))
def test_closed_form_matches_direct_simulation(n0, n1, a):
    x = _two_points_clusters(n0, n1, a)
    for scheme in ("lnas", "dnas"):
        y = iterate_attention(x, scheme, 1)[1]
        sim = float(y[0, 0] - y[-1, 0])
        assert sim == pytest.approx(float(mode_collapse_distance(n0 / n1, a, scheme)), rel=1e-9, abs=1e-12)


def test_dnas_upper_bounds_lnas_and_equal_at_r_one():
    r = torch.logspace(-2, 2, 41, dtype=torch.float64)
    for a in (0.5, 1.0, 2.0):
        ln, dn = mode_collapse_distance(r, a, "lnas"), mode_collapse_distance(r, a, "dnas")
        assert (dn >= ln - 1e-12).all() and (dn <= 2 * a).all()
        assert (dn - ln)[0] > 1e-3 * a or a == 2.0
    one = torch.tensor(1.0, dtype=torch.float64)
    torch.testing.assert_close(mode_collapse_distance(one, 0.7, "lnas"),
                               mode_collapse_distance(one, 0.7, "dnas"))


def test_unbalanced_mixture_collapses_under_lnas_only():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(90, 2, generator=g, dtype=torch.float64) * 0.3,
                   torch.randn(10, 2, generator=g, dtype=torch.float64) * 0.3 + torch.tensor([3.0, 0.0])])
    ln = iterate_attention(x, "lnas", 4)
    dn = iterate_attention(x, "dnas", 4)
    assert len(ln) == 5 and torch.equal(ln[0], x)
    assert count_clusters(ln[4], 0.5, min_size=5) == 1
    assert count_clusters(dn[4], 0.5, min_size=5) == 2
    batched = iterate_attention(torch.stack([x, x]), "dnas", 2)
    torch.testing.assert_close(batched[2][1], dn[2])


def test_count_clusters_and_bad_inputs():
    pts = torch.tensor([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [9.0, 9.0], [9.05, 9.0]])
    assert count_clusters(pts, 0.2) == 3
    assert count_clusters(pts, 0.2, min_size=2) == 2
    with pytest.raises(ValueError):
        mode_collapse_distance(0.0, 1.0, "lnas")
    with pytest.raises(ValueError):
        mode_collapse_distance(1.0, 1.0, "hnas")
    with pytest.raises(ValueError):
        iterate_attention(pts, "dnas", -1)
    with pytest.raises(ValueError):
        count_clusters(pts, 0.0)

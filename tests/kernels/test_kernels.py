"""attnopt.kernels: Gram matrices vs float64 loops, feature maps, gradients, sampling, errors."""
import math

import pytest
import torch

from attnopt.kernels import RBF, Linear, NonStationaryFourier, Periodic, RandomFourier
from tests.reference import kernel as ref

D = 3


def _pts(seed, n, d=D):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _w(seed, r=5, d=D):
    return torch.randn(r, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.7


CASES = [
    ("rbf", lambda: RBF(1.3), lambda x, y: ref.rbf(x, y, 1.3)),
    ("rbf-default", lambda: RBF(), lambda x, y: ref.rbf(x, y, D**0.25)),
    ("periodic", lambda: Periodic(2.0, 0.8), lambda x, y: ref.periodic(x, y, 2.0, 0.8)),
    ("linear", lambda: Linear(), lambda x, y: ref.linear(x, y, D**-0.5)),
    ("rff", lambda: RandomFourier(_w(1)), lambda x, y: ref.random_fourier(x, y, _w(1))),
    (
        "nsf",
        lambda: NonStationaryFourier(_w(2), _w(3)),
        lambda x, y: ref.nonstationary_fourier(x, y, _w(2), _w(3)),
    ),
]


@pytest.mark.parametrize("name,make,oracle", CASES, ids=[c[0] for c in CASES])
def test_gram_matches_float64_loops(name, make, oracle):
    x, y = _pts(0, 4), _pts(1, 6)
    kern = make()
    gram = kern(x, y)
    expect = torch.tensor([[oracle(x[i], y[j]) for j in range(6)] for i in range(4)], dtype=torch.float64)
    torch.testing.assert_close(gram, expect, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kern.paired(x[:4], y[:4]), torch.diagonal(gram[:, :4]))
    if kern.has_features:
        torch.testing.assert_close(kern.features(x) @ kern.features(y).T, gram)
    else:
        torch.testing.assert_close(kern.log_gram(x, y), expect.log())
        torch.testing.assert_close(kern.log_paired(x[:4], y[:4]), torch.diagonal(expect[:, :4]).log())


@pytest.mark.parametrize("name,make,oracle", CASES, ids=[c[0] for c in CASES])
def test_gradcheck(name, make, oracle):
    x = _pts(4, 3).requires_grad_()
    y = _pts(5, 4).requires_grad_()
    kern = make()
    assert torch.autograd.gradcheck(lambda a, b: kern(a, b), (x, y))


def test_fourier_spectral_points_gradcheck():
    x, y = _pts(4, 3), _pts(5, 4)
    w1, w2 = _w(6).requires_grad_(), _w(7).requires_grad_()
    assert torch.autograd.gradcheck(lambda a: RandomFourier(a)(x, y), (w1,))
    assert torch.autograd.gradcheck(lambda a, b: NonStationaryFourier(a, b)(x, y), (w1, w2))


def test_periodic_gradient_finite_at_coincident_points():
    x = _pts(0, 2).requires_grad_()
    Periodic(1.5)(x, x.detach()).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_nonstationary_with_equal_points_is_stationary():
    x, y, w = _pts(0, 4), _pts(1, 5), _w(2)
    torch.testing.assert_close(NonStationaryFourier(w, w)(x, y), RandomFourier(w)(x, y))


def test_per_head_spectral_points_broadcast():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, D, generator=g, dtype=torch.float64)
    w = torch.randn(3, 5, D, generator=g, dtype=torch.float64)
    gram = RandomFourier(w)(q, q)
    assert gram.shape == (2, 3, 4, 4)
    torch.testing.assert_close(gram[1, 2], RandomFourier(w[2])(q[1, 2], q[1, 2]))


def test_rbf_sampling_seeded_and_converges_prop3():
    a = RandomFourier.rbf(16, D, generator=torch.Generator().manual_seed(3)).spectral_points
    b = RandomFourier.rbf(16, D, generator=torch.Generator().manual_seed(3)).spectral_points
    assert torch.equal(a, b)
    x, y = _pts(0, 5) * 0.5, _pts(1, 5) * 0.5
    g0, g1 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    kern = RandomFourier.rbf(20000, D, lengthscale=1.2, generator=g0, dtype=torch.float64)
    err = (kern(x, y).square() - RBF(1.2)(x, y)).abs().max()
    assert err < 0.03
    w = RandomFourier.rbf(20000, 4, lengthscale=2.0, generator=g1).spectral_points
    assert abs(w.var().item() - 1 / (2 * 4.0)) < 0.005


def test_bad_inputs():
    with pytest.raises(ValueError, match="lengthscale"):
        RBF(0.0)
    with pytest.raises(ValueError, match="period"):
        Periodic(-1.0)
    with pytest.raises(ValueError, match="scale"):
        Linear(scale=float("nan"))
    with pytest.raises(TypeError, match="spectral_points"):
        RandomFourier([[1.0]])
    with pytest.raises(ValueError, match="spectral_points"):
        RandomFourier(torch.tensor([[float("inf")]]))
    with pytest.raises(ValueError, match="same shape"):
        NonStationaryFourier(_w(0, r=2), _w(1, r=3))
    with pytest.raises(ValueError, match="dimension"):
        RandomFourier(_w(0, d=4))(_pts(0, 2), _pts(1, 2))
    with pytest.raises(ValueError):
        RBF()(_pts(0, 2), _pts(1, 2, d=4))
    with pytest.raises(NotImplementedError):
        RBF().features(_pts(0, 2))
    with pytest.raises(NotImplementedError):
        Linear().log_gram(_pts(0, 2), _pts(1, 2))
    with pytest.raises(ValueError, match="num_samples"):
        RandomFourier.rbf(0, 3)
    assert math.isclose(RBF().inv_sq_lengthscale(16), 0.25)


def test_fourier_paired_equals_the_gram_diagonal_with_per_head_points():
    from attnopt.kernels import NonStationaryFourier, RandomFourier

    g = torch.Generator().manual_seed(11)
    x, y = (torch.randn(5, 3, 6, generator=g, dtype=torch.float64) for _ in range(2))
    w1, w2 = (torch.randn(3, 4, 6, generator=g, dtype=torch.float64) for _ in range(2))  # (H, R, d)
    for kern in (RandomFourier(w1), NonStationaryFourier(w1, w2)):
        ref = kern(x.unsqueeze(-2), y.unsqueeze(-2))[..., 0, 0]
        torch.testing.assert_close(kern.paired(x, y), ref)

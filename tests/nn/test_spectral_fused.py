"""The one-node sampler of the implicit spectral densities vs autograd through the modules (float64)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import attnopt.functional.kernel.spectral as sf
from attnopt.functional.kernel import sample_spectral_points
from attnopt.nn.implicit_kernel import ImplicitKernelAttention
from attnopt.nn.spectral import ImplicitSpectralDensity


@pytest.fixture(autouse=True, params=["native", "pytorch"])
def _path(request, monkeypatch):
    """Every test here with the C sampler (where a compiler exists) and with the PyTorch node."""
    from attnopt import _native

    if request.param == "pytorch":
        monkeypatch.setenv("ATTNOPT_NATIVE", "0")
        monkeypatch.setattr(_native, "_LIBS", {})
    return request.param


def _densities(n_sets, d=3, r=4, hidden=5, scales=None, seed=0):
    torch.manual_seed(seed)
    dens = nn.ModuleList(ImplicitSpectralDensity(d, r, hidden) for _ in range(n_sets)).double()
    with torch.no_grad():
        for i, mod in enumerate(dens):
            for prm in mod.parameters():
                prm.normal_(0, 0.7)
            mod.nn1[2].bias[d] = 6.0  # one log σ above the clamp (5): no gradient through it
            mod.nn1[2].bias[d + 1] = -12.0  # one below (-10)
            if scales is not None:
                mod.base_scale = scales[i]
    return dens


def _reference(h, noise, dens):
    """The unfused math: posterior, reparameterized base points, transform, analytic KL."""
    half = noise.shape[-2]
    sets, kl = [], 0.0
    for i, mod in enumerate(dens):
        mu, log_sigma = mod.posterior(h)
        sets.append(mod.transform(mu.unsqueeze(-2) + log_sigma.exp().unsqueeze(-2) * noise[i]))
        kl = kl + half * ImplicitSpectralDensity.gaussian_kl(mu, log_sigma).sum(-1)
    return torch.cat(sets, dim=-2), kl


@pytest.mark.parametrize(("n_sets", "lead", "scales"), [(1, (2, 3), None), (2, (2, 3), None),
                                                        (2, (3,), (0.4, 0.9)), (3, (1, 2, 3), None)])
def test_values_and_gradients_match_autograd(n_sets, lead, scales):
    g = torch.Generator().manual_seed(n_sets)
    dens = _densities(n_sets, scales=scales)
    h = torch.randn(*lead, 3, generator=g, dtype=torch.float64).requires_grad_()
    noise = torch.randn(n_sets, *lead, 2, 3, generator=g, dtype=torch.float64).requires_grad_()
    params = sf.fusable(dens)
    assert params is not None and len(params) == 8 * n_sets
    pts, kl = sample_spectral_points(h, noise, dens, params)
    ref_pts, ref_kl = _reference(h, noise, dens)
    torch.testing.assert_close(pts, ref_pts, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-12, atol=1e-12)
    gp, gk = torch.randn_like(pts), torch.randn_like(kl)
    leaves = (h, noise, *params)
    got = torch.autograd.grad((pts, kl), leaves, (gp, gk))
    want = torch.autograd.grad((ref_pts, ref_kl), leaves, (gp, gk))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    g = torch.Generator().manual_seed(5)
    dens = _densities(2, d=2, r=2, hidden=3, scales=(0.5, 0.8))
    params = [p.detach().clone().requires_grad_() for p in sf.fusable(dens)]
    h = torch.randn(2, 2, 2, generator=g, dtype=torch.float64).requires_grad_()
    noise = torch.randn(2, 2, 2, 1, 2, generator=g, dtype=torch.float64).requires_grad_()

    def fn(h, noise, *ps):
        return sample_spectral_points(h, noise, dens, list(ps))

    assert torch.autograd.gradcheck(fn, (h, noise, *params))


def _copula_reference(h, noise, dens, raw):
    """The copula written out: L = tril(raw, −1) + diag(exp diag raw), L̃ = rows of L at unit norm,
    ε ← L̃ε along the heads (an explicit sum), KL − (R/2)·S·(d/2)·log det(L̃L̃ᵀ)."""
    heads = raw.shape[0]
    low = torch.stack([torch.stack([raw[m, j] if j < m else (raw[m, m].exp() if j == m else raw.new_zeros(()))
                                    for j in range(heads)]) for m in range(heads)])
    fac = low / low.square().sum(-1, keepdim=True).sqrt()
    corr = torch.stack([sum(fac[m, j] * noise[..., j, :, :] for j in range(heads)) for m in range(heads)],
                       dim=-3)
    pts, kl = _reference(h, corr, dens)
    n_sets, half, d = noise.shape[0], noise.shape[-2], noise.shape[-1]
    return pts, kl - 0.5 * d * half * n_sets * torch.logdet(fac @ fac.T)


@pytest.mark.parametrize(("n_sets", "lead"), [(1, (2, 3)), (2, (2, 3)), (2, (3,))])
def test_copula_in_the_node_matches_autograd(n_sets, lead):
    """MIKAN: ε correlated by L̃ inside the node, log det C in the KL; values and every gradient."""
    g = torch.Generator().manual_seed(10 + n_sets)
    dens = _densities(n_sets)
    heads = lead[-1]
    raw = torch.randn(heads, heads, generator=g, dtype=torch.float64).requires_grad_()
    h = torch.randn(*lead, 3, generator=g, dtype=torch.float64).requires_grad_()
    noise = torch.randn(n_sets, *lead, 2, 3, generator=g, dtype=torch.float64).requires_grad_()
    params = sf.fusable(dens)
    pts, kl = sample_spectral_points(h, noise, dens, params, raw)
    ref_pts, ref_kl = _copula_reference(h, noise, dens, raw)
    torch.testing.assert_close(pts, ref_pts, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-12, atol=1e-12)
    gp, gk = torch.randn_like(pts), torch.randn_like(kl)
    leaves = (h, noise, raw, *params)
    got = torch.autograd.grad((pts, kl), leaves, (gp, gk))
    want = torch.autograd.grad((ref_pts, ref_kl), leaves, (gp, gk))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert got[2].triu(1).eq(0).all() and got[2].abs().sum() > 0  # the upper triangle is unused


def test_copula_gradcheck_and_broadcast_noise():
    """gradcheck with the copula, the noise broadcast over the batch (the eval buffer's shape)."""
    g = torch.Generator().manual_seed(7)
    dens = _densities(2, d=2, r=2, hidden=3, scales=(0.5, 0.8))
    params = [p.detach().clone().requires_grad_() for p in sf.fusable(dens)]
    h = torch.randn(2, 3, 2, generator=g, dtype=torch.float64).requires_grad_()
    noise = torch.randn(2, 1, 3, 1, 2, generator=g, dtype=torch.float64).requires_grad_()
    raw = torch.randn(3, 3, generator=g, dtype=torch.float64).requires_grad_()

    def fn(h, noise, raw, *ps):
        return sample_spectral_points(h, noise, dens, list(ps), raw)

    assert torch.autograd.gradcheck(fn, (h, noise, raw, *params))
    hd, nd, pd = h.detach(), noise.detach(), [p.detach() for p in params]
    assert torch.autograd.gradgradcheck(lambda r: fn(hd, nd, r, *pd)[1], (raw,))  # the KL's log det


def test_non_stock_networks_are_not_fused():
    dens = _densities(2)
    assert sf.fusable(dens) is not None
    dens[1].nn2 = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    assert sf.fusable(dens) is None
    dens[1].nn2 = nn.Sequential(nn.Linear(3, 5, bias=False), nn.Tanh(), nn.Linear(5, 3)).double()
    assert sf.fusable(dens) is None


@pytest.mark.parametrize(("variant", "training"), [("ika-s", False), ("ikan", True), ("mikan", True)])
def test_module_fused_equals_unfused_same_random_stream(variant, training, monkeypatch):
    """Same seed, same draws, same outputs and gradients with the fused sampler and without it."""

    def run(fused):
        torch.manual_seed(0)
        m = ImplicitKernelAttention(8, 2, variant, num_samples=4, p=2.0 if variant == "ika-s" else 1.5,
                                    seed=3).double().train(training)
        with torch.no_grad():
            for name, prm in m.named_parameters():
                if "nn1.2" in name or "nn2.2" in name or "copula" in name:
                    prm.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        if not fused:
            monkeypatch.setattr("attnopt.nn.implicit_kernel.fusable", lambda _: None)
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        outs = [m(x)[0] for _ in range(2)]  # two calls: the generator advances the same way
        loss = sum(o.square().sum() for o in outs) + m.kl()
        grads = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad], allow_unused=True)
        monkeypatch.undo()
        return outs, m.kl().detach(), grads

    (o1, k1, g1), (o2, k2, g2) = run(True), run(False)
    for a, b in zip(o1, o2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k1, k2, rtol=1e-12, atol=1e-12)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("copula", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_spectral_points_module_fused_equals_unfused(copula, training, monkeypatch):
    """ImplicitSpectralPoints (the graph layers' sampler): same draws and values with and without fusion."""
    from attnopt.nn.spectral import ImplicitSpectralPoints

    def run(fused):
        torch.manual_seed(0)
        sp = ImplicitSpectralPoints(3, 2, 4, copula=copula, seed=5).double().train(training)
        with torch.no_grad():
            for prm in sp.parameters():
                prm.normal_(0, 0.5, generator=torch.Generator().manual_seed(prm.numel()))
        if not fused:
            monkeypatch.setattr("attnopt.nn.spectral.fusable", lambda _: None)
        h = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        sets, kl = sp(h)
        loss = sum((s * torch.arange(s.numel(), dtype=s.dtype).view_as(s)).sum() for s in sets) + kl.sum()
        grads = torch.autograd.grad(loss, list(sp.parameters()))
        monkeypatch.undo()
        return sets, kl, grads

    (s1, k1, g1), (s2, k2, g2) = run(True), run(False)
    for a, b in zip((*s1, k1, *g1), (*s2, k2, *g2), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_double_backward_through_plain_ops():
    """create_graph=True differentiates the same function in plain ops (gradgradcheck)."""
    g = torch.Generator().manual_seed(6)
    dens = _densities(2, d=2, r=2, hidden=3, scales=(0.5, 0.8))
    params = [p.detach().clone().requires_grad_() for p in sf.fusable(dens)]
    h = torch.randn(2, 2, generator=g, dtype=torch.float64).requires_grad_()
    noise = torch.randn(2, 2, 1, 2, generator=g, dtype=torch.float64).requires_grad_()

    def fn(h, noise, w1a, w2b):
        ps = list(params)
        ps[0], ps[6] = w1a, w2b
        return sample_spectral_points(h, noise, dens, ps)

    assert torch.autograd.gradgradcheck(fn, (h, noise, params[0], params[6]))

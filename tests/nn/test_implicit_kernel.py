"""ImplicitKernelAttention: variants vs a float64 oracle, sampling, KL, masks, modes, errors."""
import math

import pytest
import torch
from torch import nn

from attnopt.nn.implicit_kernel import ImplicitKernelAttention
from attnopt.nn.spectral import GaussianCopula, ImplicitSpectralDensity
from tests.reference import kernel as ref

VARIANTS = ["ika-s", "ika-ns", "ikan", "ikan-direct", "mikan"]
E, H = 8, 2


def _p(variant):
    return 2.0 if variant.startswith("ika-") else 1.5


def _module(variant, seed=0, **kw):
    torch.manual_seed(seed)
    m = ImplicitKernelAttention(E, H, variant=variant, num_samples=4, p=_p(variant), seed=seed, **kw).double()
    with torch.no_grad():  # move the zero-initialized last layers off zero so every path matters
        for name, prm in m.named_parameters():
            if "nn1.2" in name or "nn2.2" in name or "copula" in name:
                prm.normal_(0, 0.3)
    return m


def _x(seed, b=2, n=5):
    return torch.randn(b, n, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_match_float64_oracle(variant):
    m = _module(variant).eval()
    x = _x(1)
    out, w = m(x, need_weights=True, average_attn_weights=False)
    with torch.no_grad():
        q, k = m.split_heads(m.q_proj(x)), m.split_heads(m.k_proj(x))
        sets, _ = m.spectral_points_for(k)
    for b in range(2):
        for h in range(H):
            ws = [(s[b, h] if s.dim() == 4 else s[h]).detach() for s in sets]
            if variant == "ika-s":
                sim = lambda a, c, ws=ws: ref.random_fourier(a, c, ws[0])  # noqa: E731
            else:
                sim = lambda a, c, ws=ws: ref.nonstationary_fourier(a, c, ws[0], ws[1])  # noqa: E731
            expect = ref.kernel_weights(q[b, h], k[b, h], sim, squared=True, p=_p(variant),
                                        scale=1 / math.sqrt(E // H), eps=1e-5)
            torch.testing.assert_close(w[b, h], expect, rtol=1e-9, atol=1e-12)
    v = m.split_heads(m.v_proj(x))
    torch.testing.assert_close(out, m.out_proj(m.merge_heads(w @ v)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_eval_deterministic_training_seeded(variant):
    x = _x(2)
    m = _module(variant).eval()
    torch.testing.assert_close(m(x)[0], m(x)[0], rtol=0, atol=0)
    a, b = _module(variant, seed=3).train(), _module(variant, seed=3).train()
    oa, ob = a(x)[0], b(x)[0]
    torch.testing.assert_close(oa, ob, rtol=0, atol=0)
    if variant != "ikan-direct":
        assert not torch.allclose(a(x)[0], oa)  # fresh noise on the next call


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradcheck_with_fixed_noise(variant):
    m = _module(variant).eval()
    x = _x(3, b=1, n=3).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: m(t)[0], (x,), fast_mode=True)


@pytest.mark.parametrize("variant", ["ikan", "mikan"])
def test_gradients_reach_spectral_networks_and_kl(variant):
    m = _module(variant).train()
    out, _ = m(_x(4))
    (out.square().mean() + m.kl()).backward()
    dens = m.densities[0]
    assert dens.nn1[0].weight.grad.abs().sum() > 0 and dens.nn2[0].weight.grad.abs().sum() > 0
    if variant == "mikan":
        assert m.copula.raw.grad.abs().sum() > 0
    assert m.kl().item() > 0


def test_kl_matches_monte_carlo_with_copula():
    torch.manual_seed(0)
    cop = GaussianCopula(3).double()
    with torch.no_grad():
        cop.raw.normal_(0, 0.5)
    mu = torch.randn(3, 2, dtype=torch.float64) * 0.5
    log_sigma = torch.randn(3, 2, dtype=torch.float64) * 0.3
    analytic = ImplicitSpectralDensity.gaussian_kl(mu, log_sigma).sum() - 0.5 * 2 * cop.log_det()
    n = 200_000
    eps = torch.randn(3, n, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    z = mu.unsqueeze(1) + log_sigma.exp().unsqueeze(1) * cop.correlate(eps)  # (H, n, d)
    total = 0.0
    corr = cop.correlation().detach()
    for j in range(2):
        cov = torch.diag(log_sigma[:, j].exp()) @ corr @ torch.diag(log_sigma[:, j].exp())
        qd = torch.distributions.MultivariateNormal(mu[:, j], covariance_matrix=cov)
        eye = torch.eye(3, dtype=torch.float64)
        pd = torch.distributions.MultivariateNormal(torch.zeros(3, dtype=torch.float64), eye)
        zj = z[:, :, j].T.detach()
        total += (qd.log_prob(zj) - pd.log_prob(zj)).mean()
    assert abs(total.item() - analytic.item()) < 0.03 * max(1.0, analytic.item())
    torch.testing.assert_close(torch.diagonal(corr), torch.ones(3, dtype=torch.float64))


def test_module_kl_scales_with_samples_and_is_zero_for_direct():
    m = _module("ikan").eval()
    m(_x(5, b=1))
    k = m.split_heads(m.k_proj(_x(5, b=1)))
    h = k.mean(-2)
    expect = sum(ImplicitSpectralDensity.gaussian_kl(*d.posterior(h)).sum() for d in m.densities) * 2
    torch.testing.assert_close(m.kl(), expect)
    d = _module("ikan-direct")
    d(_x(5))
    assert d.kl().item() == 0.0


def test_linear_mode_equals_quadratic_with_key_padding():
    x = _x(6, n=7)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 5:] = True
    quad = _module("mikan").eval()
    lin = _module("mikan", mode="linear").eval()
    lin.load_state_dict(quad.state_dict())
    torch.testing.assert_close(lin(x, key_padding_mask=pad)[0], quad(x, key_padding_mask=pad)[0])
    torch.testing.assert_close(lin(x, is_causal=True)[0], quad(x, is_causal=True)[0])


def test_padding_equals_truncation():
    m = _module("ikan").eval()
    x = _x(7, b=1, n=6)
    pad = torch.zeros(1, 6, dtype=torch.bool)
    pad[0, 4:] = True
    full, w = m(x, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    assert (w[..., 4:] == 0).all()
    trunc, _ = m(x[:, :4], x[:, :4], x[:, :4])
    torch.testing.assert_close(full[:, :4], trunc)


def test_initial_ika_s_approximates_multihead_attention():
    torch.manual_seed(0)
    m = ImplicitKernelAttention(16, 2, variant="ika-s", num_samples=4000, seed=0).double().eval()
    ref_mha = nn.MultiheadAttention(16, 2, batch_first=True).double()
    with torch.no_grad():
        ref_mha.in_proj_weight.copy_(torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]))
        ref_mha.in_proj_bias.copy_(torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias]))
        ref_mha.out_proj.weight.copy_(m.out_proj.weight)
        ref_mha.out_proj.bias.copy_(m.out_proj.bias)
    x = torch.randn(2, 6, 16, dtype=torch.float64) * 0.5
    _, w = m(x, need_weights=True, average_attn_weights=False)
    _, w_ref = ref_mha(x, x, x, need_weights=True, average_attn_weights=False)
    assert (w - w_ref).abs().max() < 0.03


def test_half_precision_no_nan():
    m = ImplicitKernelAttention(E, H, variant="mikan", num_samples=4, p=0.8, seed=0).to(torch.bfloat16).eval()
    out, w = m((_x(8) * 30).to(torch.bfloat16), need_weights=True, average_attn_weights=False)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="variant"):
        ImplicitKernelAttention(E, H, variant="ika")
    with pytest.raises(ValueError, match="p = 2"):
        ImplicitKernelAttention(E, H, variant="ika-s", p=1.0)
    with pytest.raises(ValueError, match="p must"):
        ImplicitKernelAttention(E, H, variant="ikan", p=0.0)
    with pytest.raises(ValueError, match="even"):
        ImplicitKernelAttention(E, H, variant="ikan", num_samples=3)
    with pytest.raises(ValueError, match="mode"):
        ImplicitKernelAttention(E, H, mode="fast")
    with pytest.raises(RuntimeError, match="forward"):
        ImplicitKernelAttention(E, H).kl()


@pytest.mark.parametrize("variant", VARIANTS)
def test_empty_batch_gives_zero_kl_not_nan(variant):
    # an empty batch adds nothing to the ELBO; the batch mean of no example was NaN and poisoned
    # the loss (kl() is what training adds to the task loss)
    for training in (True, False):
        m = _module(variant).train(training)
        x = _x(0, b=0)
        out, _ = m(x, x, x)
        assert out.shape == (0, 5, E)
        kl = m.kl()
        assert kl.shape == () and kl.item() == 0.0
        (out.sum() + kl).backward()  # finite (zero) gradients, no NaN
        assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
        m(_x(1), _x(2), _x(3))
        assert math.isfinite(m.kl().item())  # a non-empty batch afterwards: the usual KL again

r"""Implicit spectral densities for implicit kernel attention (implicit-kernel-attention eq. 5–8, MIKAN).

Per head ``m`` with summary ``h^{(m)}`` (see :class:`ImplicitSpectralDensity`):

.. math:: \mu, \log\sigma = NN_1(h),\quad \tilde z \sim \mathcal N(\mu, \sigma^2 I),\quad
          z = [\tilde z \,\|\, -\tilde z],\quad w = \mathrm{sign}(z)\odot NN_2(|z|)

so the density of ``w`` is symmetric (a real kernel). ``R/2`` base points ``z̃`` are drawn
per head and mirrored, giving ``R`` spectral points. MIKAN couples the heads' base variables
by a Gaussian copula with correlation ``C = L̃L̃ᵀ`` (``L̃`` a learned lower-triangular factor
with unit-norm rows): correlated standard normals ``e = L̃ε`` are mapped through ``Φ`` and the
inverse CDF of head ``m``'s Gaussian, ``F_m^{-1}(Φ(e_m)) = μ_m + σ_m e_m`` — an affine map, which
is how it is computed (no precision lost in the tails). ``C = I`` is IKAN.

The KL term of the ELBO (eq. 5) against the prior ``p(z̃) = N(0, I)`` is analytic:
``Σ_m KL(N(μ_m, σ_m²)‖N(0, 1)) − (d/2)·log det C`` per example.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["ImplicitSpectralDensity", "GaussianCopula"]


class GaussianCopula(nn.Module):
    """Learned correlation ``C = L̃L̃ᵀ`` across ``num_heads`` (Cholesky-parameterized).

    ``L`` is lower-triangular with ``exp``-positive diagonal; ``L̃`` scales each row of ``L``
    to unit norm, so ``C`` has a unit diagonal (standard normal marginals). Initialized to
    ``C = I`` (independent heads).
    """

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.raw = nn.Parameter(torch.zeros(num_heads, num_heads))

    def factor(self) -> Tensor:
        """``L̃`` (H, H), lower-triangular with unit-norm rows."""
        low = torch.tril(self.raw, diagonal=-1) + torch.diag(self.raw.diagonal().exp())
        return low / low.norm(dim=-1, keepdim=True)

    def correlation(self) -> Tensor:
        """``C = L̃L̃ᵀ`` (H, H)."""
        f = self.factor()
        return f @ f.T

    def log_det(self) -> Tensor:
        """``log det C = 2 Σ log L̃_mm``."""
        return 2 * self.factor().diagonal().log().sum()

    def correlate(self, eps: Tensor) -> Tensor:
        """Correlate standard normals across heads: eps (..., H, n, d) -> L̃ε along H."""
        f = self.factor().to(eps.dtype)
        return torch.einsum("mh,...hnd->...mnd", f, eps)


class ImplicitSpectralDensity(nn.Module):
    """``w = sign(z)·NN₂(|z|)`` with ``z̃ ~ N(NN₁(h))`` (eq. 6–8), ``R`` points per head.

    ``h`` per head is the mean of that head's projected keys over the non-padded positions
    (computed by :class:`~attnopt.nn.ImplicitKernelAttention`), so the kernel adapts to the
    input. ``NN₁`` and ``NN₂`` are shared by the heads. At initialization ``μ = 0``,
    ``σ = 1`` and ``NN₂(x) = x/√(2l²)`` with ``l² = √d``, so ``w ~ N(0, I/(2√d))`` and the
    kernel is the random-Fourier approximation of SDPA's RBF (Prop. 3).

    Args:
        dim: head dimension ``d``.
        num_samples: ``R`` (even: ``R/2`` base points and their mirror images).
        hidden: width of the two small MLPs.
    Raises:
        ValueError: odd or non-positive ``num_samples``, non-positive sizes.
    """

    def __init__(self, dim: int, num_samples: int, hidden: int = 32) -> None:
        super().__init__()
        if num_samples < 2 or num_samples % 2:
            raise ValueError(f"num_samples must be even and >= 2 (z = [z̃ ‖ −z̃]), got {num_samples}")
        if dim < 1 or hidden < 1:
            raise ValueError(f"dim and hidden must be >= 1, got {dim}, {hidden}")
        self.dim, self.num_samples = dim, num_samples
        self.nn1 = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 2 * dim))
        self.nn2 = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        for net in (self.nn1, self.nn2):
            last = net[2]
            assert isinstance(last, nn.Linear)
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)
        self.base_scale = 1.0 / math.sqrt(2 * math.sqrt(dim))

    def posterior(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """``μ, log σ`` (each (..., d)) from the head summaries ``h`` (..., d)."""
        mu, log_sigma = self.nn1(h).chunk(2, dim=-1)
        return mu, log_sigma.clamp(-10.0, 5.0)

    def transform(self, z_tilde: Tensor) -> Tensor:
        """``w = sign(z)·NN₂(|z|)`` for ``z = [z̃ ‖ −z̃]``: (..., R/2, d) -> (..., R, d)."""
        z = torch.cat([z_tilde, -z_tilde], dim=-2)
        a = z.abs()
        return torch.sign(z) * (a * self.base_scale + self.nn2(a))

    @staticmethod
    def kl(mu: Tensor, log_sigma: Tensor) -> Tensor:
        """``KL(N(μ, σ²) ‖ N(0, I))`` summed over the last dimension."""
        return 0.5 * (torch.exp(2 * log_sigma) + mu.pow(2) - 1.0 - 2 * log_sigma).sum(-1)

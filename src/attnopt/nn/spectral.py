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

from attnopt.functional.kernel import sample_spectral_points
from attnopt.functional.kernel.gaussian_noise import gaussian_noise
from attnopt.functional.kernel.spectral import copula_factor, fusable

__all__ = ["ImplicitSpectralDensity", "ImplicitSpectralPoints", "GaussianCopula"]


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
        return copula_factor(self.raw)[1]

    def correlation(self) -> Tensor:
        """``C = L̃L̃ᵀ`` (H, H)."""
        f = self.factor()
        return f @ f.T

    def log_det(self) -> Tensor:
        """``log det C = 2 Σ log L̃_mm``."""
        return 2 * self.factor().diagonal().log().sum()

    def correlate(self, eps: Tensor, factor: Tensor | None = None) -> Tensor:
        """Correlate standard normals across heads: eps (..., H, n, d) -> L̃ε along H.

        ``factor`` is :meth:`factor` when the caller already has it (computed once per forward).
        """
        f = (self.factor() if factor is None else factor).to(eps.dtype)
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
        """``w = sign(z)·NN₂(|z|)`` for ``z = [z̃ ‖ −z̃]``: (..., R/2, d) -> (..., R, d).

        ``|−z̃| = |z̃|`` and ``sign(−z̃) = −sign(z̃)``, so the mirror half is ``−w(z̃)``: the
        networks run on the ``R/2`` base points only.
        """
        a = z_tilde.abs()
        half = torch.sign(z_tilde) * (a * self.base_scale + self.nn2(a))
        return torch.cat([half, -half], dim=-2)

    @staticmethod
    def gaussian_kl(mu: Tensor, log_sigma: Tensor) -> Tensor:
        """``KL(N(μ, σ²) ‖ N(0, I))`` summed over the last dimension.

        (Not named ``kl``: a module's ``kl()`` is its auxiliary loss, which training sums over
        submodules; this is a function of given parameters.)
        """
        return 0.5 * (torch.exp(2 * log_sigma) + mu.pow(2) - 1.0 - 2 * log_sigma).sum(-1)


class ImplicitSpectralPoints(nn.Module):
    r"""Spectral point sets from implicit densities (eq. 5–8), optionally copula-coupled (MIKAN).

    ``n_sets`` independent :class:`ImplicitSpectralDensity` networks (2 for the non-stationary
    kernel of IKAN/MIKAN) map the per-head summaries ``h (..., H, d)`` to ``R`` points per head
    each. Training draws fresh base noise (reparameterized); evaluation uses a fixed base
    sample drawn once from ``seed`` (deterministic ``eval()`` outputs). With ``copula=True``
    the heads' base noise is correlated by a learned :class:`GaussianCopula` (MIKAN).

    The KL term of the ELBO per example is ``(R/2)·Σ_sets [Σ_m KL(N(μ_m, σ_m²)‖N(0, I)) −
    (d/2)·log det C]`` (the copula term only for MIKAN), as
    :meth:`attnopt.nn.ImplicitKernelAttention.kl` defines it.

    Args:
        dim: ``d`` of each spectral point.
        num_heads: ``H``.
        num_samples: ``R`` per head (even).
        n_sets: number of point sets (1 stationary, 2 non-stationary).
        copula: couple the heads by a Gaussian copula.
        hidden: width of the density networks.
        lengthscale_sq: ``l²`` of the RBF the points start from (``w ~ N(0, I/(2l²))``);
            ``None`` means ``√d`` (attention's length-scale).
        seed: seeds the training noise and the fixed evaluation noise.
    Raises:
        ValueError: odd or non-positive ``num_samples``, bad sizes, ``lengthscale_sq <= 0``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_samples: int,
        *,
        n_sets: int = 2,
        copula: bool = False,
        hidden: int = 32,
        lengthscale_sq: float | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads < 1 or n_sets < 1:
            raise ValueError(f"num_heads and n_sets must be >= 1, got {num_heads}, {n_sets}")
        if lengthscale_sq is not None and not lengthscale_sq > 0:
            raise ValueError(f"lengthscale_sq must be > 0, got {lengthscale_sq}")
        self.dim, self.num_heads, self.num_samples = dim, num_heads, num_samples
        self.densities = nn.ModuleList(
            ImplicitSpectralDensity(dim, num_samples, hidden) for _ in range(n_sets)
        )
        if lengthscale_sq is not None:
            for dens in self.densities:
                assert isinstance(dens, ImplicitSpectralDensity)
                dens.base_scale = 1.0 / math.sqrt(2 * lengthscale_sq)
        self.copula = GaussianCopula(num_heads) if copula else None
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self._generator = torch.Generator().manual_seed(seed + 1) if seed is not None else None
        noise = torch.randn(n_sets, num_heads, num_samples // 2, dim, generator=gen)
        self.register_buffer("eval_noise", noise)

    def forward(self, h: Tensor) -> tuple[list[Tensor], Tensor]:
        """``h (..., H, d)`` -> (point sets, each (..., H, R, d); KL per example (...))."""
        if h.shape[-2:] != (self.num_heads, self.dim):
            raise ValueError(f"h must be (..., {self.num_heads}, {self.dim}), got {tuple(h.shape)}")
        batch = h.shape[:-2]
        half = self.num_samples // 2
        params = fusable(self.densities)
        if params is not None:  # the same draws, per set, then every set's math in one node
            n_sets = len(self.densities)
            # one draw per set (a seed each, functional/kernel/gaussian_noise.py), stacked
            if self.training:
                shape = (*batch, self.num_heads, half, self.dim)
                stacked = torch.stack([gaussian_noise(shape, self._generator) for _ in range(n_sets)])
                stacked = stacked.to(device=h.device, dtype=h.dtype)
            else:
                stacked = self.get_buffer("eval_noise").to(device=h.device, dtype=h.dtype)
                stacked = stacked.view(n_sets, *(1,) * len(batch), *stacked.shape[1:])
                stacked = stacked.expand(n_sets, *batch, -1, -1, -1)
            raw = None
            if self.copula is not None:
                if type(self.copula) is GaussianCopula:  # correlated inside the node
                    raw = self.copula.raw
                else:
                    stacked = self.copula.correlate(stacked)
            pts, kl = sample_spectral_points(h, stacked, self.densities, params, raw)
            if self.copula is not None and raw is None:
                kl = kl - (0.5 * self.dim * half * len(self.densities)) * self.copula.log_det().to(h.dtype)
            r = self.num_samples
            return [pts[..., i * r : (i + 1) * r, :] for i in range(len(self.densities))], kl
        sets, kl = [], h.new_zeros(batch)
        for i, dens in enumerate(self.densities):
            assert isinstance(dens, ImplicitSpectralDensity)
            mu, log_sigma = dens.posterior(h)
            if self.training:
                noise = gaussian_noise((*batch, self.num_heads, half, self.dim), self._generator)
                noise = noise.to(device=h.device, dtype=h.dtype)
            else:
                noise = self.get_buffer("eval_noise")[i].to(device=h.device, dtype=h.dtype)
                noise = noise.expand(*batch, -1, -1, -1)
            if self.copula is not None:
                noise = self.copula.correlate(noise)
            sets.append(dens.transform(mu.unsqueeze(-2) + log_sigma.exp().unsqueeze(-2) * noise))
            set_kl = ImplicitSpectralDensity.gaussian_kl(mu, log_sigma).sum(-1)
            if self.copula is not None:
                set_kl = set_kl - 0.5 * self.dim * self.copula.log_det().to(h.dtype)
            kl = kl + half * set_kl
        return sets, kl

r"""Does a learned spectral density differ from the fixed Gaussian? (implicit-kernel-attention Fig. 5a–c).

GAT's attention is an RBF kernel (Prop. 2), whose spectral density is a fixed Gaussian
``N(0, s²I)``; IKAN/MIKAN learn theirs. :func:`mmd_test` compares a sample of learned
spectral points with a sample of that Gaussian by the unbiased squared maximum mean
discrepancy (Gretton et al. 2012) with a Gaussian kernel,

.. math:: \widehat{\mathrm{MMD}}^2_u = \frac{1}{m(m-1)}\sum_{i\ne j} k(x_i, x_j)
          + \frac{1}{n(n-1)}\sum_{i\ne j} k(y_i, y_j) - \frac{2}{mn}\sum_{i,j} k(x_i, y_j),
          \qquad k(a, b) = \exp\!\big(-\|a-b\|^2 / (2\beta^2)\big),

``β`` the median pairwise distance of the pooled sample, and a permutation p-value (the
share of random relabellings of the pooled sample whose statistic is at least the observed
one, counting the observed one). Shapes: ``x (m, D)``, ``y (n, D)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mmd2_unbiased", "mmd_test", "median_bandwidth"]


def _check(x: Tensor, y: Tensor) -> None:
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.shape[0] < 2:
            raise ValueError(f"{name} must be (n >= 2, D), got {tuple(t.shape)}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension, got {x.shape[1]} and {y.shape[1]}")


def median_bandwidth(z: Tensor) -> Tensor:
    """Median of the pairwise distances ``‖z_i − z_j‖`` (i < j) of ``z (n, D)``; > 0."""
    d = torch.cdist(z, z)
    iu = torch.triu_indices(len(z), len(z), offset=1, device=z.device)
    return d[iu[0], iu[1]].median().clamp_min(torch.finfo(z.dtype).tiny)


def _mmd2_from_gram(k: Tensor, m: int) -> Tensor:
    """Unbiased MMD² from the pooled Gram matrix ``k`` (m + n, m + n); the first ``m`` rows are x."""
    n = k.shape[0] - m
    kxx, kyy, kxy = k[:m, :m], k[m:, m:], k[:m, m:]
    sxx = (kxx.sum() - kxx.diagonal().sum()) / (m * (m - 1))
    syy = (kyy.sum() - kyy.diagonal().sum()) / (n * (n - 1))
    return sxx + syy - 2 * kxy.mean()


def mmd2_unbiased(x: Tensor, y: Tensor, bandwidth: float | Tensor) -> Tensor:
    """``MMD²_u`` of the module docstring with kernel width ``bandwidth`` (0-d tensor).

    Raises:
        TypeError: ``x``/``y`` not tensors.
        ValueError: not 2-D with >= 2 rows, different ``D``, ``bandwidth <= 0``.
    """
    _check(x, y)
    if not float(bandwidth) > 0:
        raise ValueError(f"bandwidth must be > 0, got {float(bandwidth)}")
    z = torch.cat([x, y])
    k = torch.exp(-torch.cdist(z, z).square() / (2 * torch.as_tensor(bandwidth, dtype=z.dtype) ** 2))
    return _mmd2_from_gram(k, len(x))


def mmd_test(
    x: Tensor, y: Tensor, *, permutations: int = 200, generator: torch.Generator | None = None
) -> tuple[float, float, float]:
    """``(MMD²_u, permutation p-value, bandwidth)`` of ``x`` against ``y`` (median-heuristic width).

    The p-value is ``(1 + #{perm: stat ≥ observed}) / (1 + permutations)``; ``generator``
    draws the permutations (deterministic when given).

    Raises:
        TypeError, ValueError: as :func:`mmd2_unbiased`; ``permutations < 1``.
    """
    _check(x, y)
    if permutations < 1:
        raise ValueError(f"permutations must be >= 1, got {permutations}")
    z = torch.cat([x, y]).detach()
    beta = median_bandwidth(z)
    k = torch.exp(-torch.cdist(z, z).square() / (2 * beta**2))
    m, n = len(x), len(y)
    observed = _mmd2_from_gram(k, m)
    # all permutations at once: with indicator rows a (x-members) and b = 1 - a,
    # Σ_{i≠j∈x} k = aᵀKa − aᵀdiag(K), Σ_{i≠j∈y} k = bᵀKb − bᵀdiag(K), Σ_{x,y} k = aᵀKb
    perms = torch.stack([torch.randperm(m + n, generator=generator) for _ in range(permutations)])
    a = (perms < m).to(k.dtype).to(k.device)  # position i holds an x-member in permutation p
    b = 1.0 - a
    ka, diag = a @ k, k.diagonal()
    sxx = ((ka * a).sum(1) - a @ diag) / (m * (m - 1))
    syy = ((b @ k * b).sum(1) - b @ diag) / (n * (n - 1))
    sxy = (ka * b).sum(1) / (m * n)
    stats = sxx + syy - 2 * sxy
    exceed = int((stats >= observed - 1e-12 * abs(float(observed))).sum())
    return float(observed), (1 + exceed) / (1 + permutations), float(beta)

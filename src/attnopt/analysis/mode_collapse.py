r"""Mode collapse of iterated attention without residual (doubly-normalized-attention Sec. 5.2, App. C).

Two 1-D clusters, ``N0`` points at ``+a`` and ``N1`` at ``−a``, Gaussian attention weights
``exp(−(x − y)²/2)``; with ``s = exp(−2a²)``, ``r = N0/N1`` and ``q = (r + s)/(rs + 1)``, one
update moves the centres to the distance

.. math:: d_{\mathrm{LNAS}} = \frac{2r(1-s^2)a}{(1+rs)(r+s)}, \qquad
          d_{\mathrm{DNAS}} = \frac{2qr(1-s^2)a}{(q+rs)(r+sq)}     \quad\text{(eq. 11–12)}

:func:`iterate_attention` runs the multi-step experiment (Fig. 5–6) on any point cloud with the
library's O(N) attention, and :func:`count_clusters` counts the groups that remain.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from attnopt._validation import check_tensor
from attnopt.functional.doubly_normalized import doubly_normalized_attention

__all__ = ["mode_collapse_distance", "iterate_attention", "count_clusters", "Scheme"]

Scheme = Literal["lnas", "dnas"]


def _check_scheme(scheme: str) -> str:
    if scheme not in ("lnas", "dnas"):
        raise ValueError(f"scheme must be 'lnas' or 'dnas', got {scheme!r}")
    return scheme


def mode_collapse_distance(r: Tensor | float, a: Tensor | float, scheme: Scheme) -> Tensor:
    r"""Centre distance after one attention update, eq. (11) (LNAS) or eq. (12) (DNAS).

    Args:
        r: cluster mass ratio ``N0/N1 > 0`` (tensor or number; broadcasts with ``a``).
        a: half the initial centre distance, ``a > 0``.
        scheme: ``"lnas"`` or ``"dnas"``.
    Returns:
        the new distance (float64 tensor of the broadcast shape); the initial one is ``2a``.
    Raises:
        ValueError: unknown ``scheme``, ``r <= 0`` or ``a <= 0``.
    """
    _check_scheme(scheme)
    rt = torch.as_tensor(r, dtype=torch.float64)
    at = torch.as_tensor(a, dtype=torch.float64)
    if (rt <= 0).any() or not torch.isfinite(rt).all():
        raise ValueError("r must be finite and > 0")
    if (at <= 0).any() or not torch.isfinite(at).all():
        raise ValueError("a must be finite and > 0")
    s = torch.exp(-2 * at**2)
    if scheme == "lnas":
        return 2 * rt * (1 - s**2) * at / ((1 + rt * s) * (rt + s))
    q = (rt + s) / (rt * s + 1)
    return 2 * q * rt * (1 - s**2) * at / ((q + rt * s) * (rt + s * q))


def iterate_attention(
    points: Tensor, scheme: Scheme, steps: int, *, bandwidth: float = 1.0, iterations: int = 1
) -> list[Tensor]:
    r"""Apply self-attention ``x ← π x`` (no residual) ``steps`` times with Gaussian weights.

    ``π_ij ∝ exp(−‖x_i − x_j‖² / (2 bandwidth²))``, row-normalized (LNAS) or doubly normalized
    (DNAS; ``iterations`` Sinkhorn steps). Computed with
    :func:`attnopt.functional.doubly_normalized_attention` on the features
    ``q_i = [x_i, −‖x_i‖²/2, 1]``, ``k_j = [x_j, 1, −‖x_j‖²/2]`` (so ``<q_i,k_j> = −‖x_i − x_j‖²/2``),
    i.e. in O(N) memory.

    Args:
        points: (N, D) or (B, N, D) point cloud(s).
        scheme: ``"lnas"`` or ``"dnas"``.
        steps: number of updates (>= 0).
        bandwidth: Gaussian kernel width (> 0).
        iterations: Sinkhorn steps for ``"dnas"`` (>= 1).
    Returns:
        ``steps + 1`` tensors shaped like ``points``: step 0 (the input) to step ``steps``.
    Raises:
        ValueError: unknown scheme, negative ``steps``, ``bandwidth <= 0``, bad shape.
        TypeError: non-floating ``points``.
    """
    check_tensor("points", points, min_dim=2)
    _check_scheme(scheme)
    if points.dim() > 3:
        raise ValueError(f"points must be (N, D) or (B, N, D), got {tuple(points.shape)}")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    k_iter = 0 if scheme == "lnas" else iterations
    out = [points]
    x = points
    for _ in range(steps):
        sq = (x * x).sum(-1, keepdim=True) / 2
        one = torch.ones_like(sq)
        q = torch.cat([x, -sq, one], dim=-1).unsqueeze(-3)
        k = torch.cat([x, one, -sq], dim=-1).unsqueeze(-3)
        x = doubly_normalized_attention(q, k, x.unsqueeze(-3), iterations=k_iter,
                                        scale=1.0 / bandwidth**2).squeeze(-3)
        out.append(x)
    return out


def count_clusters(points: Tensor, radius: float, *, min_size: int = 1) -> int:
    """Number of groups of ``points (N, D)`` linked by distances ``<= radius`` (single linkage).

    Only groups with at least ``min_size`` points are counted (stray outliers are not clusters).

    Raises:
        ValueError: ``points`` not 2-D, ``radius <= 0`` or ``min_size < 1``.
    """
    check_tensor("points", points, min_dim=2)
    if points.dim() != 2:
        raise ValueError(f"points must be (N, D), got {tuple(points.shape)}")
    if not radius > 0:
        raise ValueError(f"radius must be > 0, got {radius}")
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    n = points.shape[0]
    adj = torch.cdist(points.double(), points.double()) <= radius
    label = torch.arange(n)
    while True:  # propagate the smallest label through the graph until stable
        new = torch.where(adj, label[None, :], n).amin(dim=1)
        new = torch.minimum(new, label)
        if torch.equal(new, label):
            break
        label = new
    _, sizes = label.unique(return_counts=True)
    return int((sizes >= min_size).sum())

"""Slow, obvious float64 oracles for the implicit-kernel-attention kernels and weights."""
from __future__ import annotations

import math

import torch


def rbf(x, y, lengthscale):
    return math.exp(-float(((x - y) ** 2).sum()) / (2 * lengthscale**2))


def periodic(x, y, period, lengthscale):
    r = math.sqrt(float(((x - y) ** 2).sum()))
    return math.exp(-2 * math.sin(math.pi * r / period) ** 2 / lengthscale**2)


def linear(x, y, scale):
    return scale * float((x * y).sum())


def random_fourier(x, y, w):
    """(1/R) Σ_r cos(w_rᵀ(x − y)) (eq. 12–13), w (R, d)."""
    return sum(math.cos(float(w[r] @ (x - y))) for r in range(w.shape[0])) / w.shape[0]


def nonstationary_fourier(x, y, w1, w2):
    """(1/4R) Σ_r φ_r(x)ᵀφ_r(y) with φ_r = [cos w1ᵀx + cos w2ᵀx, sin w1ᵀx + sin w2ᵀx] (eq. 14–16)."""
    total = 0.0
    for r in range(w1.shape[0]):
        a1, a2 = float(w1[r] @ x), float(w2[r] @ x)
        b1, b2 = float(w1[r] @ y), float(w2[r] @ y)
        total += (math.cos(a1) + math.cos(a2)) * (math.cos(b1) + math.cos(b2))
        total += (math.sin(a1) + math.sin(a2)) * (math.sin(b1) + math.sin(b2))
    return total / (4 * w1.shape[0])


def lp_norm_sq(x, p):
    return float((x.abs() ** p).sum()) ** (2.0 / p)


def kernel_weights(q, k, sim, *, squared, p, scale, eps=0.0, mask=None):
    """Eq. 9 + 11 with loops: α_ij ∝ sim_ij · exp(s(‖q_i‖_p² + ‖k_j‖_p²)/2), query term included.

    q (Nq, d), k (Nk, d) float64; sim(x, y) -> float; mask (Nq, Nk) bool, True = keep.
    """
    nq, nk = q.shape[0], k.shape[0]
    out = torch.zeros(nq, nk, dtype=torch.float64)
    for i in range(nq):
        row = []
        for j in range(nk):
            if mask is not None and not bool(mask[i, j]):
                row.append(0.0)
                continue
            f = sim(q[i], k[j])
            s_ij = f * f + eps if squared else f
            mag = 1.0 if p is None else math.exp(scale * (lp_norm_sq(q[i], p) + lp_norm_sq(k[j], p)) / 2)
            row.append(s_ij * mag)
        total = sum(row)
        if total > 0:
            out[i] = torch.tensor(row, dtype=torch.float64) / total
    return out

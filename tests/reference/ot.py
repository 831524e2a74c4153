"""Literal float64 references for OT-based attention (fenchel-dual-attention eq. 22, 35–38).

Slow and obvious: the ``Nq × n × m`` triple sum of eq. (22), and per-query loops for the
true preference (37)–(38) and the dual objective (36).
"""
from __future__ import annotations

import torch
from torch import Tensor


def cost_matrix(bank: Tensor, templates: Tensor, cost: str) -> Tensor:
    """``M[a, i] = M(a, t_i)`` (..., m, n) by broadcasting (no matmul tricks)."""
    diff = bank.unsqueeze(-2) - templates.unsqueeze(-3)  # (..., m, n, d)
    if cost == "sqeuclidean":
        return (diff * diff).sum(-1)
    if cost == "neg_dot":
        return -(bank.unsqueeze(-2) * templates.unsqueeze(-3)).sum(-1)
    raise ValueError(cost)


def ot_weights_reference(
    z: Tensor, templates: Tensor, bank: Tensor, u: Tensor, m_cost: Tensor, alpha: float, gamma: float
) -> Tensor:
    """Eq. (22) as written: ``p*(a) = Σ_i u_i exp((α aᵀz − M(a,t_i))/γ) / Z_i`` (float64 triple sum).

    Shapes: z (..., Nq, d), templates (..., n, d), bank (..., m, d), u (..., n) summing to 1
    (or all zero), m_cost (..., m, n). Returns (..., Nq, m).
    """
    z, bank, u, m_cost = z.double(), bank.double(), u.double(), m_cost.double()
    dots = (z.unsqueeze(-2) * bank.unsqueeze(-3)).sum(-1)  # (..., Nq, m)
    expo = (alpha * dots.unsqueeze(-2) - m_cost.transpose(-2, -1).unsqueeze(-3)) / gamma  # (..., Nq, n, m)
    mx = expo.amax(-1, keepdim=True)
    num = torch.exp(expo - mx)
    q = num / num.sum(-1, keepdim=True)  # q[k, i, a] = exp(...)/Z_i
    return (u.unsqueeze(-2).unsqueeze(-1) * q).sum(-2)


def true_preference_reference(bank: Tensor, u_bank: Tensor, m_cost: Tensor, gamma: float) -> Tensor:
    """Eq. (37) by loops: ``ũ(t) = Σ_{t'} u(t') exp(−M(t,t')/γ) / Σ_{t''} exp(−M(t',t'')/γ)``.

    ``bank (m, d)``, ``u_bank (m,)``, ``m_cost (m, m)`` symmetric. Returns ``(m,)``.
    """
    m = bank.shape[0]
    out = torch.zeros(m, dtype=torch.float64)
    for t in range(m):
        for tp in range(m):
            den = sum(float(torch.exp(-m_cost[tp, tpp].double() / gamma)) for tpp in range(m))
            out[t] += float(u_bank[tp]) * float(torch.exp(-m_cost[t, tp].double() / gamma)) / den
    return out


def dual_objective_reference(
    lam: Tensor,
    z: Tensor,
    mu_tilde: Tensor,
    bank: Tensor,
    u: Tensor,
    m_cost: Tensor,
    alpha: float,
    gamma: float,
) -> Tensor:
    """Eq. (36) for one query: ``<μ̃+z,λ> − ‖λ‖²/(2α) − γ Σ_i u_i log Σ_a exp((aᵀλ − M(a,t_i))/γ)``.

    ``lam, z, mu_tilde (d,)``, ``bank (m, d)``, ``u (n,)``, ``m_cost (m, n)``.
    """
    lse = torch.logsumexp((bank @ lam).unsqueeze(-1) / gamma - m_cost / gamma, dim=0)  # (n,)
    return (mu_tilde + z) @ lam - lam @ lam / (2 * alpha) - gamma * (u * lse).sum()

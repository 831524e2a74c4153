r"""Fused materialized kernel attention for feature-map kernels at short sequences (internal).

implicit-kernel-attention eq. (9), (12)–(16), the bounded squared kernels (IKA / IKAN with
Fourier features, ``|f| <= 1``): with ``F = φ(Q) φ(K)ᵀ``, ``W = F² + ε`` and the key weight
``m_j = exp(a_j − max a)`` (magnitude and key mask),

.. math:: O_i = \frac{\sum_j W_{ij} m_j v_j}{\sum_j W_{ij} m_j}

in one autograd node: ``[Σ W m v, Σ W m] = W [v ⊙ m, m]`` (one matmul), and the closed-form
backward with ``A_ij = W_ij m_j``, ``g_i = dO_i / den_i``, ``δ_i = <g_i, O_i>``:

.. math:: dA = g V^\top - \delta,\quad dm_j = \textstyle\sum_i dA_{ij} W_{ij},\quad
          dV = m \odot (W^\top g),\quad dF = 2F \odot dA \odot m,\quad
          d\phi(Q) = dF\,\phi(K),\ d\phi(K) = dF^\top \phi(Q).

The feature maps and the magnitudes stay ordinary autograd ops (learned spectral points get
their gradients through them). Rows whose denominator is 0 give zeros.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["fused_feature_kernel_attention"]


class _FusedFeatureKernel(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, pq: Tensor, pk: Tensor, mt: Tensor, v: Tensor, eps: float
    ) -> Tensor:
        f = torch.matmul(pq, pk.transpose(-2, -1))
        w = f * f
        if eps:
            w.add_(eps)
        num = torch.matmul(w, torch.cat([v * mt, mt], dim=-1))
        den = num[..., -1:]
        ok = den > 0
        den = torch.where(ok, den, torch.ones_like(den))
        out = torch.where(ok, num[..., :-1] / den, torch.zeros_like(den))
        ctx.eps = eps
        ctx.save_for_backward(pq, pk, mt, v, f, den, ok, out)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        pq, pk, mt, v, f, den, ok, out = ctx.saved_tensors
        g = torch.where(ok, dout / den, torch.zeros_like(den))
        delta = (g * out).sum(-1, keepdim=True)
        da = torch.matmul(g, v.transpose(-2, -1)).sub_(delta)
        w = f * f
        if ctx.eps:
            w.add_(ctx.eps)
        dm = (da * w).sum(-2).unsqueeze(-1)
        dv = torch.matmul(w.transpose(-2, -1), g).mul_(mt)
        df = da.mul_(mt.transpose(-2, -1)).mul_(f).mul_(2.0)
        dpq = torch.matmul(df, pk)
        dpk = torch.matmul(df.transpose(-2, -1), pq)
        return dpq, dpk, dm, dv, None


def fused_feature_kernel_attention(
    phi_q: Tensor, phi_k: Tensor, key_weight: Tensor | None, v: Tensor, eps: float
) -> Tensor:
    """``O`` for features ``phi_q (…, Nq, D)``, ``phi_k (…, Nk, D)``, ``key_weight (…, 1, Nk)`` or None."""
    batch = tuple(torch.broadcast_shapes(phi_q.shape[:-2], phi_k.shape[:-2], v.shape[:-2],
                                         () if key_weight is None else key_weight.shape[:-2]))
    mt = torch.ones_like(v[..., :1]) if key_weight is None else key_weight.transpose(-2, -1).to(v.dtype)
    xs = [x.expand(*batch, *x.shape[-2:]) for x in (phi_q, phi_k, mt, v)]
    out: Tensor = _FusedFeatureKernel.apply(*xs, float(eps))
    return out

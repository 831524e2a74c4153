r"""All point sets of the implicit spectral densities in one autograd node (internal).

implicit-kernel-attention eq. 6–8 and the analytic KL of eq. 5, for ``S`` sets (one
:class:`~attnopt.nn.spectral.ImplicitSpectralDensity` each, ``NN(x) = W_b tanh(W_a x + b_a) + b_b``):

.. math:: [\mu, \rho] = NN_1(h),\ \log\sigma = \mathrm{clamp}(\rho, -10, 5),\quad
          z = \mu + \sigma \odot e,\quad
          w^{+} = \mathrm{sign}(z) \odot (c\,|z| + NN_2(|z|)),\quad w = [w^{+} \| -w^{+}],

          \mathrm{KL} = \tfrac{R}{2} \textstyle\sum_s \sum_{m,j} \tfrac12
          (\sigma^2 + \mu^2 - 1 - 2\log\sigma)

with ``e`` the (possibly copula-correlated) standard-normal base noise. Autograd through the
same math records ~25 nodes per set; at the lengths models train at (N = 64–128) their
backward cost more than the attention. Here the forward runs without recording and the
backward is closed form (``t = tanh u``: ``du = dt (1 − t²)``; ``∂|z|/∂z = sign z``;
``dμ = Σ_n dz + ḡ μ``, ``d log σ = σ Σ_n dz ⊙ e + ḡ (σ² − 1)`` inside the clamp, 0 outside;
``de = σ dz``), checked against autograd by ``gradcheck`` in the tests.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["fusable", "sample_spectral_points"]

_PER_SET = 8  # W_1a, b_1a, W_1b, b_1b, W_2a, b_2a, W_2b, b_2b
_LS_MIN, _LS_MAX = -10.0, 5.0


def _mlp_params(net: nn.Module) -> list[Tensor] | None:
    if not (isinstance(net, nn.Sequential) and len(net) == 3):
        return None
    a, t, b = net[0], net[1], net[2]
    if not (isinstance(a, nn.Linear) and type(t) is nn.Tanh and isinstance(b, nn.Linear)):
        return None
    if a.bias is None or b.bias is None:
        return None
    return [a.weight, a.bias, b.weight, b.bias]


def fusable(densities: nn.ModuleList) -> list[Tensor] | None:
    """The densities' parameters in the node's order, or None when a network is not the stock MLP."""
    out: list[Tensor] = []
    for dens in densities:
        for net in (getattr(dens, "nn1", None), getattr(dens, "nn2", None)):
            p = None if net is None else _mlp_params(net)
            if p is None:
                return None
            out.extend(p)
    return out


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


class _SpectralSample(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h: Tensor, noise: Tensor, scales: tuple[float, ...], *params: Tensor
    ) -> tuple[Tensor, Tensor]:
        n_sets = len(scales)
        half, d = noise.shape[-2], noise.shape[-1]
        batch = torch.broadcast_shapes(h.shape[:-1], noise.shape[1:-2])  # (..., H)
        pts = h.new_empty(*batch, n_sets * 2 * half, d)
        kl = h.new_zeros(batch[:-1])
        saved: list[Tensor] = []
        for s in range(n_sets):
            w1a, b1a, w1b, b1b, w2a, b2a, w2b, b2b = params[s * _PER_SET : (s + 1) * _PER_SET]
            t1 = torch.tanh(F.linear(h, w1a, b1a))
            o1 = F.linear(t1, w1b, b1b)
            mu, rho = o1[..., :d], o1[..., d:]
            ls = rho.clamp(_LS_MIN, _LS_MAX)
            sig = ls.exp()
            z = torch.addcmul(mu.unsqueeze(-2), sig.unsqueeze(-2), noise[s])
            a = z.abs()
            sg = z.sign()
            t2 = torch.tanh(F.linear(a, w2a, b2a))
            inner = F.linear(t2, w2b, b2b).add_(a, alpha=scales[s])
            base = s * 2 * half
            torch.mul(sg, inner, out=pts[..., base : base + half, :])
            torch.neg(pts[..., base : base + half, :], out=pts[..., base + half : base + 2 * half, :])
            kl_s = (sig * sig).add_(mu * mu).sub_(1.0).sub_(ls, alpha=2.0).sum((-2, -1))
            kl.add_(kl_s, alpha=0.5 * half)
            saved += [t1, mu, ls, (rho >= _LS_MIN) & (rho <= _LS_MAX), sig, a, sg, t2]
        ctx.scales, ctx.half = scales, half
        ctx.save_for_backward(h, noise, *params, *saved)
        return pts, kl

    @staticmethod
    def backward(ctx: Any, gpts: Tensor, gkl: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        n_sets, half = len(ctx.scales), ctx.half
        h, noise, *rest = ctx.saved_tensors
        params, saved = rest[: n_sets * _PER_SET], rest[n_sets * _PER_SET :]
        need_h, need_e = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.zeros_like(h) if need_h else None
        de = torch.zeros_like(noise) if need_e else None
        gk = (gkl * half).unsqueeze(-1).unsqueeze(-1)  # (..., 1, 1) against (..., H, d)
        dparams: list[Tensor | None] = []
        for s in range(n_sets):
            w1a, b1a, w1b, b1b, w2a, b2a, w2b, b2b = params[s * _PER_SET : (s + 1) * _PER_SET]
            t1, mu, ls, live, sig, a, sg, t2 = saved[s * 8 : (s + 1) * 8]
            base = s * 2 * half
            g = gpts[..., base : base + half, :] - gpts[..., base + half : base + 2 * half, :]
            gi = g * sg  # d inner
            gi_r, t2_r = _rows(gi), _rows(t2)
            dw2b, db2b = gi_r.t() @ t2_r, gi_r.sum(0)
            du2 = (gi @ w2b).mul_(1.0 - t2 * t2)
            du2_r = _rows(du2)
            dw2a, db2a = du2_r.t() @ _rows(a), du2_r.sum(0)
            dz = (du2 @ w2a).add_(gi, alpha=ctx.scales[s]).mul_(sg)
            dmu = dz.sum(-2).add_(gk * mu)
            dls = (dz * noise[s]).sum(-2).mul_(sig).add_(gk * (sig * sig - 1.0)).mul_(live)
            if de is not None:
                de[s] = _reduce_like(dz * sig.unsqueeze(-2), noise[s])
            do1 = torch.cat([dmu, dls], dim=-1)
            do1_r, t1_r = _rows(do1), _rows(t1)
            dw1b, db1b = do1_r.t() @ t1_r, do1_r.sum(0)
            du1 = (do1 @ w1b).mul_(1.0 - t1 * t1)
            du1_r = _rows(du1)
            dw1a, db1a = du1_r.t() @ _rows(h), du1_r.sum(0)
            if dh is not None:
                dh = dh + _reduce_like(du1 @ w1a, h)
            dparams += [dw1a, db1a, dw1b, db1b, dw2a, db2a, dw2b, db2b]
        return (dh, de, None, *dparams)


def _reduce_like(g: Tensor, like: Tensor) -> Tensor:
    return g if g.shape == like.shape else g.sum_to_size(like.shape)


def sample_spectral_points(
    h: Tensor, noise: Tensor, densities: nn.ModuleList, params: list[Tensor]
) -> tuple[Tensor, Tensor]:
    """All sets' spectral points and the KL without the copula term, one node.

    Args:
        h: (..., H, d) head summaries.
        noise: (S, ..., H, R/2, d) base noise (already copula-correlated), broadcastable.
        densities: the ``S`` :class:`~attnopt.nn.spectral.ImplicitSpectralDensity` modules.
        params: :func:`fusable` of ``densities``.
    Returns:
        ``(points (..., H, S·R, d), kl (...))``: set ``s`` is rows ``[sR, (s+1)R)``, each
        ``[w⁺ ‖ −w⁺]``; ``kl = (R/2) Σ_s Σ_{m,j} KL(N(μ, σ²) ‖ N(0, 1))``.
    """
    scales = tuple(float(getattr(dens, "base_scale")) for dens in densities)  # noqa: B009
    pts, kl = _SpectralSample.apply(h, noise, scales, *params)
    return pts, kl

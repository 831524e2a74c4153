r"""All point sets of the implicit spectral densities in one autograd node (internal).

implicit-kernel-attention eq. 6–8 and the analytic KL of eq. 5, for ``S`` sets (one
:class:`~attnopt.nn.spectral.ImplicitSpectralDensity` each, ``NN(x) = W_b tanh(W_a x + b_a) + b_b``):

.. math:: [\mu, \rho] = NN_1(h),\ \log\sigma = \mathrm{clamp}(\rho, -10, 5),\quad
          z = \mu + \sigma \odot e,\quad
          w^{+} = \mathrm{sign}(z) \odot (c\,|z| + NN_2(|z|)),\quad w = [w^{+} \| -w^{+}],

          \mathrm{KL} = \tfrac{R}{2} \textstyle\sum_s \sum_{m,j} \tfrac12
          (\sigma^2 + \mu^2 - 1 - 2\log\sigma)

with ``e`` the standard-normal base noise, for MIKAN correlated across the heads inside the node
(``e = L̃ε``, ``L̃`` the copula's factor from its raw parameter, and ``−(R/2)·S·(d/2)·log det C``
added to the KL; backward ``dε = L̃ᵀde``, ``dL̃ = Σ de εᵀ``, through the row normalization
``dL = (dL̃ − L̃ Σ_k dL̃_k L̃_k)/‖L_m‖`` and ``L_mm = exp(raw_mm)``). Autograd through the
same math records ~25 nodes per set; at the lengths models train at (N = 64–128) their
backward cost more than the attention. Here the forward runs without recording and the
backward is closed form (``t = tanh u``: ``du = dt (1 − t²)``; ``∂|z|/∂z = sign z``;
``dμ = Σ_n dz + ḡ μ``, ``d log σ = σ Σ_n dz ⊙ e + ḡ (σ² − 1)`` inside the clamp, 0 outside;
``de = σ dz``), checked against autograd by ``gradcheck`` in the tests.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnopt import _func
from attnopt._validation import host_readable
from attnopt.functional._autograd import double_backward
from attnopt.functional.kernel._spectral_plain import (
    _LS_MAX,
    _LS_MIN,
    _PER_SET,
    copula_factor,
    sample_plain,
)
from attnopt.functional.kernel._spectral_plain import strictly_lower as _strictly_lower

__all__ = ["copula_factor", "fusable", "spectral_sample_node"]



def _mlp_params(net: object) -> tuple[Tensor, ...] | None:
    if type(net) is not nn.Sequential:
        return None
    mods = net._modules  # Sequential's dict: indexing a Sequential costs ~1 µs
    if len(mods) != 3:
        return None
    a, t, b = mods.values()
    if type(a) is not nn.Linear or type(t) is not nn.Tanh or type(b) is not nn.Linear:
        return None
    pa, pb = a._parameters, b._parameters  # not a.weight: nn.Module.__getattr__ costs ~1 µs an access
    wa, ba, wb, bb = pa.get("weight"), pa.get("bias"), pb.get("weight"), pb.get("bias")
    if wa is None or ba is None or wb is None or bb is None:
        return None
    return wa, ba, wb, bb


def fusable(densities: nn.ModuleList) -> list[Tensor] | None:
    """The densities' parameters in the node's order, or None when a network is not the stock MLP."""
    out: list[Tensor] = []
    for dens in densities._modules.values():
        mods = dens._modules if dens is not None else {}
        one, two = _mlp_params(mods.get("nn1")), _mlp_params(mods.get("nn2"))
        if one is None or two is None:
            return None
        out += one
        out += two
    return out


def _stack(params: tuple[Tensor, ...], i: int, n_sets: int) -> Tensor:
    """Parameter ``i`` of every set stacked: weights (S, out, in), biases (S, 1, out)."""
    out = torch.stack([params[s * _PER_SET + i] for s in range(n_sets)])
    return out if out.dim() == 3 else out.unsqueeze(1)


def _stacked(params: tuple[Tensor, ...], n_sets: int) -> list[Tensor]:
    return [_stack(params, i, n_sets) for i in range(_PER_SET)]


def _factor_backward(low: Tensor, fac: Tensor, dfac: Tensor, gld: Tensor) -> Tensor:
    """``d raw`` from ``dL̃`` and ``gld = ∂/∂ log L̃_mm`` (the same for every ``m``).

    ``L̃ = L/r`` with ``r = ‖L_m‖``: ``dL = (dL̃ − L̃ Σ_k dL̃_k L̃_k)/r``; ``L_mm = exp(raw_mm)``.
    """
    dfac = dfac.clone()
    dfac.diagonal().add_(gld / fac.diagonal())
    dlow = (dfac - fac * (dfac * fac).sum(-1, keepdim=True)) / low.norm(dim=-1, keepdim=True)
    return torch.where(_strictly_lower(dlow), dlow, 0.0) + torch.diag(dlow.diagonal() * low.diagonal())


class _SpectralSample(torch.autograd.Function):
    """Every set at once: the S networks as batched matmuls over a leading set axis."""

    @staticmethod
    def forward(
        ctx: Any, h: Tensor, noise: Tensor, raw: Tensor | None, scales: tuple[float, ...], *params: Tensor
    ) -> tuple[Tensor, Tensor]:
        n_sets = len(scales)
        half, d = noise.shape[-2], noise.shape[-1]
        lead = h.shape[:-1]  # (..., H)
        rows = h.reshape(1, -1, d).expand(n_sets, -1, d)  # (S, M, d), M = prod(lead)
        m = rows.shape[1]
        w1a, b1a, w1b, b1b, w2a, b2a, w2b, b2b = _stacked(params, n_sets)
        e = noise.expand(n_sets, *lead, half, d)
        low = fac = None
        if raw is not None:  # the copula: e = L̃ε along the heads
            low, fac = copula_factor(raw)
            e = torch.matmul(fac.to(e.dtype), e.reshape(-1, lead[-1], half * d))
        e = e.reshape(n_sets, m, half, d)
        t1 = torch.baddbmm(b1a, rows, w1a.transpose(1, 2)).tanh_()  # (S, M, hid)
        o1 = torch.baddbmm(b1b, t1, w1b.transpose(1, 2))  # (S, M, 2d)
        mu, rho = o1[..., :d], o1[..., d:]
        ls = rho.clamp(_LS_MIN, _LS_MAX)
        live = ls == rho  # the clamp passes the gradient inside [min, max] (NaN: neither)
        sig = ls.exp()
        z = torch.addcmul(mu.unsqueeze(-2), sig.unsqueeze(-2), e)  # (S, M, n, d)
        a = z.abs().reshape(n_sets, m * half, d)
        sg = z.sign()
        t2 = torch.baddbmm(b2a, a, w2a.transpose(1, 2)).tanh_()
        inner = torch.baddbmm(b2b, t2, w2b.transpose(1, 2))
        if len(set(scales)) == 1:
            inner.add_(a, alpha=scales[0])
        else:
            inner.addcmul_(a, torch.tensor(scales, dtype=a.dtype, device=a.device).view(-1, 1, 1))
        hp = (sg * inner.view_as(sg)).transpose(0, 1)  # (M, S, n, d)
        pts = torch.cat([hp, -hp], dim=2).view(*lead, n_sets * 2 * half, d)
        kl_terms = (sig * sig).add_(mu * mu).sub_(1.0).sub_(ls, alpha=2.0)  # (S, M, d)
        kl = kl_terms.view(n_sets, *lead, d).sum(0).flatten(-2).sum(-1).mul_(0.5 * half)
        if fac is not None:  # − (d/2)·log det C per base point, log det C = 2 Σ log L̃_mm
            kl = kl - (0.5 * d * half * n_sets) * (2 * fac.diagonal().log().sum().to(kl.dtype))
        ctx.scales, ctx.half, ctx.lead = scales, half, lead
        ctx.save_for_backward(h, noise, e, w1a, w1b, w2a, w2b, t1, mu, live, sig, a, sg, t2, raw, low, fac,
                              *params)
        return pts, kl

    @staticmethod
    def backward(ctx: Any, gpts: Tensor, gkl: Tensor) -> tuple[Tensor | None, ...]:
        h, noise, e, w1a, w1b, w2a, w2b, t1, mu, live, sig, a, sg, t2, raw, low, fac, *params = (
            ctx.saved_tensors)
        if double_backward(ctx):  # create_graph=True: differentiate the plain ops (exact double backward)
            return _plain_backward(ctx, h, noise, raw, params, gpts, gkl)
        n_sets, half, lead = len(ctx.scales), ctx.half, ctx.lead
        d = h.shape[-1]
        m = t1.shape[1]
        g = gpts.reshape(m, n_sets, 2, half, d).transpose(0, 1)  # (S, M, 2, n, d)
        # d inner (S, M, n, d), written in the sets-first layout (no copy for the reshape below)
        if host_readable(sg):
            gi = torch.sub(g[:, :, 0], g[:, :, 1], out=torch.empty_like(sg)).mul_(sg)
            gi_r = gi.view(n_sets, m * half, d)
        else:  # traced (torch.compile): out= is functionalized away with its layout, so reshape
            gi_r = ((g[:, :, 0] - g[:, :, 1]) * sg).reshape(n_sets, m * half, d)
        dw2b, db2b = torch.bmm(gi_r.transpose(1, 2), t2), gi_r.sum(1)  # weight grads as (S, out, in)
        du2 = torch.bmm(gi_r, w2b)
        du2 = torch.addcmul(du2, du2 * t2, t2, value=-1.0)  # ⊙ (1 − t²)
        dw2a, db2a = torch.bmm(du2.transpose(1, 2), a), du2.sum(1)
        da = torch.bmm(du2, w2a)
        if len(set(ctx.scales)) == 1:
            da.add_(gi_r, alpha=ctx.scales[0])
        else:
            da.addcmul_(gi_r, torch.tensor(ctx.scales, dtype=da.dtype, device=da.device).view(-1, 1, 1))
        dz = da.view_as(sg).mul_(sg)  # (S, M, n, d)
        # the KL's gradient g_b = (R/2)·dkl_b per example b, broadcast over sets, heads and coordinates:
        # dμ += g μ, d log σ += g (σ² − 1) = σ (… + g σ) − g
        per_ex = (n_sets, -1, lead[-1], d)
        gk = gkl.reshape(1, -1, 1, 1)
        dmu = dz.sum(-2)
        dmu.view(per_ex).addcmul_(gk, mu.view(per_ex), value=half)
        dls = (dz * e).sum(-2)
        dls.view(per_ex).addcmul_(gk, sig.view(per_ex), value=half)
        dls.mul_(sig).view(per_ex).sub_(gk, alpha=half)
        dls.mul_(live)
        de = draw = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            de = dz * sig.unsqueeze(-2)  # d e (S, M, n, d)
            if fac is not None:  # e = L̃ε: dε = L̃ᵀ de, dL̃ = Σ de εᵀ (over sets, batch and points)
                eps = noise.expand(n_sets, *lead, half, d).reshape(-1, lead[-1], half * d)
                de = de.view(-1, lead[-1], half * d)
                if ctx.needs_input_grad[2]:
                    gld = gkl.sum() * (-(d * half * n_sets))  # d log L̃_mm
                    dfac = torch.matmul(de, eps.transpose(1, 2)).sum(0).to(fac.dtype)
                    draw = _factor_backward(low, fac, dfac, gld.to(fac.dtype))
                de = torch.matmul(fac.t().to(de.dtype), de)
            de = de.view(n_sets, *lead, half, d).sum_to_size(noise.shape) if ctx.needs_input_grad[1] else None
        do1 = torch.cat([dmu, dls], dim=-1)  # (S, M, 2d)
        dw1b, db1b = torch.bmm(do1.transpose(1, 2), t1), do1.sum(1)
        du1 = torch.bmm(do1, w1b)
        du1 = torch.addcmul(du1, du1 * t1, t1, value=-1.0)
        rows = h.reshape(1, m, d).expand(n_sets, m, d)
        dw1a, db1a = torch.bmm(du1.transpose(1, 2), rows), du1.sum(1)
        dh = None
        if ctx.needs_input_grad[0]:
            dh = torch.bmm(du1, w1a).sum(0).view_as(h)
        per_set = [gr.unbind(0) for gr in (dw1a, db1a, dw1b, db1b, dw2a, db2a, dw2b, db2b)]
        return (dh, de, draw, None, *(gr for s in range(n_sets) for gr in (g[s] for g in per_set)))


def _plain_backward(
    ctx: Any, h: Tensor, noise: Tensor, raw: Tensor | None, params: list[Tensor], gpts: Tensor, gkl: Tensor
) -> tuple[Tensor | None, ...]:
    inputs = [h, noise, raw, None, *params]
    need = [x for x, n in zip(inputs, ctx.needs_input_grad, strict=True) if n and x is not None]
    with torch.enable_grad():
        pts, kl = sample_plain(h, noise, raw, ctx.scales, params)
    grads = iter(torch.autograd.grad((pts, kl), need, (gpts, gkl), create_graph=True, allow_unused=True))
    return tuple(next(grads) if n and x is not None else None
                 for x, n in zip(inputs, ctx.needs_input_grad, strict=True))


def spectral_sample_node(
    h: Tensor, noise: Tensor, copula_raw: Tensor | None, scales: tuple[float, ...], params: list[Tensor],
) -> tuple[Tensor, Tensor]:
    """``(points, kl)`` by :class:`_SpectralSample` (inside ``torch.func`` transforms: the plain ops
    of :mod:`._spectral_plain`, the node being ctx-style with no vmap or forward-mode rule)."""
    if not _func.under_transform():
        out: tuple[Tensor, Tensor] = _SpectralSample.apply(h, noise, copula_raw, scales, *params)
        return out
    return sample_plain(h, noise, copula_raw, scales, params)

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

from attnopt.functional._autograd import double_backward

__all__ = ["fused_feature_kernel_attention", "fused_fourier_attention"]


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
        if double_backward(ctx):  # create_graph=True: differentiate the plain ops (exact double backward)
            return (*_plain_backward(ctx, dout), None)
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


def _plain_backward(ctx: Any, dout: Tensor) -> list[Tensor | None]:
    """The gradients of :class:`_FusedFeatureKernel` from the same function in plain autograd ops,
    with a graph (for ``create_graph=True``: the closed form uses untracked intermediates)."""
    xs = ctx.saved_tensors[:4]  # pq, pk, mt, v: the inputs, tracked
    need = [x for x, n in zip(xs, ctx.needs_input_grad[:4]) if n]
    with torch.enable_grad():
        f = torch.matmul(xs[0], xs[1].transpose(-2, -1))
        num = torch.matmul(f * f + ctx.eps, torch.cat([xs[3] * xs[2], xs[2]], dim=-1))
        den = num[..., -1:]
        ok = den > 0
        out = torch.where(ok, num[..., :-1] / torch.where(ok, den, torch.ones_like(den)), 0.0)
    grads = iter(torch.autograd.grad(out, need, dout, create_graph=True, allow_unused=True))
    return [next(grads) if n else None for n in ctx.needs_input_grad[:4]]


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


class _FusedFourier(torch.autograd.Function):
    """Fourier feature maps of ``q`` and ``k`` + the attention above, one node (closed-form backward).

    ``P = [Q; K] Wᵀ`` with ``W = [w_1; …; w_S]`` (S point sets of R points), features
    ``φ = c·[Σ_s cos P_s, Σ_s sin P_s]`` (S = 1: IKA_S, eq. 13; S = 2: IKA_NS, eq. 15–16).
    Backward through the features: ``dP_s = cos P_s ⊙ dφ_sin − sin P_s ⊙ dφ_cos`` (times c),
    ``d[Q; K] = dP W``, ``dW = dPᵀ [Q; K]`` (summed over the batch dimensions ``W`` broadcast over).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, mt: Tensor, v: Tensor, eps: float, coef: float, *ws: Tensor
    ) -> Tensor:
        nq, r = q.shape[-2], ws[0].shape[-2]
        x = torch.cat([q, k], dim=-2)
        w = ws[0] if len(ws) == 1 else torch.cat(ws, dim=-2)
        p = torch.matmul(x, w.transpose(-2, -1))  # (…, Nq+Nk, S·R)
        cs = torch.cat([p.cos(), p.sin()], dim=-1)  # [cos P_1..P_S | sin P_1..P_S]
        if len(ws) == 1:
            phi = cs * coef
        else:  # Σ_s over the sets: one add of strided views per extra set
            parts = cs.unflatten(-1, (2, len(ws), r))
            phi = parts[..., 0, :].add(parts[..., 1, :], alpha=1.0)
            for i in range(2, len(ws)):
                phi.add_(parts[..., i, :])
            phi = phi.mul_(coef).flatten(-2)
        pq, pk = phi[..., :nq, :], phi[..., nq:, :]
        f = torch.matmul(pq, pk.transpose(-2, -1))
        wgt = torch.addcmul(f.new_full((), eps), f, f) if eps else f * f  # one pass over Nq×Nk
        vm = torch.cat([v * mt, mt], dim=-1)
        num = torch.matmul(wgt, vm)
        den = num[..., -1:]
        inv = torch.where(den > 0, den.reciprocal(), 0.0)  # a row with no weight gives zeros
        out = num[..., :-1] * inv
        ctx.eps, ctx.coef, ctx.nq, ctx.nsets, ctx.r = eps, coef, nq, len(ws), r
        ctx.w_shapes = [t.shape for t in ws]
        ctx.save_for_backward(x, w, cs, pq, pk, mt, v, vm, f, wgt, inv, out)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if double_backward(ctx):  # the closed form below uses untracked intermediates
            raise RuntimeError(
                "kernel_attention's fused Fourier-feature node has no double backward (create_graph=True)"
            )
        # With A_ij = W_ij m_j, g = dO/den, δ_i = <g_i, O_i>, dA_ij = <g_i, v_j> − δ_i:
        # dW_ij = <[g_i, −δ_i], [m_j v_j, m_j]> (one matmul), T = Wᵀ[g, −δ] gives
        # dv_j = m_j T_j[:dv] and dm_j = <v_j, T_j[:dv]> + T_j[dv]: one pass over Nq×Nk (dW ⊙ f).
        x, w, cs, pq, pk, mt, v, vm, f, wgt, inv, out = ctx.saved_tensors
        g = dout * inv
        gn = torch.cat([g, (g * out).sum(-1, keepdim=True).neg_()], dim=-1)
        dm = dv = None
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            t = torch.matmul(wgt.transpose(-2, -1), gn)
            tv = t[..., :-1]
            dv = tv * mt if ctx.needs_input_grad[3] else None
            dm = (tv * v).sum(-1, keepdim=True).add_(t[..., -1:]) if ctx.needs_input_grad[2] else None
        df = torch.matmul(gn * (2.0 * ctx.coef), vm.transpose(-2, -1)).mul_(f)
        dphi = torch.cat([torch.matmul(df, pk), torch.matmul(df.transpose(-2, -1), pq)], dim=-2)
        s, r = ctx.nsets, ctx.r
        dc, ds = dphi[..., :r], dphi[..., r:]
        if s > 1:  # every set's cos (sin) gets the same dφ_cos (dφ_sin)
            dc, ds = torch.cat([dc] * s, dim=-1), torch.cat([ds] * s, dim=-1)
        half = s * r
        dp = torch.addcmul(cs[..., :half] * ds, cs[..., half:], dc, value=-1.0)
        dq = dk = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dx = torch.matmul(dp, w)
            dq, dk = dx[..., : ctx.nq, :], dx[..., ctx.nq :, :]
        dws: list[Tensor | None] = [None] * s
        if any(ctx.needs_input_grad[6:]):
            dw = torch.matmul(dp.transpose(-2, -1), x)  # (…, S·R, d)
            for i, shape in enumerate(ctx.w_shapes):
                if ctx.needs_input_grad[6 + i]:
                    dws[i] = dw[..., i * r : (i + 1) * r, :].sum_to_size(shape)
        return (dq, dk, dm, dv, None, None, *dws)


def fused_fourier_attention(
    q: Tensor, k: Tensor, key_weight: Tensor | None, v: Tensor, eps: float, coef: float, ws: list[Tensor]
) -> Tensor:
    """``O`` with Fourier features from spectral point sets ``ws`` (each (…, R, d), broadcast).

    ``q (…, Nq, d)``, ``k (…, Nk, d)``, ``v (…, Nk, dv)``, ``key_weight (…, 1, Nk)`` or None;
    ``coef`` is the feature normalization (``1/√R`` for one set, ``1/(2√R)`` for two).
    """
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                         () if key_weight is None else key_weight.shape[:-2],
                                         *(w.shape[:-2] for w in ws)))
    mt = torch.ones_like(v[..., :1]) if key_weight is None else key_weight.transpose(-2, -1).to(v.dtype)
    xs = [x.expand(*batch, *x.shape[-2:]) for x in (q, k, mt, v)]
    dt = q.dtype
    out: Tensor = _FusedFourier.apply(*xs, float(eps), float(coef), *(w.to(dt) for w in ws))
    return out

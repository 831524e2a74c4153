r"""Cache-blocked kernel attention for feature-map kernels at long sequences (internal).

implicit-kernel-attention eq. (9), the squared kernels whose direct form is exact (bounded
kernels, e.g. IKA / IKAN with Fourier features, and Linear under its Cauchy–Schwarz bound; see
:func:`attnopt.functional.kernel._direct_ok`): with ``F = φ(Q) φ(K)ᵀ``, ``W = F² + ε`` and the
key weight ``m_j`` (magnitude and key mask, ``<= 1``),

.. math:: O_i = \frac{\sum_j W_{ij} m_j v_j}{\sum_j W_{ij} m_j},\qquad
          [\textstyle\sum_j W_{ij} m_j v_j,\ \sum_j W_{ij} m_j] = W\,[v \odot m,\ m].

One autograd node over blocks of whole heads (or of query rows of one head when a head is
larger than a block) of about ``THRESHOLDS.kernel_block_elements`` scores, so that ``F``, ``W``
and ``dW`` of a block stay in the L2 cache; nothing ``Nq × Nk`` is saved (``F`` is recomputed in
the backward, a matmul of inner width ``D``). Backward with ``g_i = dO_i / den_i``, ``G = [g, −<g, O>]``:

.. math:: dF = 2F \odot (G\,[v \odot m,\ m]^\top),\quad T = W^\top G,\quad
          dv = m \odot T_{:dv},\quad dm = \langle v, T_{:dv}\rangle + T_{dv},\quad
          d\phi(Q) = dF\,\phi(K),\ d\phi(K) = dF^\top \phi(Q).

Two elementwise passes over a block in the backward (``W`` and ``dF``), one in the forward,
where the chunked autograd ops took six. Rows whose denominator is 0 give zeros.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnopt._validation import broadcast_shapes
from attnopt.functional._autograd import double_backward
from attnopt.functional.kernel._blocked import blocked_backward, blocked_forward

__all__ = ["chunked_feature_kernel_attention"]



def _plain_backward(ctx: Any, dout: Tensor) -> list[Tensor | None]:
    """The gradients of the feature-kernel nodes (``pq, pk, mt, v`` saved first) from the same
    function in plain autograd ops, with a graph (for ``create_graph=True``: the closed form
    uses untracked intermediates)."""
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


class _ChunkedFeatureKernel(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, pq: Tensor, pk: Tensor, mt: Tensor, v: Tensor, eps: float
    ) -> Tensor:
        vm = torch.cat([v * mt, mt], dim=-1)  # (G, Nk, dv + 1)
        num, kept = blocked_forward(pq, pk, vm, 1.0, eps)
        den = num[..., -1:]
        inv = torch.where(den > 0, den.reciprocal(), 0.0)  # a row with no weight gives zeros
        out = num[..., :-1] * inv
        ctx.eps = eps
        ctx.save_for_backward(pq, pk, mt, v, vm, inv, out, *(kept or ()))
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if double_backward(ctx):  # create_graph=True: differentiate the plain ops (exact double backward)
            return (*_plain_backward(ctx, dout), None)
        pq, pk, mt, v, vm, inv, out, *kept = ctx.saved_tensors
        need_q, need_k, need_m, need_v = ctx.needs_input_grad[:4]
        gr = dout * inv
        gn = torch.cat([gr, (gr * out).sum(-1, keepdim=True).neg_()], dim=-1)  # (G, Nq, dv + 1)
        t, dpq, dpk = blocked_backward(pq, pk, vm, gn, 1.0, ctx.eps, (kept[0], kept[1]) if kept else None,
                                       need_m or need_v, need_q, need_k)
        dm = dv = None
        if t is not None:
            tv = t[..., :-1]
            dv = tv * mt if need_v else None
            dm = (tv * v).sum(-1, keepdim=True).add_(t[..., -1:]) if need_m else None
        return dpq, dpk, dm, dv, None


def chunked_feature_kernel_attention(
    phi_q: Tensor, phi_k: Tensor, key_weight: Tensor | None, v: Tensor, eps: float
) -> Tensor:
    """``O (…, Nq, dv)`` for features ``phi_q (…, Nq, D)``, ``phi_k (…, Nk, D)``, values
    ``v (…, Nk, dv)`` and ``key_weight (…, 1, Nk)`` (``m``, in ``[0, 1]``) or None; batch
    dimensions broadcast."""
    shapes = [phi_q.shape[:-2], phi_k.shape[:-2], v.shape[:-2]]
    if key_weight is not None:
        shapes.append(key_weight.shape[:-2])
    batch = broadcast_shapes(*shapes)
    mt = v.new_ones(()).expand(*v.shape[:-1], 1) if key_weight is None else key_weight.transpose(-2, -1)

    def flat(x: Tensor) -> Tensor:
        return x.to(v.dtype).expand(*batch, *x.shape[-2:]).reshape(-1, *x.shape[-2:]).contiguous()

    out: Tensor = _ChunkedFeatureKernel.apply(flat(phi_q), flat(phi_k), flat(mt), flat(v), float(eps))
    return out.reshape(*batch, *out.shape[-2:])

r"""Cache-blocked kernel attention for feature-map kernels at long sequences (internal).

implicit-kernel-attention eq. (9), the squared kernels whose direct form is exact (bounded
kernels, e.g. IKA / IKAN with Fourier features, and Linear under its Cauchy–Schwarz bound; see
:func:`attnopt.functional.kernel._direct_ok`): with ``F = φ(Q) φ(K)ᵀ``, ``W = F² + ε`` and the
key weight ``m_j`` (magnitude and key mask, ``<= 1``),

.. math:: O_i = \frac{\sum_j W_{ij} m_j v_j}{\sum_j W_{ij} m_j},\qquad
          [\textstyle\sum_j W_{ij} m_j v_j,\ \sum_j W_{ij} m_j] = W\,[v \odot m,\ m].

One autograd node over blocks of whole heads (or of query rows of one head when a head is
larger than a block) of about :data:`BLOCK_ELEMS` scores, so that ``F``, ``W`` and ``dW`` of a
block stay in the L2 cache; nothing ``Nq × Nk`` is saved (``F`` is recomputed in the backward,
a matmul of inner width ``D``). Backward with ``g_i = dO_i / den_i``, ``G = [g, −<g, O>]``:

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
from attnopt.functional._kernel_fused import _plain_backward

__all__ = ["BLOCK_ELEMS", "chunked_feature_kernel_attention"]

#: Scores per block. Measured (attention fwd+bwd, Linear kernel, B·H = 128, N = 512, d = 16,
#: float32, 1 thread, loaded 2-core machine with a 2 MiB L2): 2^16–2^18 116 ms, 2^19 129 ms,
#: 2^20 136 ms; the chunked autograd ops (2^22-score query blocks) 268 ms, SDPA 429 ms.
BLOCK_ELEMS = 1 << 18


def _blocks(g: int, nq: int, nk: int) -> list[tuple[int, int, int, int]]:
    """``(h0, h1, r0, r1)``: heads ``[h0, h1)`` × query rows ``[r0, r1)`` of about BLOCK_ELEMS scores."""
    per_head = nq * max(nk, 1)
    if per_head <= BLOCK_ELEMS:
        step = max(1, BLOCK_ELEMS // per_head)
        return [(h, min(h + step, g), 0, nq) for h in range(0, g, step)]
    rows = max(1, BLOCK_ELEMS // max(nk, 1))
    return [(h, h + 1, r, min(r + rows, nq)) for h in range(g) for r in range(0, nq, rows)]


def _block_shape(blocks: list[tuple[int, int, int, int]]) -> tuple[int, int]:
    return max(h1 - h0 for h0, h1, _, _ in blocks), max(r1 - r0 for _, _, r0, r1 in blocks)


class _ChunkedFeatureKernel(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, pq: Tensor, pk: Tensor, mt: Tensor, v: Tensor, eps: float
    ) -> Tensor:
        g, nq, nk = pq.shape[0], pq.shape[1], pk.shape[1]
        vm = torch.cat([v * mt, mt], dim=-1)  # (G, Nk, dv + 1)
        num = v.new_empty(g, nq, v.shape[-1] + 1)
        blocks = _blocks(g, nq, nk)
        pkt = pk.transpose(-2, -1)
        buf = pq.new_empty(*_block_shape(blocks), nk)
        for h0, h1, r0, r1 in blocks:
            f = buf[: h1 - h0, : r1 - r0]
            torch.bmm(pq[h0:h1, r0:r1], pkt[h0:h1], out=f)
            f.mul_(f).add_(eps)  # W, in the cache
            torch.bmm(f, vm[h0:h1], out=num[h0:h1, r0:r1])
        den = num[..., -1:]
        inv = torch.where(den > 0, den.reciprocal(), 0.0)  # a row with no weight gives zeros
        out = num[..., :-1] * inv
        ctx.eps = eps
        ctx.save_for_backward(pq, pk, mt, v, vm, inv, out)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if double_backward(ctx):  # create_graph=True: differentiate the plain ops (exact double backward)
            return (*_plain_backward(ctx, dout), None)
        pq, pk, mt, v, vm, inv, out = ctx.saved_tensors
        need_q, need_k, need_m, need_v = ctx.needs_input_grad[:4]
        g, nq, nk = pq.shape[0], pq.shape[1], pk.shape[1]
        gr = dout * inv
        gn = torch.cat([gr, (gr * out).sum(-1, keepdim=True).neg_()], dim=-1)  # (G, Nq, dv + 1)
        gn2 = gn * 2.0
        blocks = _blocks(g, nq, nk)
        fbuf, wbuf = pq.new_empty(*_block_shape(blocks), nk), pq.new_empty(*_block_shape(blocks), nk)
        need_t = need_m or need_v
        need_f = need_q or need_k
        t = vm.new_zeros(vm.shape) if need_t else None
        dpq = torch.empty_like(pq) if need_q else None
        dpk = torch.zeros_like(pk) if need_k else None
        pkt, vmt = pk.transpose(-2, -1), vm.transpose(-2, -1)
        eps = torch.full((), ctx.eps, dtype=pq.dtype)
        for h0, h1, r0, r1 in blocks:
            f, w = fbuf[: h1 - h0, : r1 - r0], wbuf[: h1 - h0, : r1 - r0]
            qb, gb = pq[h0:h1, r0:r1], gn[h0:h1, r0:r1]
            torch.bmm(qb, pkt[h0:h1], out=f)
            if t is not None:
                torch.addcmul(eps, f, f, out=w)
                t[h0:h1].baddbmm_(w.transpose(-2, -1), gb)
            if need_f:
                torch.bmm(gn2[h0:h1, r0:r1], vmt[h0:h1], out=w)
                df = w.mul_(f)  # 2F ⊙ dW
                if dpq is not None:
                    torch.bmm(df, pk[h0:h1], out=dpq[h0:h1, r0:r1])
                if dpk is not None:
                    dpk[h0:h1].baddbmm_(df.transpose(-2, -1), qb)
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

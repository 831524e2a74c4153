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
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["blocked_backward", "blocked_forward", "chunked_feature_kernel_attention"]



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


def _blocks(g: int, nq: int, nk: int, device: torch.device) -> list[tuple[int, int, int, int]]:
    """``(h0, h1, r0, r1)``: heads ``[h0, h1)`` × query rows ``[r0, r1)`` of about
    ``kernel_block_elements`` scores."""
    cpu = device.type == "cpu"
    t = THRESHOLDS
    whole, size = ((t.kernel_whole_elements, t.kernel_block_elements) if cpu
                   else (t.kernel_device_block_elements, t.kernel_device_block_elements))
    per_head = nq * max(nk, 1)
    if g * per_head <= whole:
        return [(0, g, 0, nq)]
    if per_head <= size:
        step = max(1, size // per_head)
        return [(h, min(h + step, g), 0, nq) for h in range(0, g, step)]
    rows = max(1, size // max(nk, 1))
    return [(h, h + 1, r, min(r + rows, nq)) for h in range(g) for r in range(0, nq, rows)]


def _block_shape(blocks: list[tuple[int, int, int, int]]) -> tuple[int, int]:
    return max(h1 - h0 for h0, h1, _, _ in blocks), max(r1 - r0 for _, _, r0, r1 in blocks)


def blocked_forward(
    pq: Tensor, pk: Tensor, vm: Tensor, c4: float, eps: float
) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """``num = W vm`` with ``W = c4·F² + ε``, ``F = pq pkᵀ``, block by block.

    ``pq (G, Nq, D)``, ``pk (G, Nk, D)``, ``vm (G, Nk, e)`` (strided views allowed). Returns
    ``num (G, Nq, e)`` and, when one block holds every score (small sizes: nothing to gain from
    recomputing), ``(F, W)`` for :func:`blocked_backward`; else None.
    """
    g, nq, nk = pq.shape[0], pq.shape[1], pk.shape[1]
    pkt = pk.transpose(-2, -1)
    if g * nq * max(nk, 1) <= (THRESHOLDS.kernel_whole_elements if pq.device.type == "cpu"
                                   else THRESHOLDS.kernel_device_block_elements):
        f = torch.bmm(pq, pkt)  # one block (as _blocks gives): no block bookkeeping at small sizes
        w = torch.addcmul(f.new_full((), eps), f, f, value=c4)
        return torch.bmm(w, vm), (f, w)
    num = vm.new_empty(g, nq, vm.shape[-1])
    blocks = _blocks(g, nq, nk, pq.device)
    fbuf, wbuf = pq.new_empty(*_block_shape(blocks), nk), pq.new_empty(*_block_shape(blocks), nk)
    epst = torch.full((), eps, dtype=pq.dtype, device=pq.device)
    for h0, h1, r0, r1 in blocks:
        f, w = fbuf[: h1 - h0, : r1 - r0], wbuf[: h1 - h0, : r1 - r0]
        torch.bmm(pq[h0:h1, r0:r1], pkt[h0:h1], out=f)
        torch.addcmul(epst, f, f, value=c4, out=w)  # one pass, in the cache (in place: three)
        torch.bmm(w, vm[h0:h1], out=num[h0:h1, r0:r1])
    return num, None


def blocked_backward(
    pq: Tensor, pk: Tensor, vm: Tensor, gn: Tensor, c4: float, eps: float, kept: tuple[Tensor, Tensor] | None,
    need_t: bool, need_q: bool, need_k: bool, out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(T, dpq, dpk)`` of :func:`blocked_forward` for ``G = gn (G, Nq, e)`` (each None if not needed).

    ``T = Wᵀ G``, ``dF = 2c4·F ⊙ (G vmᵀ)``, ``dpq = dF pk``, ``dpk = dFᵀ pq``; written into
    ``out = (dpq, dpk)`` (views of one buffer, say) where given.
    """
    g, nq, nk = pq.shape[0], pq.shape[1], pk.shape[1]
    oq, ok = (None, None) if out is None else out
    if kept is not None:
        f, w = kept
        t = torch.bmm(w.transpose(-2, -1), gn) if need_t else None
        dpq = dpk = None
        if need_q or need_k:
            df = torch.bmm(gn, vm.transpose(-2, -1))
            if c4 == 0.5:
                df.mul_(f)
            else:  # 2c4·F ⊙ dW in one pass (0 + 2c4·dW·F), not a pass scaling G first
                torch.addcmul(df.new_zeros(()), df, f, value=2.0 * c4, out=df)
            if need_q:
                dpq = torch.bmm(df, pk) if oq is None else torch.bmm(df, pk, out=oq)
            if need_k:
                dft = df.transpose(-2, -1)
                dpk = torch.bmm(dft, pq) if ok is None else torch.bmm(dft, pq, out=ok)
        return t, dpq, dpk
    gn2 = gn * (2.0 * c4)
    blocks = _blocks(g, nq, nk, pq.device)
    fbuf, wbuf = pq.new_empty(*_block_shape(blocks), nk), pq.new_empty(*_block_shape(blocks), nk)
    t = vm.new_zeros(vm.shape) if need_t else None
    dpq = (pq.new_empty(pq.shape) if oq is None else oq) if need_q else None
    dpk = (pk.new_zeros(pk.shape) if ok is None else ok.zero_()) if need_k else None
    pkt, vmt = pk.transpose(-2, -1), vm.transpose(-2, -1)
    epst = torch.full((), eps, dtype=pq.dtype, device=pq.device)
    for h0, h1, r0, r1 in blocks:
        f, w = fbuf[: h1 - h0, : r1 - r0], wbuf[: h1 - h0, : r1 - r0]
        qb = pq[h0:h1, r0:r1]
        torch.bmm(qb, pkt[h0:h1], out=f)
        if t is not None:
            torch.addcmul(epst, f, f, value=c4, out=w)
            t[h0:h1].baddbmm_(w.transpose(-2, -1), gn[h0:h1, r0:r1])
        if need_q or need_k:
            torch.bmm(gn2[h0:h1, r0:r1], vmt[h0:h1], out=w)
            df = w.mul_(f)  # 2c4·F ⊙ dW
            if dpq is not None:
                torch.bmm(df, pk[h0:h1], out=dpq[h0:h1, r0:r1])
            if dpk is not None:
                dpk[h0:h1].baddbmm_(df.transpose(-2, -1), qb)
    return t, dpq, dpk


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

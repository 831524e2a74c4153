r"""The ``Nq × Nk`` part of the squared Fourier-feature attention by blocks of heads that stay in the cache:
``W = c⁴(φ_Q φ_Kᵀ)² + ε``, ``W [v ⊙ m, m]`` and its closed-form backward, shared by the chunked node
(:mod:`.chunked`) and the fused Fourier node (:mod:`.fourier`); a helper, not an implementation.
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["blocked_backward", "blocked_forward"]


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

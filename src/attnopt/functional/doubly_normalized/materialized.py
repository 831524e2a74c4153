r"""Materialized DNAS / Sinkhorn-K / HNAS in the probability domain (internal; CPU tensors).

The one materialized kernel of the family (issue 30): the router runs it wherever the C passes
of :mod:`.cpu` do not (Sinkhorn-K, float64, half, small K = 1 problems with autograd, and
without the C library). It saves the weights instead of recomputing them in the backward.

Chunks. Above ``THRESHOLDS.dnas_materialized_chunk_entries`` score entries the caller passes
4-D ``(B, H, N, ·)`` inputs and the kernel runs chunk by chunk over batch × heads (one autograd
node; about that many entries per chunk, at least one head), forward and backward, so that
each chunk's ``Nq × Nk`` temporaries stay in cache; the no-grad forward shares one buffer
between its chunks. (The backward's O(N²) saved state is the price of a materialized kernel:
the streaming passes of :mod:`.streaming` keep O(N).)

Layout. Every ``Nq × Nk`` matrix is held *transposed*, ``(…, Nk, Nq)``: the first column step
(over the queries of each key) is then a softmax over the contiguous last dim, about a third
of the cost of a softmax over dim −2; the matmuls take the transposes for free.

doubly-normalized-attention eq. (6)–(8), (10), Sec. 6. Scores ``S = scale·QKᵀ + M`` are formed
once; the normalizations run in the probability domain:

* column step: ``E ← softmax_i(S)`` (one fused kernel), later ``E ← E / Σ_i E``;
* row step: ``E ← E / Σ_j E``.

DNAS (K = 1) is therefore one column softmax, one row division and one matmul. After the
first column step every column has an entry ``>= 1/Nq``, so later sums stay ``>= 1/(Nq·Nk)``;
only the *first* row sum ``σ_i = Σ_j ξ_ij`` can underflow (a row dominated by other rows in
every column). When a row that has an admissible key gets ``σ_i < tiny·2^40`` the kernel
reports it (``None``) and the router recomputes with the log-domain reference (same result,
no underflow) — rare, never silent. That test reads a value on the host: the router sends only
host-readable CPU tensors here (:func:`attnopt._validation.host_readable`).

Backward (log-domain derivation; ``E_k = exp(T_k)`` is the matrix after step ``k``): with
``G = P ⊙ dP`` and ``dP = dO Vᵀ``, for ``k = 2K … 1``: ``G ← G − E_k ⊙ Σ_{dim_k} G``; then
``dS = G``, ``dQ = scale·dS K``, ``dK = scale·dSᵀ Q``, ``dV = Pᵀ dO``. For K = 1 the two steps
are ``G ← P ⊙ (dP − δ)`` with ``δ_i = <dO_i, O_i>`` and ``G ← G − (P σ) ⊙ Σ_i G`` (``ξ = P σ``),
so only ``P`` and ``σ`` are saved.

HNAS mixes the row softmax of the same scores: ``Π = w P^D + (1 − w) P^L``, one matmul;
``∂L/∂w = Σ (P^D − P^L) ⊙ dP`` (reduced to the shape of ``w``).

Masks are additive (``-inf`` = dropped) and not differentiated; a row or column with no
admissible entry gets weight 0 (zero output, zero gradient). Half precision is computed in
float32.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnopt._validation import host_readable
from attnopt.functional._autograd import reduce_to, refuse_double_backward
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["materialized_sinkhorn", "no_grad_forward"]

_INSTEAD = "use doubly_normalized_weights / hybrid_normalized_weights(q, k, ...) @ v (plain ops)"


def _scores_t(qs: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """The *transposed* scores ``Sᵀ = K (scale·Q)ᵀ + Mᵀ``, ``(…, Nk, Nq)``, with the causal ``-inf``
    (``qs`` is the pre-scaled ``Q``; key ``j > i`` is dropped for query ``i``)."""
    st = torch.matmul(k, qs.transpose(-2, -1))
    if mask is not None:
        st.add_(mask.transpose(-2, -1))
    if causal:
        nk, nq = st.shape[-2], st.shape[-1]
        st.masked_fill_(torch.ones(nk, nq, dtype=torch.bool, device=st.device).tril_(-1), float("-inf"))
    return st


def _safe_sum(e: Tensor, dim: int) -> Tensor:
    t = e.sum(dim, keepdim=True)
    return torch.where(t > 0, t, torch.ones_like(t))


def _softmax_zero_empty(s: Tensor, dim: int, masked: bool) -> Tensor:
    """Softmax along ``dim``; a slice that is entirely ``-inf`` gives zeros (not NaN)."""
    if not masked:
        return torch.softmax(s, dim)
    dead = torch.isneginf(s.amax(dim, keepdim=True))
    if host_readable(dead) and not bool(dead.any()):  # a CPU shortcut; elsewhere the masked form
        return torch.softmax(s, dim)
    return torch.softmax(s.masked_fill(dead, 0.0), dim).masked_fill_(dead, 0.0)


def _sinkhorn_forward(
    st: Tensor, masked: bool, iterations: int,
) -> tuple[Tensor, Tensor, list[Tensor]] | None:
    """``(Pᵀ, σᵀ, mids)`` from ``Sᵀ``: ``mids = [E_1ᵀ … E_2K-1ᵀ]``, or ``[]`` when K = 1 and
    ``E_1 = P σ``; ``None`` when the first row sum of an admissible row underflows. In the
    transposed layout a column step (over the queries) runs over the contiguous last dim."""
    e = _softmax_zero_empty(st, -1, masked)
    sigma = e.sum(-2, keepdim=True)  # (…, 1, Nq): the row sums σ_i
    thr = torch.finfo(e.dtype).tiny * 2.0**40
    if bool((sigma < thr).any()):
        valid = torch.isfinite(st).any(-2, keepdim=True) if masked else sigma == sigma
        if bool(((sigma < thr) & valid).any()):
            return None
        sigma = torch.where(sigma > 0, sigma, torch.ones_like(sigma))  # rows without admissible key
    if iterations == 1:
        return e.div_(sigma), sigma, []
    mids = [e]
    e = e / sigma
    for _ in range(iterations - 1):
        mids.append(e)
        e = e / _safe_sum(e, -1)
        mids.append(e)
        e = e / _safe_sum(e, -2)
    return e, sigma, mids


def _sinkhorn_backward(g: Tensor, p: Tensor, sigma: Tensor, mids: list[Tensor], iterations: int) -> Tensor:
    """Apply ``G ← G − E_k ⊙ Σ_{dim_k} G`` for ``k = 2K−1 … 1`` (in place on ``g``; transposed layout:
    a column step sums over the last dim)."""
    for idx in range(2 * iterations - 2, -1, -1):
        dim = -1 if idx % 2 == 0 else -2
        e = mids[idx] if mids else p * sigma
        g.addcmul_(e, g.sum(dim, keepdim=True), value=-1.0)
    return g


def _forward_piece(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool, scale: float,
    iterations: int,
) -> tuple[Tensor, list[Tensor]] | None:
    """``(out, saved)`` of one piece (the whole batch or one chunk); ``None`` on underflow.

    ``saved = [out, qs, Pᵀ, σᵀ, *mids]`` (HNAS: ``+ [Πᵀ, P^Lᵀ]``), the same length for every piece.
    """
    qs = q * scale  # N·d work instead of scaling the N × N scores; reused by dK
    st = _scores_t(qs, k, mask, causal)
    masked = mask is not None or causal
    p_lnas = _softmax_zero_empty(st, -2, masked) if w is not None else None
    res = _sinkhorn_forward(st, masked, iterations)
    del st
    if res is None:
        return None
    p, sigma, mids = res
    if w is None or p_lnas is None:
        out = torch.matmul(p.transpose(-2, -1), v)
        return out, [out, qs, p, sigma, *mids]
    mix = torch.lerp(p_lnas, p, w)
    out = torch.matmul(mix.transpose(-2, -1), v)
    return out, [out, qs, p, sigma, *mids, mix, p_lnas]


def _backward_piece(
    dout: Tensor, k: Tensor, v: Tensor, w: Tensor | None, saved: list[Tensor] | tuple[Tensor, ...],
    scale: float, iterations: int, need_w: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, ∂L/∂w per row (…, 1, Nq) or None)`` of one piece (see the module docstring;
    every ``Nq × Nk`` matrix transposed)."""
    out, qs, p, sigma, *rest = saved
    dp = torch.matmul(v, dout.transpose(-2, -1))  # dPᵀ
    drow = None
    if w is None:
        mids = rest
        dv = torch.matmul(p, dout)
        delta = (dout * out).sum(-1, keepdim=True).transpose(-2, -1)
        g = dp.sub_(delta).mul_(p)
        ds = _sinkhorn_backward(g, p, sigma, mids, iterations)
    else:
        *mids, mix, p_lnas = rest
        dv = torch.matmul(mix, dout)
        a = p * dp
        b = dp.mul_(p_lnas)
        ra, rb = a.sum(-2, keepdim=True), b.sum(-2, keepdim=True)
        if need_w:
            drow = ra - rb  # Σ (P^D − P^L) ⊙ dP from the row sums
        a.addcmul_(p, ra, value=-1.0)
        gd = _sinkhorn_backward(a, p, sigma, mids, iterations)
        b.addcmul_(p_lnas, rb, value=-1.0)
        ds = torch.lerp(b, gd, w)
    dq = torch.matmul(ds.transpose(-2, -1), k).mul_(scale)
    dk = torch.matmul(ds, qs)
    return dq, dk, dv, drow


def _split(n: int, parts: int) -> list[slice]:
    """``range(n)`` cut into ``parts`` slices of near-equal length."""
    edges = [n * i // parts for i in range(parts + 1)]
    return [slice(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True) if hi > lo]


def _chunks(b: int, h: int, per_head: int) -> list[tuple[slice, slice]]:
    """(batch slice, head slice) pairs covering ``(b, h)``, about
    ``THRESHOLDS.dnas_materialized_chunk_entries`` score entries each (at least one head)."""
    heads = max(1, THRESHOLDS.dnas_materialized_chunk_entries // max(per_head, 1))
    if b * h <= heads:
        return [(slice(None), slice(None))]
    if h <= heads:
        return [(bs, slice(None)) for bs in _split(b, -(-b * h // heads))]
    return [(slice(i, i + 1), hs) for i in range(b) for hs in _split(h, -(-h // heads))]


def _pieces(q: Tensor, nk: int) -> list[tuple[slice, slice]] | None:
    """The chunks of a 4-D ``(B, H, Nq, ·)`` problem; ``None``: one piece (any batch shape)."""
    if q.dim() != 4:
        return None
    parts = _chunks(q.shape[0], q.shape[1], q.shape[2] * nk)
    return None if len(parts) == 1 else parts


def _part(x: Tensor | None, bs: slice, hs: slice) -> Tensor | None:
    """``x[bs, hs]`` on a 4-D tensor whose batch / head dims may be broadcast (size 1)."""
    if x is None:
        return None
    return x[bs if x.shape[0] > 1 else slice(None), hs if x.shape[1] > 1 else slice(None)]


class _MaterializedSinkhorn(torch.autograd.Function):
    """DNAS / Sinkhorn-K (``w is None``) or HNAS (``w`` given) on materialized scores.

    Sets ``info[0] = False`` (and returns an empty tensor) when a row sum underflows. 4-D inputs
    above one chunk run chunk by chunk over (B, H) (:func:`_chunks`), forward and backward: one
    autograd node, each chunk's ``Nq × Nk`` temporaries stay in cache.

    ``forward(ctx, …)`` style on purpose: returning the saved intermediates as outputs for a
    ``setup_context`` cost ~40 µs per call, a tenth of the whole call at N = 64.
    """

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool,
        scale: float, iterations: int, info: list[bool],
    ) -> Tensor:
        parts = _pieces(q, k.shape[-2])
        ctx.scale, ctx.iterations, ctx.parts = scale, iterations, parts
        if parts is None:
            res = _forward_piece(q, k, v, w, mask, causal, scale, iterations)
            if res is None:
                info[0] = False
                return q.new_empty(0)
            ctx.save_for_backward(k, v, w, *res[1])
            return res[0]
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        saved: list[Tensor] = []
        for bs, hs in parts:
            res = _forward_piece(q[bs, hs], k[bs, hs], v[bs, hs], _part(w, bs, hs), _part(mask, bs, hs),
                                 causal, scale, iterations)
            if res is None:
                info[0] = False
                return q.new_empty(0)
            out[bs, hs] = res[0]
            saved += res[1]
        ctx.save_for_backward(k, v, w, *saved)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "doubly/hybrid_normalized_attention (materialized)", _INSTEAD)
        k, v, w, *saved = ctx.saved_tensors
        dout = dout.to(v.dtype).contiguous()  # a stride-0 gradient (from .sum()) sends bmm to a slow path
        need_w = w is not None and ctx.needs_input_grad[3]
        parts = ctx.parts
        if parts is None:
            dq, dk, dv, drow = _backward_piece(dout, k, v, w, saved, ctx.scale, ctx.iterations, need_w)
            dw = None if drow is None or w is None else reduce_to(drow, w.shape)
            return dq, dk, dv, dw, None, None, None, None, None
        width = len(saved) // len(parts)
        dq = dout.new_empty(*dout.shape[:-1], k.shape[-1])
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dw = torch.zeros_like(w) if need_w and w is not None else None
        for i, (bs, hs) in enumerate(parts):
            cq, ck, cv, drow = _backward_piece(dout[bs, hs], k[bs, hs], v[bs, hs], _part(w, bs, hs),
                                               saved[i * width:(i + 1) * width], ctx.scale, ctx.iterations,
                                               need_w)
            dq[bs, hs], dk[bs, hs], dv[bs, hs] = cq, ck, cv
            wpart = _part(dw, bs, hs)
            if wpart is not None and drow is not None:
                wpart += reduce_to(drow, wpart.shape)
        return dq, dk, dv, dw, None, None, None, None, None


def materialized_sinkhorn(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool, scale: float,
    iterations: int,
) -> Tensor | None:
    """DNAS / Sinkhorn-K (``w=None``) or HNAS output ``(*batch, Nq, dv)``; ``None`` on underflow.

    ``q, k, v`` of one compute dtype, expanded to one batch shape, ``Nq, Nk >= 1``; ``mask``
    additive (not differentiated), broadcastable to ``(*batch, Nq, Nk)``; ``w`` shaped to
    broadcast against ``(…, H, Nq, Nk)``. Above one chunk (``B·H·Nq·Nk >
    THRESHOLDS.dnas_materialized_chunk_entries``) the caller passes 4-D ``(B, H, N, ·)``
    contiguous inputs (mask and ``w`` 4-D, batch / head dims of size 1 or full): they run chunk
    by chunk over (B, H).
    """
    info = [True]
    out: Tensor = _MaterializedSinkhorn.apply(q, k, v, w, mask, causal, scale, iterations, info)
    return out if info[0] else None


def no_grad_forward(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, causal: bool, scale: float, iterations: int,
) -> Tensor | None:
    """:class:`_MaterializedSinkhorn`'s forward when nothing is differentiated; ``None`` on underflow.

    Arguments as :func:`materialized_sinkhorn` without the mask; 4-D inputs above one chunk run
    chunk by chunk over (B, H) (:func:`_chunks`). Each piece: :func:`_no_grad_piece`.
    """
    parts = _pieces(q, k.shape[-2])
    if parts is None:
        return _no_grad_piece(q, k, v, w, causal, scale, iterations)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    b, h, nq, _ = q.shape
    largest = max(len(range(b)[bs]) * len(range(h)[hs]) for bs, hs in parts)
    work = q.new_empty(2, largest * nq * k.shape[-2])  # Sᵀ and E of a chunk, reused by every chunk
    for bs, hs in parts:
        piece = _no_grad_piece(q[bs, hs], k[bs, hs], v[bs, hs], _part(w, bs, hs), causal, scale, iterations,
                               work)
        if piece is None:
            return None
        out[bs, hs] = piece
    return out


def _no_grad_piece(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, causal: bool, scale: float, iterations: int,
    work: Tensor | None = None,
) -> Tensor | None:
    """One piece of :func:`no_grad_forward`; ``None`` on underflow. ``work``: a ``(2, ≥ G·Nk·Nq)``
    buffer for ``Sᵀ`` and ``E`` that the chunks share (fresh allocations per chunk cost page faults).

    No mask, and ``is_causal`` only with ``Nk <= Nq``: every row and column has an admissible
    entry, so no slice needs the zero-weight rule. Nothing is saved and the normalizations run
    on the *transposed* scores ``Sᵀ = K (scale·Q)ᵀ`` (the scale rides on the GEMM), so that the
    column softmax is a softmax over the contiguous last dim (at N = 256 one third cheaper than
    over dim −2). Sinkhorn-K's later steps: while the piece is small (below
    ``THRESHOLDS.dnas_no_grad_vector_entries``, where a pass costs less than a matrix-vector
    product's call) they rewrite ``E`` in place, row then column division; above, ``E`` is never
    rewritten and the steps are scaling vectors, ``π = diag(1/σ) E diag(b)`` with
    ``b = 1/(Eᵀ (1/σ))`` (column step) and ``σ = E b`` (row step): two matrix-vector products per
    iteration instead of four passes over ``E``, whose normalizers are checked as the first
    ``σ`` is (rare, never silent). The last row normalization divides the ``Nq × dv`` output
    instead of the weights (``P V = (E (b ⊙ V)) / σ``). HNAS mixes in the row softmax
    (over dim −2 of ``Sᵀ``) before one product with ``V``. (K = 1 in float32 on the CPU the
    router prefers the one C pass of :func:`.cpu.no_grad_small`.) The gains over the autograd
    Function are in the bench's forward rows (``attnopt bench --only small_n``). An underflowing
    first row sum (a dominated row) returns ``None``: the router recomputes with the reference.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    batch = q.shape[:-2]
    q3, k3 = q.reshape(-1, nq, q.shape[-1]), k.reshape(-1, nk, k.shape[-1])
    v3 = v.reshape(-1, nk, v.shape[-1])
    shape = (q3.shape[0], nk, nq)
    n = shape[0] * nk * nq
    st = torch.baddbmm(q3.new_empty(1, 1, 1), k3, q3.transpose(-2, -1), beta=0.0, alpha=scale,
                       out=None if work is None else work[0, :n].view(shape))  # (G, Nk, Nq)
    if causal:  # key j > query i is dropped
        st.masked_fill_(torch.ones(nk, nq, dtype=torch.bool, device=st.device).tril_(-1), float("-inf"))
    p_lnas = torch.softmax(st, -2) if w is not None else None
    # the column step: normalized over the queries of each key
    if work is None:
        e = torch.softmax(st, -1)
    else:  # into the shared buffer (torch.softmax has no out=)
        e = torch.ops.aten._softmax.out(st, -1, False, out=work[1, :n].view(shape))
    del st
    sigma = e.sum(-2, keepdim=True)  # (G, 1, Nq) row sums; >= 1 per column, only a row can underflow
    thr = torch.finfo(e.dtype).tiny * 2.0**40
    if float(sigma.min()) < thr:
        return None
    b = None  # π = diag(1/σ) E diag(b)
    if iterations > 1 and e.numel() >= THRESHOLDS.dnas_no_grad_vector_entries:  # E is never rewritten
        norms = [sigma.view(-1)]
        for _ in range(iterations - 1):
            c = torch.bmm(e, sigma.reciprocal().transpose(-2, -1))  # (G, Nk, 1): Σ_i E_ij / σ_i
            b = c.reciprocal()
            sigma = torch.bmm(b.transpose(-2, -1), e)  # (G, 1, Nq): Σ_j E_ij b_j
            norms += [c.view(-1), sigma.view(-1)]
        if float(torch.cat(norms).min()) < thr:  # one host read for every normalizer
            return None
    else:
        for _ in range(iterations - 1):  # after the first column step, sums stay >= 1/(Nq·Nk)
            e.div_(sigma)
            e.div_(e.sum(-1, keepdim=True))
            sigma = e.sum(-2, keepdim=True)
    if p_lnas is None or w is None:
        out = torch.bmm(e.transpose(-2, -1), v3 if b is None else v3 * b).div_(sigma.transpose(-2, -1))
    else:
        wf = w.reshape(-1, 1, 1) if w.dim() else w  # () or one per head, the heads last in the batch
        if wf.dim() and wf.shape[0] != e.shape[0]:
            wf = wf.repeat(e.shape[0] // wf.shape[0], 1, 1)
        (e if b is None else e.mul_(b)).div_(sigma)
        out = torch.bmm(p_lnas.lerp_(e, wf).transpose(-2, -1), v3)
    return out.view(*batch, nq, v.shape[-1])

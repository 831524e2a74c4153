r"""Materialized DNAS / Sinkhorn-K / HNAS in the probability domain (internal; CPU tensors).

The kernel the router runs while the scores fit in cache (``B·H·Nq·Nk`` up to
``THRESHOLDS.dnas_scaling_chunk_entries``; above, the chunked scaling form of :mod:`.scaling`):
it saves the weights instead of recomputing them, which wins at short sequences.

doubly-normalized-attention eq. (6)–(8), (10), Sec. 6. Scores ``S = scale·QKᵀ + M`` are formed
once; the normalizations run in place in the probability domain:

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

__all__ = ["materialized_sinkhorn", "no_grad_forward"]

_INSTEAD = "use doubly_normalized_weights / hybrid_normalized_weights(q, k, ...) @ v (plain ops)"


def _scores(qs: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """``S = (scale·Q) Kᵀ + M`` with the causal ``-inf`` (``qs`` is the pre-scaled ``Q``)."""
    s = torch.matmul(qs, k.transpose(-2, -1))
    if mask is not None:
        s.add_(mask)
    if causal:
        nq, nk = s.shape[-2], s.shape[-1]
        drop = torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu_(1)
        s.masked_fill_(drop, float("-inf"))
    return s


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


def _sinkhorn_forward(s: Tensor, masked: bool, iterations: int) -> tuple[Tensor, Tensor, list[Tensor]] | None:
    """``(P, σ, mids)``: ``mids = [E_1 … E_2K-1]``, or ``[]`` when K = 1 and ``E_1 = P σ``;
    ``None`` when the first row sum of an admissible row underflows."""
    e = _softmax_zero_empty(s, -2, masked)
    sigma = e.sum(-1, keepdim=True)
    thr = torch.finfo(e.dtype).tiny * 2.0**40
    if bool((sigma < thr).any()):
        valid = torch.isfinite(s).any(-1, keepdim=True) if masked else sigma == sigma
        if bool(((sigma < thr) & valid).any()):
            return None
        sigma = torch.where(sigma > 0, sigma, torch.ones_like(sigma))  # rows without admissible key
    if iterations == 1:
        return e.div_(sigma), sigma, []
    mids = [e]
    e = e / sigma
    for _ in range(iterations - 1):
        mids.append(e)
        e = e / _safe_sum(e, -2)
        mids.append(e)
        e = e / _safe_sum(e, -1)
    return e, sigma, mids


def _sinkhorn_backward(g: Tensor, p: Tensor, sigma: Tensor, mids: list[Tensor], iterations: int) -> Tensor:
    """Apply ``G ← G − E_k ⊙ Σ_{dim_k} G`` for ``k = 2K−1 … 1`` (in place on ``g``)."""
    for idx in range(2 * iterations - 2, -1, -1):
        dim = -2 if idx % 2 == 0 else -1
        e = mids[idx] if mids else p * sigma
        g.addcmul_(e, g.sum(dim, keepdim=True), value=-1.0)
    return g


class _MaterializedSinkhorn(torch.autograd.Function):
    """DNAS / Sinkhorn-K (``w is None``) or HNAS (``w`` given) on materialized scores.

    Sets ``info[0] = False`` (and returns an empty tensor) when a row sum underflows.

    ``forward(ctx, …)`` style on purpose: returning the saved intermediates as outputs for a
    ``setup_context`` cost ~40 µs per call, a tenth of the whole call at N = 64.
    """

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool,
        scale: float, iterations: int, info: list[bool],
    ) -> Tensor:
        qs = q * scale  # N·d work instead of scaling the N × N scores; reused by dK
        s = _scores(qs, k, mask, causal)
        masked = mask is not None or causal
        p_lnas = _softmax_zero_empty(s, -1, masked) if w is not None else None
        res = _sinkhorn_forward(s, masked, iterations)
        del s
        if res is None:
            info[0] = False
            return q.new_empty(0)
        p, sigma, mids = res
        ctx.scale, ctx.iterations, ctx.hybrid = scale, iterations, w is not None
        if w is None or p_lnas is None:
            out = torch.matmul(p, v)
            ctx.save_for_backward(k, v, w, out, qs, p, sigma, *mids)
            return out
        mix = torch.lerp(p_lnas, p, w)
        out = torch.matmul(mix, v)
        ctx.save_for_backward(k, v, w, out, qs, p, sigma, *mids, mix, p_lnas)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "doubly/hybrid_normalized_attention (materialized)", _INSTEAD)
        k, v, w, out, qs, p, sigma, *rest = ctx.saved_tensors
        dout = dout.to(v.dtype).contiguous()  # a stride-0 gradient (from .sum()) sends bmm to a slow path
        dp = torch.matmul(dout, v.transpose(-2, -1))
        dw = None
        if not ctx.hybrid:
            mids = rest
            dv = torch.matmul(p.transpose(-2, -1), dout)
            delta = (dout * out).sum(-1, keepdim=True)
            g = dp.sub_(delta).mul_(p)
            ds = _sinkhorn_backward(g, p, sigma, mids, ctx.iterations)
        else:
            *mids, mix, p_lnas = rest
            dv = torch.matmul(mix.transpose(-2, -1), dout)
            a = p * dp
            b = dp.mul_(p_lnas)
            ra, rb = a.sum(-1, keepdim=True), b.sum(-1, keepdim=True)
            if ctx.needs_input_grad[3]:
                dw = reduce_to(ra - rb, w.shape)  # Σ (P^D − P^L) ⊙ dP from the row sums
            a.addcmul_(p, ra, value=-1.0)
            gd = _sinkhorn_backward(a, p, sigma, mids, ctx.iterations)
            b.addcmul_(p_lnas, rb, value=-1.0)
            ds = torch.lerp(b, gd, w)
        dq = torch.matmul(ds, k).mul_(ctx.scale)
        dk = torch.matmul(ds.transpose(-2, -1), qs)
        return dq, dk, dv, dw, None, None, None, None, None


def materialized_sinkhorn(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool, scale: float,
    iterations: int,
) -> Tensor | None:
    """DNAS / Sinkhorn-K (``w=None``) or HNAS output ``(*batch, Nq, dv)``; ``None`` on underflow.

    ``q, k, v`` of one compute dtype, expanded to one batch shape, ``Nq, Nk >= 1``; ``mask``
    additive (not differentiated), broadcastable to ``(*batch, Nq, Nk)``; ``w`` shaped to
    broadcast against ``(…, H, Nq, Nk)``.
    """
    info = [True]
    out: Tensor = _MaterializedSinkhorn.apply(q, k, v, w, mask, causal, scale, iterations, info)
    return out if info[0] else None


def no_grad_forward(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, causal: bool, scale: float, iterations: int,
) -> Tensor | None:
    """:class:`_MaterializedSinkhorn`'s forward when nothing is differentiated; ``None`` on underflow.

    No mask, and ``is_causal`` only with ``Nk <= Nq``: every row and column has an admissible
    entry, so no slice needs the zero-weight rule. Nothing is saved and the normalizations run
    in place on the *transposed* scores ``Sᵀ = K (scale·Q)ᵀ`` (the scale rides on the GEMM), so
    that the column softmax is a softmax over the contiguous last dim (at N = 256 one third
    cheaper than over dim −2); the last row normalization divides the ``Nq × dv`` output instead
    of the weights (``P = diag(1/σ) E``: ``P V = (E V) / σ``). HNAS mixes in the row softmax
    (over dim −2 of ``Sᵀ``) before one product with ``V``. (K = 1 in float32 on the CPU the
    router prefers the one C pass of :func:`.cpu.no_grad_small`.) The gains over the autograd
    Function are in the bench's forward rows (``attnopt bench --only small_n``). An underflowing
    first row sum (a dominated row) returns ``None``: the router recomputes with the reference.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    batch = q.shape[:-2]
    q3, k3 = q.reshape(-1, nq, q.shape[-1]), k.reshape(-1, nk, k.shape[-1])
    v3 = v.reshape(-1, nk, v.shape[-1])
    st = torch.baddbmm(q3.new_empty(1, 1, 1), k3, q3.transpose(-2, -1), beta=0.0, alpha=scale)  # (G, Nk, Nq)
    if causal:  # key j > query i is dropped
        st.masked_fill_(torch.ones(nk, nq, dtype=torch.bool, device=st.device).tril_(-1), float("-inf"))
    p_lnas = torch.softmax(st, -2) if w is not None else None
    e = torch.softmax(st, -1)  # the column step: normalized over the queries of each key
    del st
    sigma = e.sum(-2, keepdim=True)  # (G, 1, Nq) row sums; >= 1 per column, only a row can underflow
    if float(sigma.min()) < torch.finfo(e.dtype).tiny * 2.0**40:
        return None
    for _ in range(iterations - 1):  # after the first column step, sums stay >= 1/(Nq·Nk)
        e.div_(sigma)
        e.div_(e.sum(-1, keepdim=True))
        sigma = e.sum(-2, keepdim=True)
    if p_lnas is None or w is None:
        out = torch.bmm(e.transpose(-2, -1), v3).div_(sigma.transpose(-2, -1))
    else:
        wf = w.reshape(-1, 1, 1) if w.dim() else w  # () or one per head, the heads last in the batch
        if wf.dim() and wf.shape[0] != e.shape[0]:
            wf = wf.repeat(e.shape[0] // wf.shape[0], 1, 1)
        out = torch.bmm(p_lnas.lerp_(e.div_(sigma), wf).transpose(-2, -1), v3)
    return out.view(*batch, nq, v.shape[-1])

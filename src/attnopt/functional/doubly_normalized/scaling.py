r"""Fused materialized DNAS, Sinkhorn-K and HNAS in scaling form: one exponential (internal).

doubly-normalized-attention eq. (6)–(8), (10) and Sec. 6 (design.md §3). Scores
``S = scale·QKᵀ + M`` (``-inf`` = dropped) are exponentiated once, shifted by their *column*
maxima, and never divided elementwise:

.. math:: E_{ij} = e^{S_{ij} - m_j},\quad m_j = \max_i S_{ij},\qquad
          \pi = \mathrm{diag}(α_K)\, E\, \mathrm{diag}(β_K)

Sinkhorn in scaling form: ``α_0 = 1``, ``β_t = 1/(Eᵀ α_{t−1})`` (column step; ``β_1 = 1/z``,
``z_j = Σ_i E_ij ≥ 1``), ``α_t = 1/(E β_t)`` (row step). DNAS (K = 1) needs no matvec: its
output ``out_i = α_i Σ_j E_ij β_j v_j`` and the last row sums come out of *one* matmul
``E @ [β⊙V | β]``; Sinkhorn-K adds ``2K − 2`` matvecs.

LNAS shares the same ``E``: with ``u_j = e^{m_j − μ}``, ``μ = max_j m_j``,
``softmax_j(S)_ij = E_ij u_j / ρ_i``, ``ρ_i = Σ_j E_ij u_j``, so HNAS
``out = w·out^D + (1 − w)·out^L`` is one matmul ``E @ [β⊙V | β | u⊙V | u]``.

Backward, closed form. ``∂L/∂S = E ⊙ ∂L/∂E`` (the column shift ``m`` cancels); with
``g = w·dO`` (DNAS: ``dO``) the direct term is ``diag(α_K) g Vᵀ diag(β_K)``, and each
normalization step adds a rank-one term: reversing the row step ``α_t = 1/(E β_t)`` gives
``c_t ⊗ β_t`` with ``c_t = −(∂L/∂α_t) α_t²`` and ``∂L/∂β_t = Eᵀ c_t``; reversing the column step
gives ``α_{t−1} ⊗ d_t`` with ``d_t = −(∂L/∂β_t) β_t²`` and ``∂L/∂α_{t−1} = E d_t``
(``∂L/∂α_K = <g, out^D>/α_K``). The LNAS share adds ``b_i u_j (dP_ij − δ^L_i)`` with
``b = (1 − w)/ρ``, ``dP = dO Vᵀ``, ``δ^L_i = <dO_i, out^L_i>``. So ``dS = E ⊙ (L Rᵀ)`` with
one matmul of inner width ``dv + 2K`` (HNAS ``2·dv + 2K + 1``); ``dV`` and ``∂L/∂β_K`` come from
one thin matmul ``Eᵀ [α_K⊙g | b⊙dO | c_K]``; ``∂L/∂w = Σ_i <dO_i, out^D_i − out^L_i>`` costs
O(N·dv). For K = 1 this is ``dS_ij = E_ij[(α_i β_j)(dP_ij − δ^D_i) − γ_j β_j]``.

Memory and speed. The batch × heads are processed in chunks of about
``THRESHOLDS.dnas_scaling_chunk_entries`` (:mod:`attnopt.functional._thresholds`) score
entries, so that the ``Nq × Nk`` temporaries stay in cache; one workspace per call is reused by
every chunk; the backward recomputes ``E`` of a chunk from its saved column maxima (bitwise the
same ops), so only O(N) state per head is kept between forward and backward.

Native passes. For K = 1 in float32 on CPU the router runs :mod:`.cpu` instead (the same math
with the elementwise work of each direction in C, every matmul at head width) when
``attnopt._native`` can build it; this module is its fallback.

Underflow. ``z_j ≥ 1``, but a later normalizer can underflow: ``σ_i`` for a row dominated by
other rows in every column, ``ρ_i`` for a row whose best score is far below the head's best.
When a normalizer of an admissible row or key falls below ``tiny·2^40`` the caller recomputes
with the log-domain reference (rare, never silent). A row with no
admissible key gets zeros, a key no query sees weight 0.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnopt.functional._autograd import reduce_to, refuse_double_backward
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["fused_sinkhorn"]

_INSTEAD = "use doubly_normalized_weights / hybrid_normalized_weights(q, k, ...) @ v (plain ops)"


def _scores(qs: Tensor, k: Tensor, mask: Tensor | None, causal: bool, work: Tensor) -> Tensor:
    """``S = qs kᵀ + M`` (causal ``-inf``) written into the front of the flat buffer ``work``."""
    shape = (*qs.shape[:-1], k.shape[-2])
    n = 1
    for x in shape:
        n *= x
    s = torch.matmul(qs, k.transpose(-2, -1), out=work[:n].view(shape))
    if mask is not None:
        s.add_(mask)
    if causal:
        nq, nk = s.shape[-2], s.shape[-1]
        s.masked_fill_(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def _row_valid(mask: Tensor | None, causal: bool, nq: int, nk: int, device: torch.device) -> Tensor | None:
    """Rows with an admissible key, ``(…, Nq, 1)`` bool broadcastable to the batch; ``None`` = all."""
    if mask is None:
        return None  # no mask: every row; causal alone: row i sees key 0
    fin = mask > float("-inf")  # masks are finite or -inf (validated): one pass, where isfinite is four
    if causal:
        fin = fin & torch.ones(nq, nk, dtype=torch.bool, device=device).tril_()
    return fin.any(-1, keepdim=True)


def _inv(x: Tensor) -> Tensor:
    """``1/x`` where ``x > 0``, else 0 (rows / columns without admissible entry)."""
    return torch.where(x > 0, x.reciprocal(), torch.zeros_like(x))


def _split(n: int, parts: int) -> list[slice]:
    """``range(n)`` cut into ``parts`` slices of near-equal length."""
    edges = [n * i // parts for i in range(parts + 1)]
    return [slice(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True) if hi > lo]


def _chunks(b: int, h: int, per_head: int) -> list[tuple[slice, slice]]:
    """(batch slice, head slice) pairs covering ``(b, h)``, about
    ``THRESHOLDS.dnas_scaling_chunk_entries`` entries each."""
    heads = max(1, THRESHOLDS.dnas_scaling_chunk_entries // max(per_head, 1))
    if b * h <= heads:
        return [(slice(None), slice(None))]
    if h <= heads:
        return [(bs, slice(None)) for bs in _split(b, -(-b * h // heads))]
    return [(slice(i, i + 1), hs) for i in range(b) for hs in _split(h, -(-h // heads))]


def _part(x: Tensor | None, bs: slice, hs: slice) -> Tensor | None:
    """``x[bs, hs]`` on a 4-D tensor whose batch / head dims may be broadcast (size 1)."""
    if x is None:
        return None
    return x[bs if x.shape[0] > 1 else slice(None), hs if x.shape[1] > 1 else slice(None)]


def _forward_chunk(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool, scale: float,
    iterations: int, work: Tensor,
) -> tuple[Tensor, tuple[Any, ...]] | None:
    """``(out, state for the backward)`` of one chunk, or ``None`` when a normalizer underflows.

    ``E`` lives in ``work`` (reused by the next chunk); the backward recomputes it from the
    column maxima ``m`` kept in the state (bitwise the same ops).
    """
    qs = q * scale
    e = _scores(qs, k, mask, causal, work)
    masked = mask is not None or causal
    m_raw = e.amax(-2, keepdim=True)  # (…, 1, Nk); -inf for a key no query sees
    m = torch.where(torch.isfinite(m_raw), m_raw, torch.zeros_like(m_raw)) if masked else m_raw
    e.sub_(m).exp_()
    thr = torch.finfo(e.dtype).tiny * 2.0**40
    dv = v.shape[-1]
    z = e.sum(-2, keepdim=True).transpose(-2, -1)  # (…, Nk, 1), >= 1 for a live key, 0 for a dead one
    alphas = [torch.ones_like(e[..., :1])]  # α_0 = 1, then α_t = 1 / (E β_t)
    betas = [_inv(z)]  # β_1 = 1/z, then β_t = 1 / (Eᵀ α_{t-1})
    valid: Tensor | None | bool = False  # rows with an admissible key, computed when first needed

    def underflow(den: Tensor, live: Tensor | None) -> bool:
        nonlocal valid
        low = den < thr
        if not bool(low.any()):
            return False
        if live is None:  # rows
            if valid is False:
                valid = _row_valid(mask, causal, q.shape[-2], k.shape[-2], q.device)
            live = valid if isinstance(valid, Tensor) else None
        return live is None or bool((low & live).any())

    for _ in range(iterations - 1):
        r = torch.matmul(e, betas[-1])
        if underflow(r, None):
            return None
        alphas.append(_inv(r))
        c = torch.matmul(e.transpose(-2, -1), alphas[-1])
        if underflow(c, z > 0):
            return None
        betas.append(_inv(c))
    beta = betas[-1]
    uc = None
    if w is None:
        t = torch.matmul(e, torch.cat([v * beta, beta], -1))
        dens = t[..., dv:]
    else:
        mu = m_raw.amax(-1, keepdim=True)
        mu = torch.where(torch.isfinite(mu), mu, torch.zeros_like(mu))
        uc = torch.exp(m_raw - mu).transpose(-2, -1)  # (…, Nk, 1), <= 1; 0 for a dead key
        t = torch.matmul(e, torch.cat([v * beta, beta, v * uc, uc], -1))
        dens = torch.cat([t[..., dv : dv + 1], t[..., 2 * dv + 1 :]], -1)
    if underflow(dens, None):
        return None
    alphas.append(_inv(t[..., dv : dv + 1]))
    od = t[..., :dv] * alphas[-1]
    if w is None:
        return od, (qs, k, v, (m, mask, causal), alphas, betas, od, None)
    binv = _inv(t[..., 2 * dv + 1 :])
    ol = t[..., dv + 1 : 2 * dv + 1] * binv
    return torch.lerp(ol, od, w), (qs, k, v, (m, mask, causal), alphas, betas, od, (w, uc, binv, ol))


def _backward_chunk(
    state: tuple[Any, ...], dout: Tensor, scale: float, need_qk: bool, need_w: bool, work: Tensor,
    work2: Tensor,
) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor | None]:
    """``(dq, dk, dv, ∂L/∂w per row (…, Nq, 1))`` of one chunk (see the module docstring)."""
    qs, k, v, (m, mask, causal), alphas, betas, od, hyb = state
    e = _scores(qs, k, mask, causal, work).sub_(m).exp_()
    dv_ = v.shape[-1]
    et = e.transpose(-2, -1)
    drow = None
    g = dout if hyb is None else dout * hyb[0]  # ∂L/∂out^D
    a_g = g * alphas[-1]
    cx = -(a_g * od).sum(-1, keepdim=True)  # −gα_K α_K² with gα_K = <g, out^D>/α_K
    thin = [a_g, cx]
    if hyb is not None:
        w, uc, binv, ol = hyb
        b_do = dout * (binv * (1 - w))
        thin.insert(1, b_do)
        if need_w:
            drow = (dout * (od - ol)).sum(-1, keepdim=True)
    mt = torch.matmul(et, torch.cat(thin, -1))
    ya = mt[..., :dv_]
    dv = ya * betas[-1]
    if hyb is not None:
        dv = dv + mt[..., dv_ : 2 * dv_] * uc
    if not need_qk:
        return None, None, dv, drow
    # reverse through the normalizations: row step t (α_t = 1/(E β_t)), column step t (β_t = 1/(Eᵀ α_{t-1}))
    gb = (v * ya).sum(-1, keepdim=True) + mt[..., -1:]
    lefts, rights = [a_g], [v * betas[-1]]
    iterations = len(betas)
    ga = gb  # ∂L/∂α_t, set by each column step before the row step below reads it
    for t in range(iterations, 0, -1):
        if t < iterations:  # row step t: α_t = 1/(E β_t)
            cx = -ga * alphas[t] * alphas[t]
            gb = torch.matmul(et, cx)
        lefts.append(cx)
        rights.append(betas[t - 1])
        cy = -gb * betas[t - 1] * betas[t - 1]  # column step t
        lefts.append(alphas[t - 1])
        rights.append(cy)
        if t > 1:
            ga = torch.matmul(e, cy)
    if hyb is not None:
        b_dl = (b_do * ol).sum(-1, keepdim=True)
        lefts += [b_do, -b_dl]
        rights += [v * uc, uc]
    ds = work2[: e.numel()].view(e.shape)
    torch.matmul(torch.cat(lefts, -1), torch.cat(rights, -1).transpose(-2, -1), out=ds).mul_(e)
    return torch.matmul(ds, k).mul_(scale), torch.matmul(ds.transpose(-2, -1), qs), dv, drow


class _FusedSinkhorn(torch.autograd.Function):
    """DNAS / Sinkhorn-K (``w is None``) or HNAS on 4-D ``(B, H, N, ·)`` inputs, chunked over (B, H).

    Sets ``info[0] = False`` (and returns an empty tensor) when a normalizer underflows. Only
    O(N) per-chunk state is kept (``E`` is recomputed in the backward), on ``ctx``: one
    autograd node, no per-chunk overhead; one ``N × N`` workspace per call is reused by every
    chunk (fresh allocations per chunk cost page faults).
    """

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool,
        scale: float, iterations: int, info: list[bool],
    ) -> Tensor:
        b, h, nq, _ = q.shape
        nk = k.shape[-2]
        parts = _chunks(b, h, nq * nk)
        work = q.new_empty(_largest(parts, b, h) * nq * nk)
        out = q.new_empty(b, h, nq, v.shape[-1]) if len(parts) > 1 else None
        states = []
        for bs, hs in parts:
            res = _forward_chunk(q[bs, hs], k[bs, hs], v[bs, hs], _part(w, bs, hs), _part(mask, bs, hs),
                                 causal, scale, iterations, work)
            if res is None:
                info[0] = False
                return q.new_empty(0)
            if out is None:
                out = res[0]
            else:
                out[bs, hs] = res[0]
            states.append(res[1])
        ctx.parts, ctx.states, ctx.scale = parts, states, scale
        ctx.shape_k, ctx.w_shape = k.shape, None if w is None else w.shape
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "doubly/hybrid_normalized_attention (materialized)", _INSTEAD)
        need_qk = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_w = ctx.w_shape is not None and ctx.needs_input_grad[3]
        states, parts = ctx.states, ctx.parts
        b, h, nq, dv_ = dout.shape
        n = _largest(parts, b, h) * nq * ctx.shape_k[-2]
        work, work2 = dout.new_empty(n), dout.new_empty(n if need_qk else 0)
        if len(parts) == 1:
            dq, dk, dv, drow = _backward_chunk(states[0], dout, ctx.scale, need_qk, need_w, work, work2)
            dw = None if drow is None else reduce_to(drow, ctx.w_shape)
            return dq, dk, dv, dw, None, None, None, None, None
        dq = dout.new_empty(b, h, nq, ctx.shape_k[-1]) if need_qk else None
        dk = dout.new_empty(ctx.shape_k) if need_qk else None
        dv = dout.new_empty(b, h, ctx.shape_k[-2], dv_)
        dw = dout.new_zeros(ctx.w_shape) if need_w else None
        for (bs, hs), state in zip(parts, states, strict=True):
            cq, ck, cv, drow = _backward_chunk(state, dout[bs, hs], ctx.scale, need_qk, need_w, work, work2)
            dv[bs, hs] = cv
            if dq is not None and dk is not None and cq is not None and ck is not None:
                dq[bs, hs], dk[bs, hs] = cq, ck
            if dw is not None and drow is not None:
                wpart = _part(dw, bs, hs)
                assert wpart is not None
                wpart += reduce_to(drow, wpart.shape)
        return dq, dk, dv, dw, None, None, None, None, None


def _largest(parts: list[tuple[slice, slice]], b: int, h: int) -> int:
    """The most (batch × head) slices in one chunk."""
    return max(len(range(b)[bs]) * len(range(h)[hs]) for bs, hs in parts)


def fused_sinkhorn(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool, scale: float,
    iterations: int,
) -> Tensor | None:
    """DNAS (``w=None``) or HNAS output on ``(B, H, N, ·)`` inputs of one dtype; ``None`` on underflow.

    ``q, k, v`` share their ``(B, H)`` (expanded); ``mask`` is additive (not differentiated) and
    ``w`` broadcastable to ``(B, H, 1, 1)``, both 4-D with batch / head dims of size 1 or full;
    ``Nq, Nk >= 1``.
    """
    info = [True]
    out: Tensor = _FusedSinkhorn.apply(q, k, v, w, mask, causal, scale, iterations, info)
    return out if info[0] else None

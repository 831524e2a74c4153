r"""Materialized DNAS / Sinkhorn-K / HNAS (internal): the dispatcher and the probability-domain fallback.

:func:`materialized_sinkhorn_attention` runs the fused scaling-form kernel of :mod:`._dnas_fused`
(one exponential, chunked over batch × heads, O(N) saved state) when the scores exceed one
cache-sized chunk (``B·H·Nq·Nk >`` :data:`FUSED_MIN_ENTRIES`), or, where its native C passes
apply (K = 1, float32, CPU: :mod:`._dnas_native`), from :data:`NATIVE_MIN_ENTRIES`. Smaller
problems, and any call where that kernel reports an underflowing normalizer, run
:class:`_MaterializedSinkhorn` below (it saves the weights instead of recomputing, which wins
while everything fits in cache — measured at d = 64, N = 64–256 — and handles a dominated row
in the log domain).

doubly-normalized-attention eq. (6)–(8), (10), Sec. 6. Scores ``S = scale·QKᵀ + M`` are formed
once; the normalizations run in place in the probability domain:

* column step: ``E ← softmax_i(S)`` (one fused kernel), later ``E ← E / Σ_i E``;
* row step: ``E ← E / Σ_j E``.

DNAS (K = 1) is therefore one column softmax, one row division and one matmul. After the
first column step every column has an entry ``>= 1/Nq``, so later sums stay ``>= 1/(Nq·Nk)``;
only the *first* row sum ``σ_i = Σ_j ξ_ij`` can underflow (a row dominated by other rows in
every column). When a row that has an admissible key gets ``σ_i < tiny·2^40``, the whole
call is recomputed in the log domain (same result, no underflow) — rare, never silent. That
test reads a value on the host, so it runs only for CPU tensors outside ``torch.compile``
(:func:`attnopt._validation.host_readable`); elsewhere (a GPU, meta / fake tensors, a compiled
graph) the log-domain form always runs, in one node with no host sync and no chunk loop.

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

from attnopt._validation import additive_mask, host_readable
from attnopt.functional import _dnas_fused, _dnas_native, dispatch
from attnopt.functional._autograd import records_graph, refuse_double_backward
from attnopt.functional._dnas_fused import _INSTEAD, _reduce_to, fused_sinkhorn

__all__ = ["materialized_sinkhorn_attention", "dispatched_sinkhorn"]

#: Above this many score entries (``B·H·Nq·Nk``) the scaling-form kernel of :mod:`._dnas_fused`
#: runs; at or below it the probability-domain kernel below (one cache-sized chunk).
FUSED_MIN_ENTRIES = _dnas_fused.CHUNK_ENTRIES

#: With the native passes (:mod:`._dnas_native`: K = 1, float32, CPU) the fused kernel runs from
#: this many score entries on (measured fwd+bwd, d = 64, 1 thread: at B·H·N² = 8·256² HNAS 1.30×
#: SDPA vs 1.77× here, DNAS 1.27× vs 1.30×; at 64·64² equal for DNAS; below, the kernel here wins).
NATIVE_MIN_ENTRIES = 1 << 18


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


def _log_domain(s: Tensor, iterations: int) -> list[Tensor]:
    """``E_1 … E_2K`` computed in the log domain (the fallback; no underflow of whole rows)."""
    out = []
    t = s
    for _ in range(iterations):
        for dim in (-2, -1):
            m = t.amax(dim, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            tot = torch.exp(t - m).sum(dim, keepdim=True)
            lse = torch.where(tot > 0, tot.log() + m, torch.zeros_like(m))
            t = t - lse
            out.append(torch.exp(t))
    return out


def _sinkhorn_forward(s: Tensor, masked: bool, iterations: int) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(P, σ, mids)``: ``mids = [E_1 … E_2K-1]``, or ``[]`` when K = 1 and ``E_1 = P σ``."""
    if not host_readable(s):  # no host read off the CPU: the log domain, exact for every row
        steps = _log_domain(s, iterations)
        return steps[-1], torch.ones_like(steps[-1][..., :1]), steps[:-1]
    e = _softmax_zero_empty(s, -2, masked)
    sigma = e.sum(-1, keepdim=True)
    thr = torch.finfo(e.dtype).tiny * 2.0**40
    if bool((sigma < thr).any()):
        valid = torch.isfinite(s).any(-1, keepdim=True) if masked else sigma == sigma
        if bool(((sigma < thr) & valid).any()):
            steps = _log_domain(s, iterations)
            return steps[-1], torch.ones_like(sigma), steps[:-1]
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

    ``forward(ctx, …)`` style on purpose: returning the saved intermediates as outputs for a
    ``setup_context`` cost ~40 µs per call, a tenth of the whole call at N = 64.
    """

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool,
        scale: float, iterations: int,
    ) -> Tensor:
        qs = q * scale  # N·d work instead of scaling the N × N scores; reused by dK
        s = _scores(qs, k, mask, causal)
        masked = mask is not None or causal
        p_lnas = _softmax_zero_empty(s, -1, masked) if w is not None else None
        p, sigma, mids = _sinkhorn_forward(s, masked, iterations)
        del s
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
                dw = _reduce_to(ra - rb, w.shape)  # Σ (P^D − P^L) ⊙ dP from the row sums
            a.addcmul_(p, ra, value=-1.0)
            gd = _sinkhorn_backward(a, p, sigma, mids, ctx.iterations)
            b.addcmul_(p_lnas, rb, value=-1.0)
            ds = torch.lerp(b, gd, w)
        dq = torch.matmul(ds, k).mul_(ctx.scale)
        dk = torch.matmul(ds.transpose(-2, -1), qs)
        return dq, dk, dv, dw, None, None, None, None


def materialized_sinkhorn_attention(
    q: Tensor, k: Tensor, v: Tensor, *, iterations: int, weight: Tensor | None, mask: Tensor | None,
    is_causal: bool, scale: float, batch: tuple[int, ...],
) -> Tensor:
    """DNAS / Sinkhorn-K (``weight=None``) or HNAS output ``(*batch, Nq, dv)`` (inputs validated).

    ``mask`` is additive, broadcastable to ``(*batch, Nq, Nk)`` (not differentiated); ``weight``
    is the HNAS mixing weight, shaped to broadcast against ``(…, H, Nq, Nk)``; ``batch`` is the
    broadcast batch shape of ``q, k, v``.
    """
    orig = q.dtype
    compute = torch.float32 if orig in (torch.float16, torch.bfloat16) else orig
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    if nq == 0 or nk == 0:
        zero = q.sum() * 0 + k.sum() * 0 + v.sum() * 0  # keeps the graph: zero gradients
        return zero.expand(*batch, nq, dv).to(orig).clone()
    qkv = []
    for x in (q, k, v):
        x = x if x.dtype == compute else x.to(compute)
        qkv.append(x if tuple(x.shape[:-2]) == batch else x.expand(*batch, *x.shape[-2:]))
    m = None if mask is None else mask.detach().to(compute)
    wc = None if weight is None or weight.dtype == compute else weight.to(compute)
    if wc is None:
        wc = weight
    entries = nq * nk
    for n in batch:
        entries *= n
    if not host_readable(qkv[0]):  # off the CPU / compiling: one node, log domain, no host read
        off: Tensor = _MaterializedSinkhorn.apply(*qkv, wc, m, is_causal, scale, iterations)
        return off.to(orig)
    if entries <= NO_GRAD_MAX_ENTRIES and m is None and not (is_causal and nk > nq) \
            and not records_graph(*qkv, wc):
        plain = _no_grad_forward(qkv[0], qkv[1], qkv[2], wc, is_causal, scale, iterations)
        if plain is not None:
            return plain if orig == compute else plain.to(orig)
    native = entries >= NATIVE_MIN_ENTRIES and _dnas_native.library(qkv[0], iterations) is not None
    if entries > FUSED_MIN_ENTRIES or native:  # more than one cache-sized chunk, or the C passes
        fused = _fused_4d(qkv, wc, m, is_causal, scale, batch, iterations)
        if fused is not None:
            return fused.to(orig)
    out: Tensor = _MaterializedSinkhorn.apply(*qkv, wc, m, is_causal, scale, iterations)
    return out.to(orig)


#: Without autograd, no mask (and no dead key), :func:`_no_grad_forward` runs up to this many
#: scores, ahead of the chunked native / fused kernels: nothing saved, one C call over all heads
#: (K = 1, float32) or in-place PyTorch ops. Measured (forward, no grad, d = 64, float32, 1 thread,
#: loaded 2-core machine, ms, chunked native -> this): B·H = 64, N = 64 (2^18) DNAS 1.40 -> 1.10,
#: HNAS 2.40 -> 1.26 (peer K = 1: 1.69); B·H = 8, N = 256 (2^19) 1.66 -> 1.47, 1.72 -> 1.57;
#: B·H = 64, N = 128 (2^20) 3.48 -> 3.19, 3.74 -> 3.90 (peer 8.3); Sinkhorn K = 3 at 2^19
#: 3.1 (fused) -> 2.3. Above it the chunked kernels keep the ``N × N`` work in cache.
NO_GRAD_MAX_ENTRIES = FUSED_MIN_ENTRIES


def _no_grad_forward(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, causal: bool, scale: float, iterations: int,
) -> Tensor | None:
    """:class:`_MaterializedSinkhorn`'s forward when nothing is differentiated; ``None`` on underflow.

    No mask, and ``is_causal`` only with ``Nk <= Nq``: every row and column has an admissible
    entry, so no slice needs the zero-weight rule. Nothing is saved and the normalizations run
    in place on the *transposed* scores ``Sᵀ = K (scale·Q)ᵀ`` (the scale rides on the GEMM), so
    that the column softmax is a softmax over the contiguous last dim (at N = 256 one third
    cheaper than over dim −2); the last row normalization divides the ``Nq × dv`` output instead
    of the weights (``P = diag(1/σ) E``: ``P V = (E V) / σ``). HNAS mixes in the row softmax
    (over dim −2 of ``Sᵀ``) before one product with ``V``. K = 1 in float32 with the native
    kernel built instead runs the C pass of :func:`._dnas_native.no_grad_small` (one call over
    all heads: ``P`` written over the scores, no softmax / division / mixing passes). Measured
    (B·H = 8, d = 64, float32, 1 thread, loaded 2-core machine, ms, the autograd Function ->
    this): N = 64 DNAS 0.25 -> 0.16 (PyTorch ops 0.17), HNAS 0.33 -> 0.19 (0.21), Sinkhorn
    K = 3 0.38 -> 0.23 (peer K = 1 / 3: 0.17 / 0.31); N = 256 Sinkhorn K = 3 4.8 -> 2.4 (peer 5-6).
    The function alone at N = 64: C pass 0.100 / 0.107 ms vs PyTorch ops 0.126 / 0.171 (DNAS / HNAS).
    An underflowing first row sum (a dominated row) returns ``None``: the caller recomputes with
    :class:`_MaterializedSinkhorn` (log domain).
    """
    nq, nk = q.shape[-2], k.shape[-2]
    batch = q.shape[:-2]
    q3, k3 = q.reshape(-1, nq, q.shape[-1]), k.reshape(-1, nk, k.shape[-1])
    v3 = v.reshape(-1, nk, v.shape[-1])
    lib = _dnas_native.library(q, iterations)
    if lib is not None:  # K = 1, float32, CPU: the C pass of _native/dnas.c over all heads at once
        wf = None if w is None else w.expand(*batch, 1, 1).reshape(-1).contiguous()
        out = _dnas_native.no_grad_small(lib, q3, k3, v3, wf, causal, scale)
        return None if out is None else out.view(*batch, nq, v.shape[-1])
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


def _fused_4d(
    qkv: list[Tensor], w: Tensor | None, mask: Tensor | None, causal: bool, scale: float,
    batch: tuple[int, ...], iterations: int,
) -> Tensor | None:
    """:func:`fused_sinkhorn` on ``(B, H, N, ·)`` views of batch-expanded inputs (``None`` on underflow)."""
    nq, nk = qkv[0].shape[-2], qkv[1].shape[-2]
    if len(batch) == 2:
        lead: tuple[int, ...] = batch
    elif len(batch) < 2:
        lead = (*(1,) * (2 - len(batch)), *batch)
    else:
        lead = (-1, batch[-1])
    q, k, v = (x.reshape(*lead, *x.shape[-2:]).contiguous() for x in qkv)  # one O(N·d) copy of a view
    if mask is not None:  # rank len(batch) + 2 (additive_mask)
        if len(batch) > 2:
            mask = mask.expand(*batch, nq, nk).reshape(*lead, nq, nk)
        else:
            mask = mask.reshape(*(1,) * (4 - mask.dim()), *mask.shape)
    if w is not None:  # () or one per head (…, H, 1, 1) with H the last batch dim
        w = w.reshape(*(1,) * (4 - w.dim()), *w.shape)
    out = fused_sinkhorn(q, k, v, w, mask, causal, scale, iterations)
    return None if out is None else out.reshape(*batch, nq, v.shape[-1])


def batch_shape(*xs: Tensor) -> tuple[int, ...]:
    """Broadcast batch shape (all dims but the last two) of ``xs``; cheap when they agree."""
    first = tuple(xs[0].shape[:-2])
    if all(tuple(x.shape[:-2]) == first for x in xs[1:]):
        return first
    return tuple(torch.broadcast_shapes(*(x.shape[:-2] for x in xs)))


def dispatched_sinkhorn(
    mechanism: str, q: Tensor, k: Tensor, v: Tensor, iterations: int, weight: Tensor | None,
    attn_mask: Tensor | None, scale: float, is_causal: bool, impl: str,
) -> Tensor | None:
    """The materialized result when ``impl`` resolves to it for these sizes, else ``None``.

    Records the choice in :data:`attnopt.functional.dispatch.last_dispatch`.
    """
    batch = batch_shape(q, k, v)
    g = 1
    for n in batch:
        g *= n
    path = dispatch.choose_impl(mechanism, nq=q.shape[-2], nk=k.shape[-2], batch=g, dtype=q.dtype, impl=impl)
    dispatch.record(mechanism, path)
    if path != "materialized":
        return None
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    mask = additive_mask(attn_mask, (*batch, q.shape[-2], k.shape[-2]), compute)
    return materialized_sinkhorn_attention(q, k, v, iterations=iterations, weight=weight, mask=mask,
                                           is_causal=is_causal, scale=scale, batch=batch)

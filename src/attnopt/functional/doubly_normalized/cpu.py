r"""Native (C) DNAS / HNAS (one Sinkhorn step) and Sinkhorn-K, float32 on CPU (internal; ``_native/dnas.c``).

DNAS in scaling form: ``E = e^{S − m}`` with column maxima ``m`` and ``π = diag(α) E diag(β)``
(doubly-normalized-attention eq. (6)–(8) and Sec. 6), with all ``Nq × Nk`` elementwise work of
each direction in one C call per chunk of heads, so that every matmul has the inner width of
the head (``d`` or ``dv``) instead of ``2·dv + 2`` and no elementwise pass leaves the cache:

* forward: ``S = (scale·Q) Kᵀ``; in C, per head: column maxima; ``E`` and its column sums ``z``
  (``β = 1/z``); per row ``r_i = Σ_j E_ij β_j`` (and ``ρ_i = Σ_j E_ij u_j``), then ``E`` is
  overwritten by the weights ``P = E ⊙ (w α_i β_j + (1 − w) u_j / ρ_i)`` (``α = 1/r``;
  DNAS: ``w = 1``); ``out = P V``. Saved: O(N) per head (``m, β, u, α, 1/ρ``).
* backward: ``S`` again and ``dP = dO Vᵀ``; in C, pass A rebuilds ``E`` (bitwise as in the
  forward) with the row terms ``δ^D_i = <dO_i, out^D_i> = α_i Σ_j E_ij β_j dP_ij``,
  ``δ^L_i = <dO_i, out^L_i>`` and the column sums ``γ_j = Σ_i E_ij (w α_i dP_ij + c_i)``,
  ``c_i = −w α_i δ^D_i``; pass B writes
  ``dS_ij = E_ij [dP_ij f_ij + c_i β_j − β_j² γ_j − (1 − w) δ^L_i u_j / ρ_i]``,
  ``f_ij = w α_i β_j + (1 − w) u_j / ρ_i``, and ``P = E ⊙ f``; then ``dV = Pᵀ dO``,
  ``dQ = scale·dS K``, ``dK = dSᵀ (scale·Q)``, ``∂L/∂w = Σ_i (δ^D_i − δ^L_i)``.

That is the closed-form backward of the scaling form for K = 1 (``∂L/∂S = E ⊙ ∂L/∂E``, the
column shift ``m`` cancels; each normalization adds a rank-one term) applied elementwise.

Sinkhorn-K, K >= 2 (DNAS only; ``sk_fwd`` / ``sk_bwd``): ``β_1 = 1/z``, ``α_t = 1/(E β_t)``,
``β_{t+1} = 1/(Eᵀ α_t)``, ``π = diag(α_K) E diag(β_K)``. The forward's C call makes ``E`` and
one pass per step (the row step and, on the same row, the next column sums, or at the last step
``π``); ``out = π V``. The backward reverses the
steps: with ``A_K = ∂L/∂α_K`` (``A_K,i = Σ_j E_ij β_K,j dP_ij``) and ``B_K = Σ_i α_K,i E_ij dP_ij``,
``c_t = −A_t α_t²``, ``B_t += Eᵀ c_t``, ``d_t = −B_t β_t²``, ``A_{t−1} = E d_t``, and
``dS = E ⊙ (α_K β_Kᵀ ⊙ dP + Σ_t c_t β_tᵀ + α_{t−1} d_tᵀ)`` (``α_0 = 1``): K + 1 passes over ``E``.
The saved state is ``m``, ``β_1 … β_K`` and ``α_1 … α_K`` (O(K·N) per head).
Masks: a key-only mask ``(…, 1, Nk)`` is never added to ``S`` — a finite key bias
cancels in ``E`` (it shifts ``S_·j`` and ``m_j`` alike) and enters only the LNAS factor
``u_j = e^{m_j + b_j − μ}``; a dropped key gets ``m_j = +∞`` (``E_·j = 0``). ``is_causal`` is
applied inside the passes (no mask tensor, the hidden half is skipped); a full
``(…, Nq, Nk)`` mask is added to ``S``.

The C exponential is a polynomial (about 1.4 ulp; 0 below ``e^{−87}``); results agree with the
PyTorch kernel of :mod:`.materialized` to float32 rounding. A chunk holds about
``THRESHOLDS.dnas_cpu_chunk_entries`` scores per thread (``S`` and ``dP`` stay in a 2 MiB L2 cache); its heads
are split over ``torch.get_num_threads()`` threads (:func:`attnopt._native.parallel_rows`).
Underflow of a row normalizer of an admissible row returns ``None`` (the caller recomputes in
the log domain), as in :mod:`.materialized`.

The same passes are ``torch.library`` ops (issue 30 item 2), so that dynamo, ``torch.export`` and
the profiler see one op each way: ``attnopt::dn_fwd(q, k, v, w, mask, causal, scale) -> (out, m,
β, u, α, 1/β', ok)`` (:func:`dn_forward`; ``ok`` a 0-d bool, False on an underflowing admissible
row, so the output shapes follow from the input shapes for the fake implementation) and
``attnopt::dn_bwd`` (:func:`dn_backward`), connected by ``register_autograd``. Plain eager code
(the router, :func:`native_sinkhorn`) calls the same two functions through the autograd Function
:class:`_NativeSinkhorn`: PyTorch's Python ``custom_op`` path costs a fixed few tens of µs more
per call, several per cent of a forward+backward at the smallest sizes (figures in the commit
that added the ops and in the issue-30 note). Both agree bitwise
(``tests/functional/test_dnas_ops.py``).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import fail, require, require_size
from attnopt.functional._autograd import reduce_to, refuse_double_backward
from attnopt.functional._func_ops import merge_batch, split_batch, transform_function
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["TRANSFORM_FUNCTION", "library", "native_sinkhorn", "no_grad_small"]

_I64, _INT = ctypes.c_int64, ctypes.c_int


def library(q: Tensor, iterations: int) -> ctypes.CDLL | None:
    """The compiled ``dnas.c`` when the native path applies (K >= 1, float32, CPU), else ``None``."""
    if iterations < 1 or q.dtype != torch.float32 or q.device.type != "cpu" or not _native.has_storage(q):
        return None
    return _native.library("dnas")


_p = _native.pointer


def _chunks(g: int, per_head: int) -> list[tuple[int, int]]:
    """Head ranges ``[h0, h1)`` of about ``THRESHOLDS.dnas_cpu_chunk_entries`` scores per thread."""
    step = max(1, THRESHOLDS.dnas_cpu_chunk_entries * max(1, torch.get_num_threads()) // max(per_head, 1))
    return [(h, min(h + step, g)) for h in range(0, g, step)]


def _heads(call: Any, h0: int, h1: int, per_head: int) -> None:
    """``call(a, b)`` over the absolute heads ``[h0, h1)``, split over threads."""
    _native.parallel_rows(lambda a, b: call(h0 + a, h0 + b), h1 - h0, per_head)


def _flat(x: Tensor | None, b: int, h: int, tail: tuple[int, ...]) -> Tensor | None:
    """``x`` broadcast to ``(b, h, *tail)`` as a contiguous ``(b·h, *tail)`` float32 tensor."""
    if x is None:
        return None
    return x.expand(b, h, *tail).reshape(b * h, *tail).contiguous()


def _add_mask(s: Tensor, full: Tensor, h: int, h0: int, h1: int) -> None:
    """``s += mask`` for the flat heads ``[h0, h1)`` (``mask`` 4-D, batch / head dims 1 or full):
    the whole batches of the range in one broadcast add, a partial batch at either end by itself."""
    b0, b1 = -(-h0 // h), h1 // h  # the whole batches [b0, b1)
    if b0 < b1:
        mb = full[b0:b1] if full.shape[0] > 1 else full
        s[b0 * h - h0 : b1 * h - h0].view(-1, h, *s.shape[1:]).add_(mb)
        parts = [(h0, b0 * h), (b1 * h, h1)]
    else:  # no whole batch: the range lies in at most two batches
        mid = (h0 // h + 1) * h
        parts = [(h0, min(h1, mid)), (mid, h1)]
    for lo, hi in parts:
        if lo < hi:
            bi = lo // h
            mb = full[bi if full.shape[0] > 1 else 0]
            s[lo - h0 : hi - h0].add_(mb[lo - bi * h : hi - bi * h] if mb.shape[0] > 1 else mb)


def _score_chunks(qs: Tensor, k3: Tensor, full: Tensor | None, h: int) -> Iterator[tuple[int, int, Tensor]]:
    """``(h0, h1, S)`` per chunk of heads (:func:`_chunks`): ``S = (scale·Q) Kᵀ`` (plus the full mask)
    of the heads ``[h0, h1)`` as a dense ``(h1 − h0, Nq, Nk)`` view of one workspace that every
    chunk reuses (the caller is done with a chunk's ``S`` before it asks for the next)."""
    g, nq, nk = qs.shape[0], qs.shape[1], k3.shape[1]
    parts = _chunks(g, nq * nk)
    work = qs.new_empty((parts[0][1] - parts[0][0]) * nq * nk)
    for h0, h1 in parts:
        ws = work[: (h1 - h0) * nq * nk].view(-1, nq, nk)
        s = torch.bmm(qs[h0:h1], k3[h0:h1].transpose(-2, -1), out=ws)
        if full is not None:
            _add_mask(s, full, h, h0, h1)
        yield h0, h1, s


def _admissible_rows(full: Tensor | None, kbias: Tensor | None, causal: bool, b: int, h: int, nq: int,
                     nk: int) -> Tensor:
    """``(B·H, Nq)``: the rows with an admissible key (the others get zeros, whatever their sums).

    A full mask alone is reduced before it is broadcast over the batch / heads it omits (query
    padding: ``(B, 1, Nq, Nk)``, one pass over it, not over ``B·H·Nq·Nk`` entries); masks are
    finite or ``-inf`` (validated), so ``> -inf`` is ``isfinite``.
    """
    if full is not None and kbias is None and not causal:
        return (full > float("-inf")).any(-1).expand(b, h, nq).reshape(b * h, nq)
    fin = torch.ones(b * h, nq, nk, dtype=torch.bool)
    if full is not None:
        fin = fin & torch.isfinite(full).expand(b, h, nq, nk).reshape(b * h, nq, nk)
    if kbias is not None:
        fin = fin & torch.isfinite(kbias)
    if causal:
        fin = fin & torch.ones(nq, nk, dtype=torch.bool).tril_()
    return fin.any(-1)


def _check_dn(
    s: Tensor, dp: Tensor | None, h0: int, h1: int, g: int, nq: int, nk: int, kbias: Tensor | None,
    w: Tensor | None, m: Tensor, beta: Tensor, u: Tensor | None, alpha: Tensor, binv: Tensor | None,
    rs: Tensor | None, rho: Tensor | None, drow: Tensor | None,
) -> None:
    """What ``dn_fwd`` (``dp`` None) / ``dn_bwd`` read and write for the heads ``[h0, h1)`` of ``G``: the
    chunk's dense ``(h1 − h0, Nq, Nk)`` scores ``s`` (and ``dp``), per absolute head ``Nk`` entries of
    ``kbias``, ``m``, ``beta``, ``u``, ``Nq`` of ``alpha``, ``binv``, ``rs``, ``rho``, ``drow``, one of ``w``;
    HNAS (``w`` given) needs ``u``, ``binv`` (and ``rho`` in the forward)."""
    kernel = "dn_fwd" if dp is None else "dn_bwd"
    _check_heads(kernel, s, dp, h0, h1, g, nq, nk, (
        ("kbias", kbias, nk), ("w", w, 1), ("m", m, nk), ("beta", beta, nk), ("u", u, nk),
        ("alpha", alpha, nq), ("binv", binv, nq), ("rs", rs, nq), ("rho", rho, nq), ("drow", drow, nq)))
    if w is not None and (u is None or binv is None or (dp is None and rho is None)):
        raise fail(kernel, None, "HNAS (w given) without u / binv / rho")
    if dp is None and rs is None:
        raise fail(kernel, "rs", "missing")


def _check_sk(
    s: Tensor, dp: Tensor | None, h0: int, h1: int, g: int, nq: int, nk: int, kk: int, kbias: Tensor | None,
    m: Tensor, beta: Tensor, alpha: Tensor, rs: Tensor | None,
) -> None:
    """What ``sk_fwd`` (``dp`` None) / ``sk_bwd`` read and write for the heads ``[h0, h1)`` of ``G``: the
    chunk's dense ``(h1 − h0, Nq, Nk)`` scores ``s`` (and ``dp``), per absolute head ``Nk`` entries of
    ``kbias`` and ``m``, ``K·Nk`` of ``beta``, ``K·Nq`` of ``alpha``, ``Nq`` of ``rs`` (forward)."""
    kernel = "sk_fwd" if dp is None else "sk_bwd"
    require_size(kernel, "iterations", kk, at_least=1)
    _check_heads(kernel, s, dp, h0, h1, g, nq, nk, (
        ("kbias", kbias, nk), ("m", m, nk), ("beta", beta, kk * nk), ("alpha", alpha, kk * nq),
        ("rs", rs, nq)))
    if dp is None and rs is None:
        raise fail(kernel, "rs", "missing")


def _check_heads(
    kernel: str, s: Tensor, dp: Tensor | None, h0: int, h1: int, g: int, nq: int, nk: int,
    vectors: tuple[tuple[str, Tensor | None, int], ...],
) -> None:
    """The checks ``dn_*`` and ``sk_*`` share: heads ``[h0, h1)`` inside ``[0, G)``, the chunk's dense
    float32 ``(h1 − h0, Nq, Nk)`` scores ``s`` (and ``dp``), and each given per-head vector
    ``(name, tensor, entries per head)`` dense float32 with ``G`` times its entries."""
    f32 = torch.float32
    if not 0 <= h0 <= h1 <= g:
        require_size(kernel, "h1", h1, at_least=h0, at_most=g)
        require_size(kernel, "h0", h0, at_most=h1)
    require(kernel, "s", s, dtype=f32, numel=(h1 - h0) * nq * nk)
    if dp is not None:
        require(kernel, "dp", dp, dtype=f32, numel=(h1 - h0) * nq * nk)
    for name, t, n in vectors:
        if t is not None:
            require(kernel, name, t, dtype=f32, numel=g * n)


def _operands(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, scale: float
) -> tuple[tuple[int, int, int, int, int, int], tuple[Tensor, Tensor, Tensor],
           tuple[bool, Tensor | None, Tensor | None]]:
    """What :func:`dn_forward` and :func:`dn_backward` both derive from their inputs:
    ``(B, H, Nq, Nk, dv, G = B·H)``, the per-head ``scale·q (G, Nq, d)``, ``k (G, Nk, d)``,
    ``v (G, Nk, dv)``, and the mask split (key-only?, the full ``(…, Nq, Nk)`` mask or None, the
    per-head weight ``w`` or None)."""
    b, h, nq, _ = q.shape
    nk, dv = k.shape[-2], v.shape[-1]
    g = b * h
    qs = (q * scale).reshape(g, nq, -1)
    k3, v3 = k.reshape(g, nk, -1), v.reshape(g, nk, dv)
    key_only = mask is not None and mask.shape[-2] == 1
    full = mask if mask is not None and not key_only else None
    return (b, h, nq, nk, dv, g), (qs, k3, v3), (key_only, full, _flat(w, b, h, (1, 1)))


@_native.untraced
def dn_forward(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool, scale: float,
    iterations: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out, m, β, u, α, 1/β', ok)``: the forward C passes (``dn_fwd``; Sinkhorn-K: ``sk_fwd``) of
    DNAS (``w`` None), Sinkhorn-K (``iterations`` K >= 2, ``w`` None) or HNAS (K = 1), on contiguous
    4-D ``(B, H, N, ·)`` float32 inputs; ``mask`` 4-D additive (key-only ``(…, 1, Nk)`` or full),
    detached.

    ``m, u (B·H, Nk)``, ``β (B·H, K·Nk)`` (``β_1 … β_K``), ``α (B·H, K·Nq)``, ``1/β' (B·H, Nq)`` are
    what the backward needs (``u``, ``1/β'`` empty but for HNAS); ``ok`` (0-d bool) is False when a
    row normalizer of an admissible row underflowed (at any of the K steps; then ``out`` is not to
    be used: the caller recomputes in the log domain). The body of the ``attnopt::dn_fwd`` op.
    """
    lib = _native.library("dnas")
    assert lib is not None
    (b, h, nq, nk, dv, g), (qs, k3, v3), (key_only, full, wv) = _operands(q, k, v, w, mask, scale)
    kbias = _flat(mask, b, h, (1, nk)) if key_only else None
    if iterations > 1:
        return _sk_forward(lib, (b, h, nq, nk, dv, g), qs, k3, v3, full, kbias, causal, iterations)
    m, beta = q.new_empty(g, nk), q.new_empty(g, nk)
    u = q.new_empty(g, nk) if w is not None else None
    alpha, rs = q.new_empty(g, nq), q.new_empty(g, nq)
    binv, rho = (q.new_empty(g, nq), q.new_empty(g, nq)) if w is not None else (None, None)
    out = q.new_empty(g, nq, dv)
    c = _INT(int(causal))
    for h0, h1, s in _score_chunks(qs, k3, full, h):
        _check_dn(s, None, h0, h1, g, nq, nk, kbias, wv, m, beta, u, alpha, binv, rs, rho, None)
        _heads(lambda a, e, s=s, h0=h0: lib.dn_fwd(
            _p(s), _I64(h0), _p(kbias), _p(wv), _p(m), _p(beta), _p(u), _p(alpha), _p(binv), _p(rs),
            _p(rho), _I64(a), _I64(e), _I64(nq), _I64(nk), c), h0, h1, nq * nk)
        torch.bmm(s, v3[h0:h1], out=out[h0:h1])
    thr = torch.finfo(torch.float32).tiny * 2.0**40
    dens = rs if rho is None else torch.minimum(rs, rho)
    low = dens < thr
    ok = not (bool(low.any()) and bool((low & _admissible_rows(full, kbias, causal, b, h, nq, nk)).any()))
    return (out.view(b, h, nq, dv), m, beta, q.new_empty(0) if u is None else u, alpha,
            q.new_empty(0) if binv is None else binv, torch.tensor(ok))  # (distinct empties: no aliasing)


def _sk_forward(
    lib: ctypes.CDLL, sizes: tuple[int, int, int, int, int, int], qs: Tensor, k3: Tensor, v3: Tensor,
    full: Tensor | None, kbias: Tensor | None, causal: bool, kk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`dn_forward` for Sinkhorn-K, K >= 2 (``sk_fwd`` of ``_native/dnas.c``)."""
    b, h, nq, nk, dv, g = sizes
    m, beta = qs.new_empty(g, nk), qs.new_empty(g, kk * nk)
    alpha, rs = qs.new_empty(g, kk * nq), qs.new_empty(g, nq)
    out = qs.new_empty(g, nq, dv)
    c = _INT(int(causal))
    for h0, h1, s in _score_chunks(qs, k3, full, h):
        _check_sk(s, None, h0, h1, g, nq, nk, kk, kbias, m, beta, alpha, rs)
        _heads(lambda a, e, s=s, h0=h0: lib.sk_fwd(
            _p(s), _I64(h0), _p(kbias), _p(m), _p(beta), _p(alpha), _p(rs), _I64(a), _I64(e), _I64(nq),
            _I64(nk), c, _I64(kk)), h0, h1, nq * nk)
        torch.bmm(s, v3[h0:h1], out=out[h0:h1])
    low = rs < torch.finfo(torch.float32).tiny * 2.0**40
    ok = not (bool(low.any()) and bool((low & _admissible_rows(full, kbias, causal, b, h, nq, nk)).any()))
    return (out.view(b, h, nq, dv), m, beta, qs.new_empty(0), alpha, qs.new_empty(0), torch.tensor(ok))


@_native.untraced
def dn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, m: Tensor,
    beta: Tensor, u: Tensor, alpha: Tensor, binv: Tensor, causal: bool, scale: float, need_w: bool,
    iterations: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, ∂L/∂w per row (B·H, Nq))`` of :func:`dn_forward` (``dn_bwd``, Sinkhorn-K
    ``sk_bwd``; the last empty unless ``need_w``), from the forward's inputs and its saved vectors.
    The body of the ``attnopt::dn_bwd`` op."""
    lib = _native.library("dnas")
    assert lib is not None
    (b, h, nq, nk, dv_, g), (qs, k3, v3), (key_only, full, wv) = _operands(q, k, v, w, mask, scale)
    kk = iterations
    hyb = w is not None
    uu, bb = (u, binv) if hyb else (None, None)
    d3 = dout.reshape(g, nq, dv_).contiguous()
    dq, dk, dvv = torch.empty_like(qs), torch.empty_like(k3), torch.empty_like(v3)
    drow = qs.new_empty(g, nq) if need_w and hyb else None
    parts = _chunks(g, nq * nk)
    n = (parts[0][1] - parts[0][0]) * nq * nk
    work, work2 = qs.new_empty(n), qs.new_empty(n)
    c = _INT(int(causal))
    for h0, h1 in parts:
        size = (h1 - h0) * nq * nk
        s = torch.bmm(qs[h0:h1], k3[h0:h1].transpose(-2, -1), out=work[:size].view(-1, nq, nk))
        if full is not None:
            _add_mask(s, full, h, h0, h1)
        dp = torch.bmm(d3[h0:h1], v3[h0:h1].transpose(-2, -1), out=work2[:size].view(-1, nq, nk))
        if kk > 1:
            _check_sk(s, dp, h0, h1, g, nq, nk, kk, None, m, beta, alpha, None)
            _heads(lambda a, e, s=s, dp=dp, h0=h0: lib.sk_bwd(
                _p(s), _p(dp), _I64(h0), _p(m), _p(beta), _p(alpha), _I64(a), _I64(e), _I64(nq), _I64(nk), c,
                _I64(kk)), h0, h1, nq * nk)
        else:
            _check_dn(s, dp, h0, h1, g, nq, nk, None, wv, m, beta, uu, alpha, bb, None, None, drow)
            _heads(lambda a, e, s=s, dp=dp, h0=h0: lib.dn_bwd(
                _p(s), _p(dp), _I64(h0), _p(wv), _p(m), _p(beta), _p(uu), _p(alpha), _p(bb), _p(drow),
                _I64(a), _I64(e), _I64(nq), _I64(nk), c), h0, h1, nq * nk)
        torch.bmm(s.transpose(-2, -1), d3[h0:h1], out=dvv[h0:h1])
        torch.bmm(dp, k3[h0:h1], out=dq[h0:h1])
        torch.bmm(dp.transpose(-2, -1), qs[h0:h1], out=dk[h0:h1])
    dq.mul_(scale)
    return (dq.view(b, h, nq, -1), dk.view(b, h, nk, -1), dvv.view(b, h, nk, dv_),
            qs.new_empty(0) if drow is None else drow)


class _NativeSinkhorn(torch.autograd.Function):
    """:func:`dn_forward` / :func:`dn_backward` as one autograd node (plain eager calls); ``info[0]``
    is set False on underflow (the output is then empty)."""

    @staticmethod
    @_native.untraced
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool,
        scale: float, iterations: int, info: list[bool],
    ) -> Tensor:
        out, m, beta, u, alpha, binv, ok = dn_forward(q, k, v, w, mask, causal, scale, iterations)
        if not bool(ok):
            info[0] = False
            return q.new_empty(0)
        ctx.save_for_backward(q, k, v, w, mask, m, beta, u, alpha, binv)
        ctx.causal, ctx.scale, ctx.iterations = causal, scale, iterations
        return out

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "DNAS/HNAS (native C path)", "use *_normalized_weights(...) @ v")
        q, k, v, w, mask, m, beta, u, alpha, binv = ctx.saved_tensors
        need_w = w is not None and ctx.needs_input_grad[3]
        dq, dk, dv, drow = dn_backward(dout, q, k, v, w, mask, m, beta, u, alpha, binv, ctx.causal, ctx.scale,
                                       need_w, ctx.iterations)
        dw = reduce_to(drow.view(*q.shape[:3], 1), w.shape) if need_w else None
        return dq, dk, dv, dw, None, None, None, None, None


@_native.untraced
def no_grad_small(
    lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, causal: bool, scale: float,
) -> Tensor | None:
    """DNAS / HNAS (K = 1) forward without autograd on 3-D ``(G, N, ·)`` float32, no mask (and
    ``is_causal`` only with ``Nk <= Nq``: every row and key admissible); ``None`` on underflow.

    One C call over all heads (up to ``THRESHOLDS.dnas_materialized_chunk_entries``
    scores, split over threads by heads) on scores scaled in the GEMM, then ``P V``: no autograd
    Function, no chunking, one flat buffer for the per-head vectors. ``w``: ``None``
    (DNAS) or a float32 tensor of ``G`` contiguous entries.
    """
    g, nq, _ = q.shape
    nk = k.shape[-2]
    s = torch.baddbmm(q.new_empty(1, 1, 1), q, k.transpose(-2, -1), beta=0.0, alpha=scale)
    hyb = w is not None
    per_k, per_q = (3 if hyb else 2) * g * nk, (4 if hyb else 2) * g * nq
    buf = q.new_empty(per_k + per_q)
    base, f = buf.data_ptr(), 4  # float32: m, beta, [u] | rs, [rho], alpha, [binv]
    m, beta = base, base + g * nk * f
    u = base + 2 * g * nk * f if hyb else None
    rs = base + per_k * f
    rho = rs + g * nq * f if hyb else None
    alpha = rs + (2 if hyb else 1) * g * nq * f
    binv = alpha + g * nq * f if hyb else None
    ptr = ctypes.c_void_p
    c = _INT(int(causal))
    require("dn_fwd", "s", s, dtype=torch.float32, numel=g * nq * nk)
    require("dn_fwd", "buf", buf, dtype=torch.float32, numel=per_k + per_q)
    if w is not None:
        require("dn_fwd", "w", w, dtype=torch.float32, numel=g)
    _native.parallel_rows(lambda a, e: lib.dn_fwd(
        ptr(s.data_ptr()), _I64(0), None, _p(w), ptr(m), ptr(beta), None if u is None else ptr(u), ptr(alpha),
        None if binv is None else ptr(binv), ptr(rs), None if rho is None else ptr(rho), _I64(a), _I64(e),
        _I64(nq), _I64(nk), c), g, nq * nk)
    dens = buf[per_k : per_k + (2 if hyb else 1) * g * nq]  # rs (and rho): every row is admissible
    if float(dens.min()) < torch.finfo(torch.float32).tiny * 2.0**40:
        return None
    return torch.bmm(s, v)


def native_sinkhorn(
    _lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool,
    scale: float, iterations: int = 1,
) -> Tensor | None:
    """DNAS / Sinkhorn-K (``w=None``, ``iterations`` K >= 1) or HNAS (K = 1) on contiguous
    ``(B, H, N, ·)`` float32; ``None`` on underflow.

    ``q, k, v`` share their ``(B, H)``; ``mask`` additive (not differentiated) and ``w`` broadcastable
    to ``(B, H, 1, 1)``, both 4-D with batch / head dims of size 1 or full; ``Nq, Nk >= 1``.
    """
    info = [True]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out: Tensor = _NativeSinkhorn.apply(q, k, v, w, mask, causal, scale, iterations, info)
    return out if info[0] else None


# --- the same passes as torch.library ops (issue 30 item 2) -----------------------------------------


@torch.library.custom_op("attnopt::dn_fwd", mutates_args=(), device_types="cpu")
def dn_fwd(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool, scale: float,
    iterations: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(out, m, β, u, α, 1/β', ok)`` of DNAS / Sinkhorn-K (``w`` None) / HNAS (K = 1)
    (:func:`dn_forward`).

    ``out`` is always the answer: where the C passes report an underflowing normalizer (``ok``
    False), or the library cannot be used when the op runs (no compiler, ``ATTNOPT_NATIVE=0``), the
    op recomputes ``out`` in the log domain (:data:`FALLBACK`, the family's reference) inside its
    body — a CPU op may read its own flag — so a compiled or exported graph holds this one op and
    no data-dependent branch. ``dn_bwd`` does the same for the gradients.
    """
    res: tuple[Tensor, ...]
    if _native.library("dnas") is None:
        res = _no_library(q, k, v, w, iterations)
    else:
        res = dn_forward(q.contiguous(), k.contiguous(), v.contiguous(), w, mask, causal, scale, iterations)
    if bool(res[-1]):
        return res  # type: ignore[return-value]
    out = _fallback(q, k, v, w, mask, causal, scale, iterations).contiguous()
    return (out, *res[1:])  # type: ignore[return-value]


#: The log-domain recomputation of :func:`dn_fwd` / :func:`dn_bwd` on an underflow or without the C
#: library: ``reference.attention`` of this family, set by the router (``doubly_normalized/__init__``)
#: so that this leaf does not import another leaf.
FALLBACK: list[Callable[..., Tensor]] = []


def _fallback(q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool,
              scale: float, iterations: int) -> Tensor:
    """The log domain on the op's 4-D inputs (``w`` broadcasting as ``(…, H, ·, 1)``)."""
    return FALLBACK[0](q, k, v, iterations, w, mask, scale, causal)


def _fallback_grads(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool,
    scale: float, need_w: bool, iterations: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dn_bwd``'s outputs from the log-domain recomputation (``torch.func.vjp``: autograd is off
    inside an op's body, functorch's transform is not); ``∂L/∂w`` per row through a per-row copy
    of ``w``."""
    b, h, nq, _ = q.shape
    wr = None if w is None else w.expand(b, h, 1, 1).expand(b, h, nq, 1).contiguous()
    if wr is None or not need_w:
        def fn(a: Tensor, b_: Tensor, c: Tensor) -> Tensor:
            return _fallback(a, b_, c, wr, mask, causal, scale, iterations)

        vjp = torch.func.vjp(fn, q, k, v)[1]
        dq, dk, dv = vjp(dout)
        return dq, dk, dv, q.new_zeros(0)
    vjp = torch.func.vjp(lambda a, b_, c, d: _fallback(a, b_, c, d, mask, causal, scale, 1), q, k, v, wr)[1]
    dq, dk, dv, dw = vjp(dout)
    return dq, dk, dv, dw.reshape(b * h, nq)


def _no_library(q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, iterations: int) -> tuple[Tensor, ...]:
    """``dn_fwd``'s outputs as zeros (the fake implementation's shapes) with ``ok`` False."""
    b, h, nq, _ = q.shape
    nk, dv = k.shape[-2], v.shape[-1]
    g, hyb = b * h, w is not None

    def z(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=q.dtype, device=q.device)

    kk = iterations
    return (z(b, h, nq, dv), z(g, nk), z(g, kk * nk), z(g, nk) if hyb else z(0), z(g, kk * nq),
            z(g, nq) if hyb else z(0), torch.zeros((), dtype=torch.bool, device=q.device))


@dn_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, causal: bool,  # noqa: ARG001
      scale: float, iterations: int = 1,  # noqa: ARG001
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, nq, _ = q.shape
    nk, dv = k.shape[-2], v.shape[-1]
    g, hyb = b * h, w is not None
    u = q.new_empty(g, nk) if hyb else q.new_empty(0)
    binv = q.new_empty(g, nq) if hyb else q.new_empty(0)
    return (q.new_empty(b, h, nq, dv), q.new_empty(g, nk), q.new_empty(g, iterations * nk), u,
            q.new_empty(g, iterations * nq), binv, q.new_empty((), dtype=torch.bool))


@torch.library.custom_op("attnopt::dn_bwd", mutates_args=(), device_types="cpu")
def dn_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None, m: Tensor,
    beta: Tensor, u: Tensor, alpha: Tensor, binv: Tensor, ok: Tensor, causal: bool, scale: float,
    need_w: bool, iterations: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, ∂L/∂w per row)`` of :func:`dn_fwd` (:func:`dn_backward`); where ``dn_fwd``
    reported ``ok`` False, the gradients of its log-domain recomputation (:func:`_fallback_grads`)."""
    if not bool(ok) or _native.library("dnas") is None:
        return _fallback_grads(dout, q, k, v, w, mask, causal, scale, need_w, iterations)
    return dn_backward(dout, q.contiguous(), k.contiguous(), v.contiguous(), w, mask, m, beta, u, alpha, binv,
                       causal, scale, need_w, iterations)


@dn_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, mask: Tensor | None,  # noqa: ARG001
      m: Tensor, beta: Tensor, u: Tensor, alpha: Tensor, binv: Tensor, ok: Tensor,  # noqa: ARG001
      causal: bool, scale: float, need_w: bool, iterations: int = 1,  # noqa: ARG001
      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    b, h, nq, _ = q.shape
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(b * h, nq) if need_w and w is not None else q.new_empty(0))


def _dn_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, w, mask, causal, scale, *rest = inputs
    _, m, beta, u, alpha, binv, ok = output
    ctx.causal, ctx.scale, ctx.iterations = causal, scale, (rest[0] if rest else 1)
    ctx.save_for_backward(q, k, v, w, mask, m, beta, u, alpha, binv, ok)


def _dn_backward(ctx: Any, dout: Tensor, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    """The op's backward: ``attnopt::dn_bwd`` (which handles an ``ok`` False forward itself)."""
    q, k, v, w, mask, m, beta, u, alpha, binv, ok = ctx.saved_tensors
    need_w = w is not None and ctx.needs_input_grad[3]
    dq, dk, dv, drow = torch.ops.attnopt.dn_bwd(dout, q, k, v, w, mask, m, beta, u, alpha, binv, ok,
                                                ctx.causal, ctx.scale, need_w, ctx.iterations)
    dw = reduce_to(drow.view(*q.shape[:3], 1), w.shape) if need_w else None
    return dq, dk, dv, dw, None, None, None, None


dn_fwd.register_autograd(_dn_backward, setup_context=_dn_setup)


# --- under torch.func: the ops' batching rules and a transform-friendly Function ------------------


@dn_fwd.register_vmap
def _dn_fwd_vmap(info: Any, in_dims: tuple, q: Tensor, k: Tensor, v: Tensor, w: Tensor | None,
                 mask: Tensor | None, causal: bool, scale: float, iterations: int = 1) -> tuple[tuple, tuple]:
    """``vmap`` of :func:`dn_fwd`: the vmapped examples folded into ``B`` (one call); the per-head
    state ``(B·H, ·)`` splits back per example, ``ok`` (one flag for the call) is shared."""
    size, lead = info.batch_size, q.shape[1] if in_dims[0] is not None else q.shape[0]
    args = [merge_batch(x, d, size, lead) for x, d in zip((q, k, v, w, mask), in_dims[:5], strict=True)]
    res = torch.ops.attnopt.dn_fwd(*args, causal, scale, iterations)
    parts = [split_batch(x, size) for x in res]
    return tuple(x for x, _ in parts), tuple(d for _, d in parts)


@dn_bwd.register_vmap
def _dn_bwd_vmap(info: Any, in_dims: tuple, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                 w: Tensor | None, mask: Tensor | None, m: Tensor, beta: Tensor, u: Tensor, alpha: Tensor,
                 binv: Tensor, ok: Tensor, causal: bool, scale: float, need_w: bool,
                 iterations: int = 1) -> tuple[tuple, tuple]:
    """``vmap`` of :func:`dn_bwd` (see :func:`_dn_fwd_vmap`); per-example ``ok`` flags are all-reduced
    (a flag False anywhere recomputes the whole call in the log domain: the same gradients)."""
    size = info.batch_size
    lead = dout.shape[1] if in_dims[0] is not None else dout.shape[0]
    heads = lead * q.shape[-3]
    four = [merge_batch(x, d, size, lead) for x, d in zip((dout, q, k, v, w, mask), in_dims[:6], strict=True)]
    state = [x if x.numel() == 0 and d is None else merge_batch(x, d, size, heads)
             for x, d in zip((m, beta, u, alpha, binv), in_dims[6:11], strict=True)]
    flag = ok.all() if in_dims[11] is not None else ok
    res = torch.ops.attnopt.dn_bwd(*four, *state, flag, causal, scale, need_w, iterations)
    parts = [split_batch(x, size) for x in res]
    return tuple(x for x, _ in parts), tuple(d for _, d in parts)


#: :func:`dn_fwd` with its registered backward as a setup-context-style Function, which
#: ``torch.func.grad`` / ``vjp`` / ``jacrev`` and ``vmap`` accept (:mod:`attnopt.functional._func_ops`)
TRANSFORM_FUNCTION = transform_function(
    torch.ops.attnopt.dn_fwd, _dn_setup, _dn_backward, "doubly_normalized_attention (C passes)",
    "use doubly_normalized_weights / hybrid_normalized_weights(q, k, ...) @ v (plain ops)",
)

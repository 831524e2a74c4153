r"""Doubly-normalized (DNAS), Sinkhorn-K and hybrid (HNAS) attention in O(N) memory.

doubly-normalized-attention eq. (6)–(8), (10) and Sec. 6 (design.md §3). With scores
``s_ij = scale <q_i, k_j> + m_ij``:

* LNAS (``iterations=0``): ``π_ij = softmax_j(s_ij)`` — ordinary attention.
* DNAS (``iterations=1``): normalize over queries, then over keys,
  ``π_ij = softmax_j(s_ij − c_j)``, ``c_j = logsumexp_i s_ij``.
* Sinkhorn-K: K (column, row) normalizations in the log domain; the last step is a row
  normalization, so the output is always a row-stochastic average of the values. As K grows
  ``π`` tends to the solution of the entropic OT problem (10) with row sums 1 and column
  sums ``Nq/Nk``.
* HNAS: ``π = w π^DNAS + (1 − w) π^LNAS``.

Causal decoders (``causal``). A causal mask restricts the transport plan but does not make the
mechanism autoregressive: ``c_j = logsumexp_i s_ij`` runs over the *later* queries too, so row
``i`` would read queries after ``i``. ``causal="prefix"`` (the default with ``is_causal=True``)
runs the autoregressive variant of :mod:`._dn_prefix` (query ``i`` normalizes over queries
``≤ i`` only; materialized, never the fast paths below); ``causal="plan"`` keeps the masked plan
(for analysis). An ``attn_mask`` that happens to be causal is not inspected (that would read its
values): pass ``is_causal=True`` or ``causal="prefix"`` with it.

Size dispatch (``impl``). Below a measured crossover (:mod:`attnopt.functional.dispatch`)
``impl="auto"`` runs the fused materialized path of :mod:`._dnas_materialized` /
:mod:`._dnas_fused` (one exponential in scaling form, chunked over batch × heads so the
``N × N`` temporaries stay in cache, O(N) state saved for the backward);
``impl="streaming"`` (and ``auto`` above the crossover) is the flash-kernel O(N) path below.

Memory (streaming). The attention functions never form the ``Nq × Nk`` matrix, in forward or
backward, for no mask, ``is_causal`` with ``causal="plan"`` and key-only masks ``(B, H, 1, Nk)`` (key
padding); the autoregressive ``causal="prefix"`` variant is materialized (:mod:`._dn_prefix`). A mask of
shape ``(…, Nq, Nk)`` is itself ``Nq × Nk``; it is used as given (the passes then carry one
mask-sized temporary) — O(N) memory needs a key-only mask.

Dispatch (``_run_passes``): on CPU, PyTorch's fused flash kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` (all floating dtypes), with the
hand-fused backward of :mod:`._flash_cpu`; elsewhere, the blocked pure-PyTorch passes of
:mod:`._sinkhorn_chunked` (half precision computed in float32), which also serves
``is_causal`` with ``Nq != Nk`` on CPU. On CUDA tensors with Triton installed (or under
``attnopt.backend("triton")``) the Triton kernels of :mod:`attnopt.functional.triton.doubly_normalized`
run instead (``last_dispatch`` says ``"triton"``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt._validation import (
    additive_mask,
    causal_additive_mask,
    check_attention_inputs,
    device_assert,
    empty_attention,
    host_values,
    resolve_scale,
    validate_attention,
)
from attnopt.functional import _dn_prefix as prefix
from attnopt.functional import _flash_cpu as fc
from attnopt.functional import dispatch
from attnopt.functional import triton as gpu
from attnopt.functional._autograd import under_transform
from attnopt.functional._dnas_materialized import dispatched_sinkhorn
from attnopt.functional._dropout import check_dropout_p, dropout_attention
from attnopt.functional._sinkhorn_chunked import chunked_attn_pass, chunked_lse_pass
from attnopt.functional._softmax import safe_logsumexp, safe_softmax
from attnopt.functional.generalized import generalized_attention

__all__ = [
    "doubly_normalized_attention",
    "doubly_normalized_weights",
    "hybrid_normalized_attention",
    "hybrid_normalized_weights",
]

_HALF = (torch.float16, torch.bfloat16)


def _check_iterations(iterations: int) -> int:
    if isinstance(iterations, bool) or not isinstance(iterations, int):
        raise TypeError(f"iterations must be an int, got {type(iterations).__name__}")
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    return iterations


def _to_bh(x: Tensor, batch: tuple[int, ...]) -> Tensor:
    """Expand ``x (…, N, ·)`` to ``batch`` and view it as 4-D ``(B, H, N, ·)``."""
    x = x.expand(*batch, *x.shape[-2:])
    if len(batch) == 2:
        return x
    g = 1
    for n in batch:
        g *= n
    return x.reshape(g, 1, *x.shape[-2:])


def _prepare_masks(
    attn_mask: Tensor | None, is_causal: bool, batch: tuple[int, ...], bh: tuple[int, int], nq: int, nk: int,
    pot_dtype: torch.dtype, device: torch.device,
) -> tuple[Tensor | None, Tensor, Tensor, bool]:
    """Return ``(full (B,H,Nq,Nk) or None, row_valid (B,H,Nq), col_valid (B,H,Nk), causal)``.

    ``is_causal`` is folded into a full mask when there is one (``causal`` is then False).

    A key-only mask keeps only which keys are excluded: finite key biases cancel exactly in
    every column normalization (``s_ij + m_j − (c_j + m_j)``).
    """
    target = (*batch, nq, nk)
    m = additive_mask(attn_mask, target, pot_dtype)
    full: Tensor | None = None
    if m is None:
        keys = torch.ones(*bh, nk, dtype=torch.bool, device=device)
    elif m.dim() < 2 or m.shape[-2] == 1:
        keys = torch.isfinite(m).expand(*batch, 1, nk).reshape(*bh, nk)
    else:
        full = m.expand(target).reshape(*bh, nq, nk)
        keys = torch.ones(*bh, nk, dtype=torch.bool, device=device)
    if full is not None:
        if is_causal:
            full = full + causal_additive_mask(nq, nk, pot_dtype, device)
        fin = torch.isfinite(full)
        return full.contiguous(), fin.any(-1), fin.any(-2), False
    idx_q = torch.arange(nq, device=device)
    if is_causal:
        seen = torch.cumsum(keys.int(), dim=-1) > 0  # any admissible key j' <= j
        row_valid = seen[..., idx_q.clamp(max=nk - 1)]
        col_valid = keys & (torch.arange(nk, device=device) < nq)
    else:
        row_valid = keys.any(-1, keepdim=True).expand(*bh, nq)
        col_valid = keys
    return None, row_valid, col_valid, is_causal


def _run_passes(
    q: Tensor, k: Tensor, v: Tensor, iterations: int, full: Tensor | None, is_causal: bool,
    row_valid: Tensor, col_valid: Tensor, scale: float,
) -> Tensor:
    """Sinkhorn-K (K >= 1) on 4-D tensors; picks the fused CPU kernel or the blocked path."""
    nq, nk = q.shape[-2], k.shape[-2]
    # with Nq != Nk the swapped (column) pass needs a causal mask the kernel does not offer: the
    # blocked path keeps that case O(N) instead of materializing the mask
    if fc.flash_available(q) and not (is_causal and nq != nk):
        d, dv = q.shape[-1], v.shape[-1]
        if d != dv:  # the kernel wants one head size: zero columns change neither scores nor outputs
            w = max(d, dv)
            q, k, v = F.pad(q, (0, w - d)), F.pad(k, (0, w - d)), F.pad(v, (0, w - dv))
        if iterations == 1:
            return fc.dnas1(q, k, v, row_valid, col_valid, full, is_causal, scale)[..., :dv]
        full_t = None if full is None else full.transpose(-1, -2)

        def col(f: Tensor) -> Tensor:
            if is_causal:
                return fc.lse_pass(k.flip(-2), q.flip(-2), f.flip(-1), row_valid.flip(-1), None, True,
                                   scale).flip(-1)
            return fc.lse_pass(k, q, f, row_valid, full_t, False, scale)

        def row(g: Tensor) -> Tensor:
            return fc.lse_pass(q, k, g, col_valid, full, is_causal, scale)

        def attend(g: Tensor) -> Tensor:
            return fc.attn_pass(q, k, v, g, col_valid, full, is_causal, scale)[..., :dv]
    else:
        orig = q.dtype
        if orig in _HALF:
            q, k, v = q.float(), k.float(), v.float()
        full_t = None if full is None else full.transpose(-1, -2)
        lower, upper = ("lower", "upper") if is_causal else (None, None)

        def col(f: Tensor) -> Tensor:
            return chunked_lse_pass(k, q, f, row_valid, full_t, upper, scale)

        def row(g: Tensor) -> Tensor:
            return chunked_lse_pass(q, k, g, col_valid, full, lower, scale)

        def attend(g: Tensor) -> Tensor:
            return chunked_attn_pass(q, k, v, g, col_valid, full, lower, scale).to(orig)

    f = torch.zeros(row_valid.shape, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                    device=q.device)
    g = col(f)
    for _ in range(iterations - 1):
        f = row(g)
        g = col(f)
    return attend(g)


def _on_triton(
    mech: str, q: Tensor, k: Tensor, v: Tensor, iterations: int, weight: Tensor | None,
    attn_mask: Tensor | None, scale: float, is_causal: bool,
) -> Tensor:
    """The Triton kernels (:mod:`attnopt.functional.triton.doubly_normalized`), imported on first use."""
    from attnopt.functional.triton.doubly_normalized import sinkhorn_attention

    dispatch.record(mech, "triton")
    return sinkhorn_attention(q, k, v, iterations=iterations, weight=weight, attn_mask=attn_mask,
                              scale=scale, is_causal=is_causal)


def _lnas(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, scale: float, is_causal: bool) -> Tensor:
    return generalized_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)


def _dnas(
    q: Tensor, k: Tensor, v: Tensor, iterations: int, attn_mask: Tensor | None, scale: float, is_causal: bool
) -> Tensor:
    nq, nk, _ = check_attention_inputs(q, k, v)
    empty = empty_attention(q, k, v)
    if empty is not None:  # the fused kernel crashes the process on empty sizes
        return empty
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    q4, k4, v4 = _to_bh(q, batch), _to_bh(k, batch), _to_bh(v, batch)
    bh = (q4.shape[0], q4.shape[1])
    pot = torch.float64 if q.dtype == torch.float64 else torch.float32
    full, row_valid, col_valid, causal = _prepare_masks(
        attn_mask, is_causal, batch, bh, nq, nk, pot, q.device
    )
    out = _run_passes(q4, k4, v4, iterations, full, causal, row_valid, col_valid, scale)
    return out.reshape(*batch, nq, v.shape[-1])


def doubly_normalized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    iterations: int = 1,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    causal: prefix.Causal | None = None,
    dropout_p: float = 0.0,
    impl: dispatch.Impl = "auto",
) -> Tensor:
    r"""Doubly-normalized attention (DNAS) and Sinkhorn-K, doubly-normalized-attention eq. (6)–(8), (10).

    .. math:: \pi_{ij} = \mathrm{softmax}_j(s_{ij} - c_j), \quad
              c_j = \log\sum_i e^{s_{ij}}, \quad \mathrm{out}_i = \sum_j \pi_{ij} v_j

    for ``iterations=1``; ``iterations=K`` alternates K log-domain column and row
    normalizations (ending on a row one); ``iterations=0`` is ordinary softmax attention
    (LNAS, via SDPA). Lemma 1: every column mass ``Σ_i π_ij >= 1/Nk`` for K = 1 (without masks).

    O(N) memory in forward and backward (flash-style recomputation) for no mask, key-only
    masks ``(…, 1, Nk)`` and ``is_causal`` with ``causal="plan"``; a full ``(…, Nq, Nk)`` mask
    costs its own size, and so does the autoregressive ``causal="prefix"`` variant (the default
    under ``is_causal``; materialized, see ``causal`` below).
    Finite key-only biases cancel in the column normalization (only ``-inf``/``False``
    matters); a key no query may see is left out of every normalization (weight 0). Masks
    are differentiated only when they require grad, and then through the materialized
    ``Nq × Nk`` weights (as SDPA's math kernel does). Under ``torch.func`` transforms (``vmap``,
    ``grad``, ``jacrev``, ``jvp``) and on meta tensors the op runs as plain PyTorch ops on the
    materialized weights (``impl`` is then ignored and the O(N)-memory guarantee does not hold).

    Args:
        q: (B, H, Nq, d) queries (any leading batch dims that broadcast).
        k: (B, H, Nk, d) keys.
        v: (B, H, Nk, dv) values.
        iterations: K >= 0 Sinkhorn (column, row) steps.
        attn_mask: boolean (``True`` = take part) or additive float, broadcastable to
            (B, H, Nq, Nk).
        scale: score scale (default ``1/sqrt(d)``).
        is_causal: SDPA's top-left causal mask; with ``causal=None`` it selects ``"prefix"``.
        causal: how causality enters the normalizations over queries. ``"prefix"``: autoregressive,
            query ``i`` normalizes each column over the admissible queries ``i' ≤ i`` only,
            ``c_j^{(i)} = logsumexp_{j ≤ i' ≤ i} s_{i'j}`` under a causal mask (Sinkhorn-K: row
            ``i`` of K steps on the block of queries ``0..i``; see :mod:`._dn_prefix`), so row
            ``i`` never depends on later queries; materialized, ``O(Nq Nk)`` memory (Sinkhorn-K
            ``O(K Nq² Nk)`` time). ``"plan"``: the mask only restricts the transport plan, the
            column normalization runs over every query — under ``is_causal`` row ``i`` reads the
            queries after ``i`` (not autoregressive; for analysis). ``None`` (default):
            ``"prefix"`` if ``is_causal`` else ``"plan"``.
        dropout_p: dropout probability on the weights ``π`` before the sum over values (as in
            SDPA: applied whenever > 0, the modules pass 0 in ``eval()``). A call with
            ``dropout_p > 0`` runs on the materialized ``Nq × Nk`` weights (plain PyTorch ops,
            :mod:`._dropout`; ``impl`` is then ignored and ``last_dispatch`` says
            ``"materialized"``; with the
            prefix variant the dropout falls on its weights).
        impl: ``"streaming"`` (the O(N)-memory passes above), ``"materialized"`` (one fused
            pass over the ``Nq × Nk`` scores, :mod:`._dnas_materialized`; fastest at short
            sequences) or ``"auto"`` (by size, :func:`attnopt.functional.dispatch.choose_impl`;
            the choice is recorded in ``dispatch.last_dispatch``). Same result up to rounding.

    Returns:
        (B, H, Nq, dv); a query with no admissible key gets zeros (finite gradients), and so
        does every query when ``Nk = 0``; ``Nq = 0`` or an empty batch gives an empty output.
        Half precision keeps the potentials in float32 and never produces NaN. Any strided
        layout is accepted: the fused CPU kernel gets a copy of an input whose last dim is
        not unit-stride.

    Raises:
        ValueError: unknown ``impl`` or ``causal``, ``impl="streaming"`` with the prefix variant
            (it has no streaming path), negative ``iterations``, shape mismatch, ``scale <= 0``, a
            mask that does not broadcast to (B, H, Nq, Nk) or holds NaN/``+inf``, NaN or ±inf
            in ``q``, ``k``, ``v``.
        TypeError: non-tensor / non-floating inputs, non-int ``iterations``.
    """
    validate_attention(q, k, v, attn_mask)
    iterations = _check_iterations(iterations)
    alpha = resolve_scale(scale, q.shape[-1])
    dispatch.check_impl(impl)
    use_prefix = _use_prefix(causal, is_causal, impl, iterations)
    dropout_p = check_dropout_p(dropout_p)
    empty = empty_attention(q, k, v)
    if empty is not None:
        return empty
    if dropout_p > 0.0:  # the streaming / fused passes never hold π: drop on the materialized weights
        name = "doubly_normalized" if iterations == 1 else "sinkhorn"
        if use_prefix:
            dispatch.record(name, "prefix")
            weights = prefix.prefix_weights(q, k, iterations=iterations, attn_mask=attn_mask, scale=alpha,
                                            is_causal=is_causal)
        else:
            dispatch.record(name, "materialized")
            weights = _weights(q, k, iterations, attn_mask, alpha, is_causal)
        return dropout_attention(weights, v, dropout_p, q.dtype)
    mech = {0: "lnas", 1: "doubly_normalized"}.get(iterations, "sinkhorn")
    reference = dispatch.use_reference(mech, q)
    if iterations == 0 and not reference:
        return _lnas(q, k, v, attn_mask, alpha, is_causal)
    if use_prefix:
        dispatch.record("doubly_normalized" if iterations == 1 else "sinkhorn", "prefix")
        return prefix.prefix_attention(q, k, v, iterations=iterations, attn_mask=attn_mask, scale=alpha,
                                       is_causal=is_causal)
    if reference or under_transform() or q.is_meta or (
            isinstance(attn_mask, Tensor) and attn_mask.requires_grad and torch.is_grad_enabled()):
        # torch.func transforms (the fused Functions have no vmap rule and are ctx-style), meta tensors
        # (the fused paths read values) and a differentiable mask: the materialized weights in plain
        # ops (as SDPA's math kernel does)
        w = _weights(q, k, iterations, attn_mask, alpha, is_causal)
        return torch.matmul(w, v.to(w.dtype)).to(q.dtype)
    if gpu.wanted(q):  # the Triton kernels (attnopt.functional.triton): CUDA, or backend("triton")
        return _on_triton(mech, q, k, v, iterations, None, attn_mask, alpha, is_causal)
    fused = dispatched_sinkhorn(mech, q, k, v, iterations, None, attn_mask, alpha, is_causal, impl)
    if fused is not None:
        return fused
    return _dnas(q, k, v, iterations, attn_mask, alpha, is_causal)


def _use_prefix(causal: object, is_causal: bool, impl: str, iterations: int) -> bool:
    """Whether the autoregressive prefix variant runs (K >= 1); it has no streaming path."""
    use = prefix.resolve_causal(causal, is_causal) and iterations >= 1
    if use and impl == "streaming":
        raise ValueError("impl='streaming' has no autoregressive (causal='prefix') variant: use impl='auto', "
                         "or causal='plan' for the masked plan, which lets each row read later queries")
    return use


def _weights(q: Tensor, k: Tensor, iterations: int, attn_mask: Tensor | None, scale: float,
             is_causal: bool) -> Tensor:
    nq, nk, _ = check_attention_inputs(q, k)
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    compute = torch.float32 if q.dtype in _HALF else q.dtype
    s = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * scale
    m = additive_mask(attn_mask, (*batch, nq, nk), compute)
    if m is not None:
        s = s + m
    if is_causal:
        s = s + causal_additive_mask(nq, nk, compute, q.device)
    if iterations == 0:
        return safe_softmax(s, dim=-1)
    for _ in range(iterations):
        for dim in (-2, -1):
            lse = safe_logsumexp(s, dim=dim, keepdim=True)  # -inf for an empty slice
            s = s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(s)


def doubly_normalized_weights(
    q: Tensor,
    k: Tensor,
    *,
    iterations: int = 1,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    causal: prefix.Causal | None = None,
) -> Tensor:
    r"""The explicit ``(B, H, Nq, Nk)`` weights of :func:`doubly_normalized_attention` (analysis).

    .. math:: \pi^{(K)} = \mathcal{R}\,\mathcal{C} \cdots \mathcal{R}\,\mathcal{C}\; e^{s}

    (``C`` divides columns by their sums over queries, ``R`` rows by their sums over keys,
    applied K times in the log domain; K = 0 is the row softmax). Materializes Nq × Nk. With
    ``causal="prefix"`` (default under ``is_causal``) row ``i`` is the autoregressive row of
    :func:`doubly_normalized_attention`.

    Args: as :func:`doubly_normalized_attention` (without ``v``).

    Returns:
        (B, H, Nq, Nk) row-stochastic weights (rows without admissible key are zeros; a key
        no query sees has weight 0). Half precision is normalized in float32 and cast back.

    Raises:
        ValueError, TypeError: as :func:`doubly_normalized_attention`.
    """
    validate_attention(q, k, None, attn_mask)
    iterations = _check_iterations(iterations)
    alpha = resolve_scale(scale, q.shape[-1])
    if _use_prefix(causal, is_causal, "auto", iterations):
        return prefix.prefix_weights(q, k, iterations=iterations, attn_mask=attn_mask, scale=alpha,
                                     is_causal=is_causal).to(q.dtype)
    return _weights(q, k, iterations, attn_mask, alpha, is_causal).to(q.dtype)


def _check_weight(weight: Tensor, q: Tensor) -> Tensor:
    """Validate the HNAS mixing weight and shape it to broadcast against (…, H, Nq, ·)."""
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise TypeError("weight must be a floating-point torch.Tensor (scalar or per head)")
    if weight.dim() == 0:
        w = weight
    elif weight.dim() == 1 and q.dim() >= 3 and weight.shape[0] == q.shape[-3]:
        w = weight[:, None, None]
    else:
        raise ValueError(
            f"weight must be a scalar or have one entry per head ({q.shape[-3] if q.dim() >= 3 else '?'}), "
            f"got shape {tuple(weight.shape)}"
        )
    if weight.numel():
        values = host_values(weight)  # under torch.func: the values under the wrappers (all of vmap's batch)
        if values is None:  # off the CPU, compiling, meta: the VALUE_CHECKS policy
            device_assert(weight, lambda t: ((t >= 0) & (t <= 1)).all(), "weight must lie in [0, 1]")
        else:
            low, high = torch.aminmax(values.detach())  # one op: NaN fails both comparisons below
            if not (0.0 <= float(low) and float(high) <= 1.0):
                raise ValueError("weight must lie in [0, 1]")
    return w


def hybrid_normalized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    weight: Tensor,
    *,
    iterations: int = 1,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    causal: prefix.Causal | None = None,
    dropout_p: float = 0.0,
    impl: dispatch.Impl = "auto",
) -> Tensor:
    r"""Hybrid normalized attention (HNAS), doubly-normalized-attention Sec. 6.

    .. math:: \mathrm{out} = w\, \pi^{\mathrm{DNAS}} v + (1 - w)\, \pi^{\mathrm{LNAS}} v

    Both terms are computed in O(N) memory (see :func:`doubly_normalized_attention`); the
    result is differentiable in ``weight``. ``weight = 1`` gives DNAS and ``0`` LNAS (exactly with
    ``impl="streaming"``, up to rounding on the materialized path). Under ``torch.func``
    transforms and on meta tensors both terms run as plain PyTorch ops on the materialized
    ``Nq × Nk`` weights, as in :func:`doubly_normalized_attention` (``impl`` is then ignored and
    the O(N)-memory guarantee does not hold).

    Args:
        q, k, v, attn_mask, scale, is_causal, causal: as :func:`doubly_normalized_attention`;
            ``causal="prefix"`` (the default with ``is_causal``) mixes the autoregressive
            doubly-normalized rows with the causal softmax (LNAS), so HNAS is autoregressive too.
        dropout_p: dropout on the mixed weights ``w π^DNAS + (1 − w) π^LNAS`` (as
            :func:`doubly_normalized_attention`: materialized when > 0).
        weight: mixing weight ``w`` in [0, 1]: a 0-d tensor or one value per head ``(H,)``.
        iterations: Sinkhorn steps of the doubly-normalized term (default 1 = DNAS).
        impl: ``"materialized"`` shares one score matrix between both terms and mixes the
            weights before one matmul; ``"streaming"`` runs both terms in O(N) memory;
            ``"auto"`` picks by size (see :func:`doubly_normalized_attention`).

    Returns:
        (B, H, Nq, dv).

    Raises:
        ValueError: ``weight`` outside [0, 1] or of the wrong shape; as
            :func:`doubly_normalized_attention`.
        TypeError: non-tensor ``weight``; as :func:`doubly_normalized_attention`.
    """
    validate_attention(q, k, v, attn_mask)
    w = _check_weight(weight, q)
    dispatch.check_impl(impl)
    dropout_p = check_dropout_p(dropout_p)
    empty = empty_attention(q, k, v, weight)
    if empty is not None:
        _use_prefix(causal, is_causal, impl, _check_iterations(iterations))
        return empty
    iterations = _check_iterations(iterations)
    if _use_prefix(causal, is_causal, impl, iterations):
        dispatch.record("hybrid_normalized", "prefix")
        if dropout_p > 0.0:
            mixed = prefix.prefix_weights(q, k, iterations=iterations, attn_mask=attn_mask,
                                          scale=resolve_scale(scale, q.shape[-1]), is_causal=is_causal,
                                          weight=w)
            return dropout_attention(mixed, v, dropout_p, q.dtype)
        return prefix.prefix_attention(q, k, v, iterations=iterations, attn_mask=attn_mask,
                                       scale=resolve_scale(scale, q.shape[-1]), is_causal=is_causal, weight=w)
    if dropout_p > 0.0:  # dropout on the mixed, materialized weights (see doubly_normalized_attention)
        alpha = resolve_scale(scale, q.shape[-1])
        dn = _weights(q, k, iterations, attn_mask, alpha, is_causal)
        mixed = torch.lerp(_weights(q, k, 0, attn_mask, alpha, is_causal), dn, w.to(dn.dtype))
        dispatch.record("hybrid_normalized", "materialized")
        return dropout_attention(mixed, v, dropout_p, q.dtype)
    # the reference backend, torch.func, meta: plain ops (see doubly_normalized_attention)
    if dispatch.use_reference("hybrid_normalized", q) or under_transform() or q.is_meta:
        alpha = resolve_scale(scale, q.shape[-1])
        dn = _weights(q, k, iterations, attn_mask, alpha, is_causal)
        mixed = torch.lerp(_weights(q, k, 0, attn_mask, alpha, is_causal), dn, w.to(dn.dtype))
        return torch.matmul(mixed, v.to(mixed.dtype)).to(q.dtype)
    grad_mask = isinstance(attn_mask, Tensor) and attn_mask.requires_grad and torch.is_grad_enabled()
    if iterations >= 1 and not grad_mask and gpu.wanted(q):
        return _on_triton("hybrid_normalized", q, k, v, iterations, w, attn_mask,
                          resolve_scale(scale, q.shape[-1]), is_causal)
    if iterations >= 1 and not grad_mask:
        fused = dispatched_sinkhorn("hybrid_normalized", q, k, v, iterations, w, attn_mask,
                                    resolve_scale(scale, q.shape[-1]), is_causal, impl)
        if fused is not None:
            return fused
    dn = doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=attn_mask, scale=scale,
                                     is_causal=is_causal, causal="plan", impl="streaming")
    ln = doubly_normalized_attention(q, k, v, iterations=0, attn_mask=attn_mask, scale=scale,
                                     is_causal=is_causal)
    w = w.to(dn.dtype)
    return w * dn + (1 - w) * ln


def hybrid_normalized_weights(
    q: Tensor,
    k: Tensor,
    weight: Tensor,
    *,
    iterations: int = 1,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    causal: prefix.Causal | None = None,
) -> Tensor:
    r"""The explicit weights ``w π^DNAS + (1 − w) π^LNAS`` of :func:`hybrid_normalized_attention`.

    Args: as :func:`hybrid_normalized_attention` (without ``v``).

    Returns:
        (B, H, Nq, Nk) row-stochastic weights (materialized).

    Raises:
        ValueError, TypeError: as :func:`hybrid_normalized_attention`.
    """
    validate_attention(q, k, None, attn_mask)
    w = _check_weight(weight, q)
    iterations = _check_iterations(iterations)
    alpha = resolve_scale(scale, q.shape[-1])
    if _use_prefix(causal, is_causal, "auto", iterations):
        return prefix.prefix_weights(q, k, iterations=iterations, attn_mask=attn_mask, scale=alpha,
                                     is_causal=is_causal, weight=w).to(q.dtype)
    dn = _weights(q, k, iterations, attn_mask, alpha, is_causal)
    ln = _weights(q, k, 0, attn_mask, alpha, is_causal)
    w = w.to(dn.dtype)
    return (w * dn + (1 - w) * ln).to(q.dtype)

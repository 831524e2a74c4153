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
runs the autoregressive variant of :mod:`.prefix` (query ``i`` normalizes over queries
``≤ i`` only; materialized, never the fast paths below); ``causal="plan"`` keeps the masked plan
(for analysis). An ``attn_mask`` that happens to be causal is not inspected (that would read its
values): pass ``is_causal=True`` or ``causal="prefix"`` with it.

The one router (this file) picks an implementation; each lives in its own file and none imports
another:

* :mod:`.reference` — plain PyTorch, log domain, any device: ``attnopt.backend("reference")``,
  ``torch.func`` transforms (but for the ops below), meta tensors, a mask that requires grad, and
  (below the crossover) every tensor that cannot be read on the host (off the CPU, e.g. the
  fake-device fixture; while ``torch.compile`` / ``torch.export`` trace, but for the op below: no
  host sync, no loop over batch × heads); also the recomputation when a fast kernel reports an
  underflowing normalizer (rare, never silent).
* under ``torch.compile`` / ``torch.export`` (below the crossover) with CPU float32 tensors (DNAS,
  Sinkhorn-K, HNAS; any mask that does not require grad, ``is_causal``): the C passes as the one
  op ``torch.ops.attnopt.dn_fwd`` (:mod:`.cpu`; its registered backward ``dn_bwd``); on an
  underflow, or without the C library where the graph runs, the ops recompute in the log domain
  (this reference) inside their bodies — :func:`_op_call`. The same ops run under ``torch.func``
  ``vmap`` and one ``grad`` / ``vjp`` / ``jacrev`` level (``vmap(grad(f))``: per-example
  gradients), through :data:`cpu.TRANSFORM_FUNCTION` and the ops' batching rules
  (:mod:`attnopt.functional._func_ops`); ``jvp`` / ``jacfwd`` / ``hessian`` / nested ``grad`` keep
  the reference, as do float64 and half under compile and ``torch.func``. Plain eager calls keep
  the autograd Functions below (the Python ``custom_op`` dispatch costs tens of µs a call).
* ``impl="materialized"`` (``auto`` below ``dispatch.CROSSOVERS``), host-readable CPU tensors:
  :mod:`.cpu` (the C passes, the device kernel of this family: float32, DNAS / HNAS and
  Sinkhorn-K, from ``THRESHOLDS.dnas_native_min_entries``; DNAS / HNAS's one-call no-grad pass up
  to one ``THRESHOLDS.dnas_materialized_chunk_entries`` chunk), else :mod:`.materialized`, the one
  materialized implementation (probability domain, saves the weights; chunk by chunk over
  batch × heads above one chunk, so that the ``Nq × Nk`` temporaries stay in cache), or its
  no-grad forward (nothing saved) without autograd and without a mask. There is no second
  materialized form: the C passes cover Sinkhorn-K in float32 at the sizes where the
  probability domain's 2K saved matrices per head were slow; float64 and half run the
  probability domain at every size.
* ``impl="streaming"`` (``auto`` above the crossover): :mod:`.streaming`, O(N) memory, with the
  CPU flash-kernel passes of :mod:`.flash_cpu` where they apply, else its blocked passes.
* :mod:`.prefix` — the autoregressive ``causal="prefix"`` variant (a formula of its own).
* the Triton kernels of :mod:`attnopt.functional.triton.doubly_normalized` on CUDA tensors with
  Triton installed, or under ``attnopt.backend("triton")`` (``last_dispatch`` says ``"triton"``).

Every size rule is in :mod:`attnopt.functional._thresholds`.

Memory (streaming). The attention functions never form the ``Nq × Nk`` matrix, in forward or
backward, for no mask, ``is_causal`` with ``causal="plan"`` and key-only masks ``(B, H, 1, Nk)`` (key
padding). A mask of shape ``(…, Nq, Nk)`` is itself ``Nq × Nk``; it is used as given (the passes
then carry one mask-sized temporary) — O(N) memory needs a key-only mask.
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt._validation import (
    additive_mask,
    device_assert,
    empty_attention,
    host_readable,
    host_values,
    resolve_scale,
    validate_attention,
)
from attnopt.functional import dispatch
from attnopt.functional import triton as gpu
from attnopt.functional._autograd import records_graph, under_transform
from attnopt.functional._dropout import check_dropout_p, dropout_attention
from attnopt.functional._func_ops import transforms_supported
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.doubly_normalized import cpu, flash_cpu, materialized, reference, streaming
from attnopt.functional.doubly_normalized import prefix as prefix
from attnopt.functional.generalized import generalized_attention

cpu.FALLBACK[:] = [reference.attention]  # the ops' log-domain recomputation (a leaf imports no leaf)

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


def _batch_shape(*xs: Tensor) -> tuple[int, ...]:
    """Broadcast batch shape (all dims but the last two) of ``xs``; cheap when they agree."""
    first = tuple(xs[0].shape[:-2])
    if all(tuple(x.shape[:-2]) == first for x in xs[1:]):
        return first
    return tuple(torch.broadcast_shapes(*(x.shape[:-2] for x in xs)))


def _as_4d(
    qkv: list[Tensor], w: Tensor | None, mask: Tensor | None, batch: tuple[int, ...],
) -> tuple[list[Tensor], Tensor | None, Tensor | None]:
    """``(B, H, N, ·)`` contiguous views of batch-expanded inputs, with the mask and weight 4-D."""
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
    return [q, k, v], w, mask


def _materialized(
    q: Tensor, k: Tensor, v: Tensor, iterations: int, weight: Tensor | None, attn_mask: Tensor | None,
    scale: float, is_causal: bool, batch: tuple[int, ...],
) -> Tensor:
    """The materialized side of the router: which kernel runs for these sizes (inputs validated,
    host-readable CPU tensors, ``Nq, Nk >= 1``); the reference when a kernel underflows."""
    orig = q.dtype
    compute = torch.float32 if orig in _HALF else orig
    nq, nk = q.shape[-2], k.shape[-2]
    mask = additive_mask(attn_mask, (*batch, nq, nk), compute)
    qc, kc, vc = (x if x.dtype == compute else x.to(compute) for x in (q, k, v))
    qc, kc, vc = (x if tuple(x.shape[:-2]) == batch else x.expand(*batch, *x.shape[-2:])
                  for x in (qc, kc, vc))
    qkv = [qc, kc, vc]
    m = None if mask is None else mask.detach()
    w = None if weight is None else weight.to(compute)
    entries = nq * nk
    for n in batch:
        entries *= n
    t = THRESHOLDS
    lib = cpu.library(qkv[0], iterations) if w is None or iterations == 1 else None
    chunked = entries > t.dnas_materialized_chunk_entries  # more than one cache-sized chunk
    no_grad = m is None and not (is_causal and nk > nq) and not records_graph(*qkv, w)  # nothing saved
    out: Tensor | None = None
    if lib is not None and no_grad and not chunked and iterations == 1:  # K = 1 f32 inference: one C pass
        g = qkv[0].shape[:-2]
        q3, k3, v3 = (x.reshape(-1, *x.shape[-2:]) for x in qkv)
        wf = None if w is None else w.expand(*g, 1, 1).reshape(-1).contiguous()
        out = cpu.no_grad_small(lib, q3, k3, v3, wf, is_causal, scale)
        out = None if out is None else out.view(*g, nq, v.shape[-1])
    elif lib is not None and entries >= t.dnas_native_min_entries:
        (q4, k4, v4), w4, m4 = _as_4d(qkv, w, m, batch)
        out = cpu.native_sinkhorn(lib, q4, k4, v4, w4, m4, is_causal, scale, iterations)
        out = None if out is None else out.reshape(*batch, nq, v.shape[-1])
    else:
        if chunked:  # 4-D (B, H, N, ·): the kernel runs chunk by chunk over batch × heads
            qkv, w, m = _as_4d(qkv, w, m, batch)
        qm, km, vm = qkv
        if no_grad:
            out = materialized.no_grad_forward(qm, km, vm, w, is_causal, scale, iterations)
        else:
            out = materialized.materialized_sinkhorn(qm, km, vm, w, m, is_causal, scale, iterations)
        out = None if out is None else out.reshape(*batch, nq, v.shape[-1])
    if out is None:  # an underflowing normalizer (a dominated row): the log domain, exact
        return reference.attention(q, k, v, iterations, weight, attn_mask, scale, is_causal)
    return out.to(orig)


def _transform_op_applies(q: Tensor, k: Tensor, v: Tensor, iterations: int, weight: Tensor | None) -> bool:
    """Under ``torch.func``: whether the C passes run as ops (DNAS / Sinkhorn-K / HNAS on float32 CPU
    tensors, ``vmap`` levels and at most one ``grad`` level, no autograd around them:
    :func:`attnopt.functional._func_ops.transforms_supported`)."""
    return ((weight is None or iterations == 1) and q.dtype == torch.float32
            and k.dtype == v.dtype == torch.float32 and q.device.type == "cpu"
            and transforms_supported(q, k, v, weight))


def _op_call(
    q: Tensor, k: Tensor, v: Tensor, iterations: int, weight: Tensor | None, attn_mask: Tensor | None,
    scale: float, is_causal: bool, batch: tuple[int, ...], transformed: bool,
) -> Tensor:
    """DNAS / Sinkhorn-K / HNAS on float32 CPU tensors, under ``torch.compile`` / ``torch.export``
    or (``transformed``) ``torch.func``: the C passes as the one op ``attnopt::dn_fwd`` (backward
    ``attnopt::dn_bwd``; under ``torch.func`` through :data:`cpu.TRANSFORM_FUNCTION`, with the
    ops' batching rules). An underflowing normalizer, or no C library where the op runs, is
    answered inside the ops (they recompute in the log domain, :data:`cpu.FALLBACK`), so a graph
    holds no data-dependent branch."""
    nq, nk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    mask = additive_mask(attn_mask, (*batch, nq, nk), torch.float32)
    m = None if mask is None else mask.detach()
    w = None if weight is None else weight.to(torch.float32)
    qkv = [x if tuple(x.shape[:-2]) == batch else x.expand(*batch, *x.shape[-2:]) for x in (q, k, v)]
    (q4, k4, v4), w4, m4 = _as_4d(qkv, w, m, batch)
    fwd = cpu.TRANSFORM_FUNCTION.apply if transformed else torch.ops.attnopt.dn_fwd
    out: Tensor = fwd(q4, k4, v4, w4, m4, is_causal, scale, iterations)[0]
    return out.reshape(*batch, nq, dv)


def _route(
    mech: str, q: Tensor, k: Tensor, v: Tensor, iterations: int, weight: Tensor | None,
    attn_mask: Tensor | None, scale: float, is_causal: bool, impl: str, forced: bool,
) -> Tensor:
    """THE router of DNAS / Sinkhorn-K (``weight=None``, K >= 1) and HNAS (inputs validated,
    the prefix variant and dropout already answered; ``forced``: :func:`dispatch.use_reference`'s
    answer); records the choice in ``last_dispatch``."""
    grad_mask = isinstance(attn_mask, Tensor) and attn_mask.requires_grad and torch.is_grad_enabled()
    if forced or under_transform() or q.is_meta or grad_mask:
        if not (forced or q.is_meta or grad_mask) and _transform_op_applies(q, k, v, iterations, weight):
            dispatch.record(mech, "materialized")  # vmap / one grad level: the C passes as ops
            batch = _batch_shape(q, k, v)
            return _op_call(q, k, v, iterations, weight, attn_mask, scale, is_causal, batch, True)
        # other torch.func transforms (the fused Functions are ctx-style), meta tensors (the fused
        # paths read values) and a differentiable mask: the plain ops (as SDPA's math kernel)
        return reference.attention(q, k, v, iterations, weight, attn_mask, scale, is_causal)
    if gpu.wanted(q):  # the Triton kernels (attnopt.functional.triton): CUDA, or backend("triton")
        return _on_triton(mech, q, k, v, iterations, weight, attn_mask, scale, is_causal)
    batch = _batch_shape(q, k, v)
    g = 1
    for n in batch:
        g *= n
    path = dispatch.choose_impl(mech, nq=q.shape[-2], nk=k.shape[-2], batch=g, dtype=q.dtype, impl=impl)
    dispatch.record(mech, path)
    if path == "materialized":
        if not host_readable(q):  # off the CPU / compiling: one graph, no host read
            if torch.compiler.is_compiling() and (weight is None or iterations == 1) \
                    and q.dtype == torch.float32 and v.dtype == torch.float32 and q.device.type == "cpu":
                return _op_call(q, k, v, iterations, weight, attn_mask, scale, is_causal, batch, False)
            return reference.attention(q, k, v, iterations, weight, attn_mask, scale, is_causal)
        return _materialized(q, k, v, iterations, weight, attn_mask, scale, is_causal, batch)
    run = flash_cpu.run_passes if flash_cpu.flash_available(q) else None
    dn = streaming.attention(q, k, v, iterations, attn_mask, scale, is_causal, run)
    if weight is None:
        return dn
    ln = generalized_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)
    w = weight.to(dn.dtype)
    return w * dn + (1 - w) * ln


@dispatch.profiled
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
            ``i`` of K steps on the block of queries ``0..i``; see :mod:`.prefix`), so row
            ``i`` never depends on later queries; materialized, ``O(Nq Nk)`` memory (Sinkhorn-K
            ``O(K Nq² Nk)`` time). ``"plan"``: the mask only restricts the transport plan, the
            column normalization runs over every query — under ``is_causal`` row ``i`` reads the
            queries after ``i`` (not autoregressive; for analysis). ``None`` (default):
            ``"prefix"`` if ``is_causal`` else ``"plan"``.
        dropout_p: dropout probability on the weights ``π`` before the sum over values (as in
            SDPA: applied whenever > 0, the modules pass 0 in ``eval()``). A call with
            ``dropout_p > 0`` runs on the materialized ``Nq × Nk`` weights (plain PyTorch ops,
            :mod:`.._dropout`; ``impl`` is then ignored and ``last_dispatch`` says
            ``"materialized"``; with the
            prefix variant the dropout falls on its weights).
        impl: ``"streaming"`` (the O(N)-memory passes above), ``"materialized"`` (one fused
            pass over the ``Nq × Nk`` scores, :mod:`.materialized`; fastest at short
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
            weights = reference.sinkhorn_weights(q, k, iterations, attn_mask, alpha, is_causal)
        return dropout_attention(weights, v, dropout_p, q.dtype)
    mech = {0: "lnas", 1: "doubly_normalized"}.get(iterations, "sinkhorn")
    forced = dispatch.use_reference(mech, q)  # first: backend("cpu") refuses other devices here
    if iterations == 0:
        if forced:
            return reference.attention(q, k, v, 0, None, attn_mask, alpha, is_causal)
        return _lnas(q, k, v, attn_mask, alpha, is_causal)
    if use_prefix:
        dispatch.record(mech, "prefix")
        return prefix.prefix_attention(q, k, v, iterations=iterations, attn_mask=attn_mask, scale=alpha,
                                       is_causal=is_causal)
    return _route(mech, q, k, v, iterations, None, attn_mask, alpha, is_causal, impl, forced)


def _use_prefix(causal: object, is_causal: bool, impl: str, iterations: int) -> bool:
    """Whether the autoregressive prefix variant runs (K >= 1); it has no streaming path."""
    use = prefix.resolve_causal(causal, is_causal) and iterations >= 1
    if use and impl == "streaming":
        raise ValueError("impl='streaming' has no autoregressive (causal='prefix') variant: use impl='auto', "
                         "or causal='plan' for the masked plan, which lets each row read later queries")
    return use


@dispatch.profiled
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
    return reference.sinkhorn_weights(q, k, iterations, attn_mask, alpha, is_causal).to(q.dtype)


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


@dispatch.profiled
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
        dn = reference.sinkhorn_weights(q, k, iterations, attn_mask, alpha, is_causal)
        ln = reference.sinkhorn_weights(q, k, 0, attn_mask, alpha, is_causal)
        mixed = torch.lerp(ln, dn, w.to(dn.dtype))
        dispatch.record("hybrid_normalized", "materialized")
        return dropout_attention(mixed, v, dropout_p, q.dtype)
    if iterations == 0:  # w π^LNAS + (1 − w) π^LNAS: softmax attention (w keeps its zero gradient)
        ln = doubly_normalized_attention(q, k, v, iterations=0, attn_mask=attn_mask, scale=scale,
                                         is_causal=is_causal)
        wl = w.to(ln.dtype)
        return wl * ln + (1 - wl) * ln
    return _route("hybrid_normalized", q, k, v, iterations, w, attn_mask, resolve_scale(scale, q.shape[-1]),
                  is_causal, impl, dispatch.use_reference("hybrid_normalized", q))


@dispatch.profiled
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
    dn = reference.sinkhorn_weights(q, k, iterations, attn_mask, alpha, is_causal)
    ln = reference.sinkhorn_weights(q, k, 0, attn_mask, alpha, is_causal)
    w = w.to(dn.dtype)
    return (w * dn + (1 - w) * ln).to(q.dtype)

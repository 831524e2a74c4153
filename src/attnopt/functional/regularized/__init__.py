r"""Regularized (one-sided entropic OT) attention (sdpa-one-sided-eot Thm 3.3, Prop. 4.1–4.4).

Each query's weights solve ``p_i = argmax_{p∈Δ} <s_i, p> − Ω(p) − β Σ_j p_j |i − j|`` with
scores ``s_ij = <q_i, k_j>·scale`` (+ an additive mask). The locality term is linear in ``p``,
so it becomes the score offset ``−β|i−j|`` (ALiBi, Prop. 4.4) in front of the map ``∇Ω*``.

Names: :func:`regularized_weights` ``(scores, regularizer)`` is the map on given scores (the
issue's map API); :func:`regularized_attention_weights` ``(q, k, ...)`` are the explicit
attention weights of :func:`regularized_attention`.

Dispatch of :func:`regularized_attention`:

* :class:`Shannon` → :func:`torch.nn.functional.scaled_dot_product_attention` with scale
  ``scale/τ``: fused kernels, O(N) memory; on CPU with subnormals flushed
  (:func:`attnopt.functional._denormal.flushed_sdpa`: peaked scores made SDPA up to 2.8×
  slower). With a mask or locality bias (divided by ``τ``) on
  CPU: the fused paths of :mod:`attnopt.functional.generalized` (the flash kernel with
  the bias as its mask; the materialized one when the bias needs a gradient, e.g. a learned
  ``β``), which flush subnormals: under ``−β|i − j|`` the far keys' weights fall below float32's
  smallest normal number, and SDPA's fwd+bwd was 2.8× (β = 0.1, N = 1024) to 6× (β = 0.1,
  N = 2048) slower on them (B·H = 8, d = 64, 1 thread; up to 9× with peaked scores).
* :class:`SquaredL2` and :class:`Tsallis` with a float α, below the size crossover of
  :mod:`attnopt.functional.dispatch` (``impl="auto"``, or ``impl="materialized"``) → the
  fused materialized path (:mod:`attnopt.functional.regularized.materialized`: scores once, the
  exact threshold search in place on them, ``P`` saved for a closed-form backward); above it
  (or ``impl="streaming"``) → a blocked implementation (:mod:`attnopt.functional.regularized.streaming`):
  queries are processed in blocks, only the per-query thresholds are kept, and the backward
  recomputes each block of weights from them, so neither pass holds the ``Nq × Nk`` matrix.
* ``SquaredL2`` / float-α ``Tsallis`` (α > 1) without ``locality`` on a CUDA tensor with Triton
  installed, or under ``attnopt.backend("triton")`` → the Triton kernels of
  :mod:`attnopt.functional.triton.sparse` (``last_dispatch["sparse"] == "triton"``).
* anything else (a user regularizer, a tensor α, a mask that requires grad) → the
  materialized ``regularized_attention_weights(...) @ v`` (autograd through the map). So does a
  call traced by ``torch.compile`` / ``torch.export``: there sparsemax / 1.5-entmax on CPU
  float32/64 run as the ops ``attnopt::sparse_map_fwd`` / ``sparse_map_bwd`` (:mod:`._maps`).

The maps (:func:`sparsemax`, :func:`entmax`, also re-exported as ``attnopt.functional.X``) and the
choice of their implementation live in :mod:`._maps` (part of this router). Leaves, one
implementation each, none importing another (shared math: :mod:`._common`):

* :mod:`.sort` — sparsemax / 1.5-entmax by sorting: their reference, any device;
* :mod:`.search` — α-entmax by safeguarded Newton: the reference of other α and tensor α;
* :mod:`.cpu` — the C kernels of sparsemax / 1.5-entmax (ctypes in eager code, ``torch.library``
  ops ``attnopt::sparse_map_*`` for traced graphs);
* :mod:`.groups` — the CPU candidate-group forward of other float α > 1 and the row-blocked
  CPU backward;
* :mod:`.reference` — the attention in tracked plain ops (the map handed in);
* :mod:`.materialized` — fused materialized attention (scores once; small sizes search in place,
  larger ones the chosen map); :mod:`.streaming` — query-blocked attention keeping only ``θ``.
  Both take the chosen map implementations from this router (:class:`._common.MapKernels`).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from attnopt._validation import (
    additive_mask,
    any_nonfinite,
    broadcast_shapes,
    causal_additive_mask,
    check_attention_inputs,
    check_tensor,
    combine_additive,
    empty_attention,
    empty_weights,
    host_readable,
    host_values,
    resolve_scale,
    validate_attention,
)
from attnopt.functional import dispatch
from attnopt.functional import triton as gpu
from attnopt.functional._autograd import under_transform
from attnopt.functional._denormal import flushed_sdpa, sdpa
from attnopt.functional._dropout import check_dropout_p, dropout_attention
from attnopt.functional._softmax import safe_softmax
from attnopt.functional.generalized import (
    biased_flash_attention,
    biased_softmax_attention,
    flash_bias_available,
)
from attnopt.functional.regularized import cpu, reference
from attnopt.functional.regularized._common import MapKernels
from attnopt.functional.regularized._maps import (
    entmax,
    entmax15,
    entmax_bisect,
    map_backward,
    sparsemax,
    threshold_map,
)
from attnopt.functional.regularized.materialized import fused_sparse_attention
from attnopt.functional.regularized.regularizers import Regularizer, Shannon, SquaredL2, Tsallis
from attnopt.functional.regularized.streaming import blocked_sparse_attention

__all__ = [
    "entmax",
    "entmax15",
    "entmax_bisect",
    "sparsemax",
    "softmax_weights",
    "regularized_weights",
    "regularized_attention",
    "regularized_attention_weights",
    "locality_bias",
]


def _map(s: Tensor, alpha: float) -> Tensor:
    return sparsemax(s) if alpha == 2.0 else entmax(s, alpha)


def _tracked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, beta: Tensor | None, alpha: float,
             scale: float, causal: bool) -> Tensor:
    return reference.sparse_attention(q, k, v, mask, beta, alpha, scale, causal, weights=_map)


#: The map implementations the attention leaves (:mod:`.materialized`, :mod:`.streaming`) run: the
#: choice of :func:`._maps.threshold_map` / :func:`._maps.map_backward`, the C kernel of :mod:`.cpu`
#: and the tracked reference for double backward.
_KERNELS = MapKernels(forward=threshold_map, backward=map_backward, native_forward=cpu.forward,
                      native_available=cpu.library_available, tracked=_tracked)


def softmax_weights(scores: Tensor, *, temperature: float = 1.0, dim: int = -1) -> Tensor:
    r"""Shannon-regularized map: ``softmax(s/τ)`` (sdpa-one-sided-eot Thm 3.3, Prop. 4.1).

    .. math:: p = \arg\max_{p\in\Delta} \langle s,p\rangle - \tau \sum_j p_j\log p_j
              = \mathrm{softmax}(s/\tau)

    Args:
        scores: (..., S) real scores; ``-inf`` entries get weight 0.
        temperature: ``τ > 0``.
        dim: dimension that sums to one.
    Returns:
        (..., S) weights; an all ``-inf`` slice gives zeros; half precision computed in float32.
    Raises:
        TypeError: non-floating ``scores``.
        ValueError: ``temperature`` not finite and > 0; NaN/``+inf`` scores; ``dim`` out of range.
    """
    check_tensor("scores", scores)
    _check_scores(scores, dim)
    return Shannon(temperature).conjugate_grad(scores, dim=dim)


@dispatch.profiled
def regularized_weights(scores: Tensor, regularizer: Regularizer, *, dim: int = -1) -> Tensor:
    r"""The regularized prediction map ``∇Ω*(s) = argmax_{p∈Δ} <s,p> − Ω(p)`` (Prop. 4.1–4.3).

    Args:
        scores: (..., S) real scores; ``-inf`` entries get weight 0.
        regularizer: :class:`Shannon`, :class:`SquaredL2`, :class:`Tsallis`, or any object with
            ``conjugate_grad(scores, dim)`` (:class:`~.regularizers.Regularizer`).
        dim: dimension that sums to one.
    Returns:
        (..., S) weights summing to one along ``dim`` (all ``-inf`` slices: zeros for the
        built-in regularizers), in the dtype of ``scores``.
    Raises:
        TypeError: non-floating ``scores``; a ``regularizer`` without ``conjugate_grad``.
        ValueError: NaN/``+inf`` scores; ``dim`` out of range.
    """
    check_tensor("scores", scores)
    _check_regularizer(regularizer)
    _check_scores(scores, dim)
    return regularizer.conjugate_grad(scores, dim)


def locality_bias(
    nq: int, nk: int, locality: float | Tensor, *, dtype: torch.dtype, device: torch.device | str
) -> Tensor:
    r"""``−β_h |i − j|``: the locality (ALiBi) score offset of Prop. 4.4.

    Computed exactly as :class:`attnopt.nn.ALiBiPreference`:
    ``-(β.view(H,1,1) * (arange(Nq)[:,None] − arange(Nk)[None,:]).abs().to(β.dtype))``.

    Args:
        nq, nk: query and key lengths.
        locality: ``β`` — a finite number, a 0-d tensor, or an ``(H,)`` tensor (per head).
        dtype, device: of the result (a tensor ``β`` is used in its own dtype, then cast).
    Returns:
        ``(Nq, Nk)`` for a scalar ``β``, ``(H, Nq, Nk)`` for a per-head ``β``.
    Raises:
        ValueError: non-finite ``β`` or a tensor of another shape.
        TypeError: ``β`` neither a number nor a floating tensor.
    """
    pos_q = torch.arange(nq, device=device)
    dist = pos_q[:, None] - torch.arange(nk, device=device)[None, :]
    if isinstance(locality, Tensor):
        if not locality.is_floating_point():
            raise TypeError(f"locality must be a floating-point tensor, got {locality.dtype}")
        if locality.dim() > 1:
            raise ValueError(f"locality must be a scalar or an (H,) tensor, got {tuple(locality.shape)}")
        if any_nonfinite(locality):  # reads under torch.func's wrappers
            raise ValueError("locality must be finite")
        beta = locality.to(device)
        if beta.dim() == 0:
            return (-(beta * dist.abs().to(beta.dtype))).to(dtype)
        return (-(beta.view(-1, 1, 1) * dist.abs().to(beta.dtype))).to(dtype)
    if isinstance(locality, bool) or not isinstance(locality, (int, float)):
        raise TypeError(f"locality must be a number or a tensor, got {type(locality).__name__}")
    if not math.isfinite(locality):
        raise ValueError(f"locality must be finite, got {locality}")
    return -(float(locality) * dist.abs().to(dtype))


@dispatch.profiled
def regularized_attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    regularizer: Regularizer | None = None,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    locality: float | Tensor | None = None,
    is_causal: bool = False,
) -> Tensor:
    r"""Explicit weights of :func:`regularized_attention` (materialized, for analysis).

    .. math:: P_{i\cdot} = \nabla\Omega^*\big(\langle q_i, k_\cdot\rangle\,\mathrm{scale}
              + m_{i\cdot} - \beta_h |i - \cdot|\big)

    Args: as :func:`regularized_attention` (without ``v``).
    Returns:
        (B, H, Nq, Nk) row-stochastic weights (rows with no admissible key are zeros for the
        built-in regularizers), in the dtype of ``q`` (half precision computed in float32).
    Raises:
        ValueError, TypeError: as :func:`regularized_attention`.
    """
    validate_attention(q, k, None, attn_mask)
    reg = Shannon() if regularizer is None else regularizer
    _check_regularizer(reg)
    scores = _scores(q, k, attn_mask, scale, locality, is_causal)
    empty = empty_weights(q, k, locality if isinstance(locality, Tensor) else None)
    if empty is not None:
        return empty
    return reg.conjugate_grad(scores, -1).to(q.dtype)


@dispatch.profiled
def regularized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    regularizer: Regularizer | None = None,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    locality: float | Tensor | None = None,
    is_causal: bool = False,
    block_size: int | None = None,
    dropout_p: float = 0.0,
    impl: dispatch.Impl = "auto",
) -> Tensor:
    r"""Attention whose weights solve a regularized argmax (sdpa-one-sided-eot §3–4).

    .. math:: \mathrm{out}_i = \sum_j p_{ij} v_j,\quad
              p_i = \arg\max_{p\in\Delta} \langle s_i, p\rangle - \Omega(p) - \beta_h\sum_j p_j|i-j|,
              \quad s_{ij} = \langle q_i,k_j\rangle\,\mathrm{scale} + m_{ij}

    ``Shannon(τ)`` gives ``softmax(s/τ)`` (τ = 1 with the default scale is SDPA, Thm 3.3),
    ``SquaredL2()`` sparsemax, ``Tsallis(α)`` α-entmax; ``locality=β`` is ALiBi (Prop. 4.4).

    Args:
        q: (B, H, Nq, d) queries.
        k: (B, H, Nk, d) keys.
        v: (B, H, Nk, dv) values.
        regularizer: default ``Shannon()``; see :func:`regularized_weights`.
        attn_mask: boolean (``True`` = take part) or additive float mask broadcastable to
            (B, H, Nq, Nk).
        scale: score scale (default ``1/sqrt(d)``), > 0.
        locality: ``β`` ≥ 0 typically; a number or an ``(H,)`` tensor (per head, H = q.shape[-3]).
        is_causal: also apply SDPA's top-left causal mask.
        block_size: queries per block in the blocked sparse path (default: about 2^22 scores
            per block).
        dropout_p: dropout probability on the weights ``p`` before the sum over values (as in
            SDPA: applied whenever > 0). A call with ``dropout_p > 0`` runs on the materialized
            ``Nq × Nk`` weights (plain PyTorch ops, :mod:`.._dropout`; ``block_size`` and ``impl``
            are then ignored).
        impl: for ``SquaredL2`` / float-α ``Tsallis``: ``"streaming"`` (the blocked path),
            ``"materialized"`` (scores once, exact thresholds found in place on them, ``P`` saved
            for the backward; :mod:`.materialized`) or ``"auto"`` (by size,
            :func:`attnopt.functional.dispatch.choose_impl`, recorded in
            ``dispatch.last_dispatch["sparse"]``; an explicit ``block_size`` means blocked).
            Ignored by the other regularizers, and under ``torch.func`` transforms (``vmap``,
            ``grad``, ``jacrev``, ``jvp``) and on meta tensors, where the map runs as plain
            PyTorch ops on the materialized ``(…, Nq, Nk)`` weights (no blocking: memory grows
            with ``Nq·Nk``).
    Returns:
        (B, H, Nq, dv) in the dtype of ``q``; a row with no admissible key is zeros (every
        row when ``Nk = 0``; ``Nq = 0`` gives an empty output).
    Raises:
        TypeError: non-tensor or non-floating inputs; a regularizer without ``conjugate_grad``.
        ValueError: NaN or ±inf in ``q``, ``k``, ``v``; a mask that does not broadcast to
            (B, H, Nq, Nk); shapes that do not fit; ``scale <= 0``; non-finite ``locality``; a per-head
            ``locality`` whose length is not H; bad ``block_size``; unknown ``impl``.
    """
    nq, nk, _ = validate_attention(q, k, v, attn_mask)
    reg = Shannon() if regularizer is None else regularizer
    _check_regularizer(reg)
    alpha_scale = resolve_scale(scale, q.shape[-1])
    dispatch.check_impl(impl)
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    target = (*batch, nq, nk)
    mask = additive_mask(attn_mask, target, _compute(q.dtype))
    loc = None if locality is None else _checked_locality(locality, q, nq, nk)
    dropout_p = check_dropout_p(dropout_p)
    empty = empty_attention(q, k, v, locality if isinstance(locality, Tensor) else None)
    if empty is not None:
        return empty
    if dropout_p > 0.0:  # the fused / blocked / SDPA paths never hold p: drop on the materialized map
        weights = reg.conjugate_grad(_scores(q, k, attn_mask, scale, locality, is_causal), -1)
        return dropout_attention(weights, v, dropout_p, q.dtype)
    if isinstance(reg, Tsallis) and not isinstance(reg.alpha, Tensor) and reg.alpha == 1.0:
        reg = Shannon()  # the α → 1 limit of Tsallis is Shannon: softmax, i.e. SDPA
    reference = dispatch.use_reference("sparse" if not isinstance(reg, Shannon) else "regularized", q)
    if isinstance(reg, Shannon) and not reference:
        tau = reg.temperature
        if mask is None and loc is None:
            return flushed_sdpa(q, k, v, is_causal=is_causal, scale=alpha_scale / tau)
        causal = causal_additive_mask(nq, nk, q.dtype, q.device) if is_causal else None
        bias = combine_additive(mask.to(q.dtype) if mask is not None else None, loc, causal)
        assert bias is not None
        if tau != 1.0:
            bias = bias / tau
        return _biased_softmax(q, k, v, bias.to(q.dtype), alpha_scale / tau)
    alpha: float | None = None
    if isinstance(reg, Shannon):
        pass  # (reference: the materialized softmax below)
    elif isinstance(reg, SquaredL2):
        alpha = 2.0
    elif isinstance(reg, Tsallis) and not isinstance(reg.alpha, Tensor) and reg.alpha > 1.0:
        alpha = float(reg.alpha)  # sparse (α > 1): fused / blocked paths; α < 1 is dense: below
    # under torch.func transforms (grad, vmap, ...) the fused / blocked Functions (ctx-style, no vmap
    # rule) give way to the materialized map in plain ops below, and so does every tensor off the CPU
    # (and a compiled graph; the fused kernel's threshold search reads values on the host, the
    # materialized map runs the sort-based closed forms there) and backend("reference")
    if (alpha is not None and not (attn_mask is not None and attn_mask.requires_grad)
            and not (under_transform() or q.is_meta) and not reference and loc is None and gpu.wanted(q)):
        # the Triton kernels (attnopt.functional.triton.sparse): CUDA tensors, or backend("triton")
        from attnopt.functional.triton.sparse import sparse_attention

        dispatch.record("sparse", "triton")
        return sparse_attention(q, k, v, alpha=alpha, attn_mask=attn_mask, scale=alpha_scale,
                                is_causal=is_causal)
    if (alpha is not None and not (attn_mask is not None and attn_mask.requires_grad)
            and not under_transform() and host_readable(q) and not reference):
        beta = None
        if locality is not None:
            beta = _beta_tensor(locality, q)
        rows = 1
        for n in batch:
            rows *= n
        # an explicit block_size asks for the blocked path
        wanted = "streaming" if impl == "auto" and block_size is not None else impl
        path = dispatch.choose_impl("sparse", nq=nq, nk=nk, batch=rows, dtype=q.dtype, impl=wanted)
        if dispatch.record("sparse", path) == "materialized":
            return fused_sparse_attention(q, k, v, alpha=alpha, scale=alpha_scale, mask=mask, beta=beta,
                                          is_causal=is_causal, kernels=_KERNELS)
        return blocked_sparse_attention(
            q, k, v, alpha=alpha, scale=alpha_scale, mask=mask, beta=beta, is_causal=is_causal,
            block_size=block_size, kernels=_KERNELS,
        )
    weights = regularized_attention_weights(
        q, k, regularizer=reg, attn_mask=attn_mask, scale=scale, locality=locality, is_causal=is_causal
    )
    return torch.matmul(weights, v)


def _biased_softmax(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``softmax(scale·qkᵀ + bias) v`` with subnormals flushed where a fused CPU path exists."""
    if under_transform():  # torch.func: the fused Functions are ctx-style (no vmap rule, refuse grad),
        # SDPA's CPU flash kernel has no forward AD: the math in plain ops (rows without keys: zeros)
        compute = _compute(q.dtype)
        s = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * scale + bias.to(compute)
        return torch.matmul(safe_softmax(s, dim=-1), v.to(compute)).to(q.dtype)
    if flash_bias_available(q, k, v, bias):
        return biased_flash_attention(q, k, v, bias, scale)
    if bias.requires_grad and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64):
        return biased_softmax_attention(q, k, v, bias, scale)  # the fused path with a bias gradient
    return sdpa(q, k, v, attn_mask=bias, scale=scale)


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_regularizer(reg: object) -> None:
    if not callable(getattr(reg, "conjugate_grad", None)):
        raise TypeError(
            "regularizer must provide conjugate_grad(scores, dim) (e.g. Shannon(), SquaredL2(), "
            f"Tsallis(1.5)), got {type(reg).__name__}"
        )


def _check_scores(scores: Tensor, dim: int) -> None:
    if not isinstance(dim, int) or not -scores.dim() <= dim < scores.dim():
        raise ValueError(f"dim={dim!r} is out of range for scores with {scores.dim()} dimensions")
    values = host_values(scores)  # under torch.func: the values under the wrappers; None off the CPU
    if values is not None and values.numel() and bool((torch.isnan(values) | torch.isposinf(values)).any()):
        raise ValueError("scores must not contain NaN or +inf (use -inf to mask an entry)")


def _beta_tensor(locality: float | Tensor, q: Tensor) -> Tensor:
    if isinstance(locality, Tensor):
        return locality.to(device=q.device)
    return torch.tensor(float(locality), dtype=_compute(q.dtype), device=q.device)


def _checked_locality(locality: float | Tensor, q: Tensor, nq: int, nk: int) -> Tensor:
    bias = locality_bias(nq, nk, locality, dtype=_compute(q.dtype), device=q.device)
    if bias.dim() == 3:
        heads = q.shape[-3] if q.dim() >= 3 else 1
        if bias.shape[0] != heads:
            raise ValueError(f"per-head locality must have H = {heads} entries, got {bias.shape[0]}")
    return bias


def _scores(
    q: Tensor,
    k: Tensor,
    attn_mask: Tensor | None,
    scale: float | None,
    locality: float | Tensor | None,
    is_causal: bool,
) -> Tensor:
    nq, nk, d = check_attention_inputs(q, k)
    alpha = resolve_scale(scale, d)
    compute = _compute(q.dtype)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    mask = additive_mask(attn_mask, (*batch, nq, nk), compute)
    loc = None if locality is None else _checked_locality(locality, q, nq, nk)
    causal = causal_additive_mask(nq, nk, compute, q.device) if is_causal else None
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * alpha
    bias = combine_additive(mask, loc, causal)
    return scores if bias is None else scores + bias


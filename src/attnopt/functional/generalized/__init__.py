r"""Generalized attention with a preference distribution (fenchel-dual-attention eq. 16–18).

The first-order approximation ``λ ≈ αz`` of the MEM dual gives

.. math:: \hat h = \sum_i t_i\, \frac{u_i \exp(\alpha \langle t_i, z\rangle)}
          {\sum_j u_j \exp(\alpha \langle t_j, z\rangle)}

i.e. softmax attention whose scores get the additive term ``log u``. With queries ``q``
(the evidence ``z``), keys ``k`` (the templates ``t``) and values ``v``:
``out_i = Σ_j softmax_j(α<q_i,k_j> + log u_ij + mask_ij) v_j``. Uniform ``u`` is ordinary
dot-product attention (eq. 16); ``u_ij ∝ exp(b_{j−i})`` is T5's relative position bias (eq. 18).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from attnopt import _func
from attnopt._validation import (
    broadcast_shapes,
    empty_attention,
    empty_weights,
    resolve_scale,
    validate_attention,
)
from attnopt.functional import dispatch
from attnopt.functional import triton as gpu
from attnopt.functional._denormal import sdpa
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.generalized import cpu, materialized, reference
from attnopt.functional.generalized._toeplitz import causal_toeplitz, toeplitz_offsets, toeplitz_table
from attnopt.functional.generalized.bias import check_log_preference_values, preference_to_log, score_bias
from attnopt.functional.generalized.streaming import biased_flash_attention, flash_bias_available

__all__ = [
    "biased_flash_attention",
    "biased_softmax_attention",
    "flash_bias_available",
    "generalized_attention",
    "generalized_weights",
    "preference_to_log",
    "score_bias",
    "check_log_preference_values",
]


@dispatch.profiled
def generalized_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    preference: Tensor | None = None,
    log_preference: Tensor | None = None,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    impl: dispatch.Impl = "auto",
) -> Tensor:
    r"""Generalized (preference-weighted) attention, fenchel-dual-attention eq. (16)–(18).

    .. math:: \mathrm{out}_i = \sum_j \frac{u_{ij} \exp(\alpha\langle q_i,k_j\rangle + m_{ij})}
              {\sum_{j'} u_{ij'} \exp(\alpha\langle q_i,k_{j'}\rangle + m_{ij'})}\, v_j

    Computed as softmax attention with the additive bias ``log u + m`` (no ``Nq × Nk`` is
    formed for a key-only preference of shape ``(B, H, 1, Nk)``) by one of these paths;
    ``dispatch.last_dispatch["generalized"]`` says which class ran (and
    ``last_dispatch["generalized_kernel"]`` which kernel: ``"fused"``, ``"node"``, ``"flash"``,
    ``"sdpa"`` or, under ``torch.func``, ``"plain"``):

    * ``"materialized"`` by the whole-call C path (``"fused"``) — a relative-position bias from
      :class:`~attnopt.nn.T5RelativePreference` or :class:`~attnopt.nn.ALiBiPreference` (also with
      ``is_causal``; no mask, no ``preference``, ``impl="auto"``) under autograd, CPU float32/64,
      ``q, k, v`` of one shape ``(B, H, N, ·)``, ``B·H·Nq·Nk <= FUSED_BELOW`` (2^23) and
      ``Nq·Nk <= FUSED_MAX_HEAD_SCORES`` (2^16), where the C kernels and PyTorch's BLAS are
      available (:func:`attnopt._native.blas`): the forward is one C call, the backward one, and
      the gradient reaches T5's bucket table directly;
    * ``"materialized"`` (``"node"``) — one fused node (:mod:`.materialized`, or its C passes in
      :mod:`.cpu`) that works through the batch·head dim in L2-sized chunks, with a closed-form
      backward; the only path with a gradient for the bias (a learned T5 bias), O(Nq·Nk) memory
      as SDPA's math kernel;
    * ``"streaming"`` (``"flash"``, ``"sdpa"``) — on CPU (float32/64, 4-D inputs, d = dv)
      PyTorch's fused flash kernel with the bias as its float mask; elsewhere
      :func:`torch.nn.functional.scaled_dot_product_attention`. O(N) memory beyond the bias.

    * ``"triton"`` (``"flex"``) — on a CUDA tensor with Triton installed, or under
      ``attnopt.backend("triton")``, a call with a preference or mask (no dropout) runs
      FlexAttention with the bias in its ``score_mod`` (:mod:`attnopt.functional.triton.flex_generalized`:
      a T5 / ALiBi bias as its per-offset values, O(N); the gradient reaches the bucket table).

    Inside ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``, ...) a call with a bias runs
    ``softmax(α·QKᵀ + bias) V`` by plain PyTorch ops (``last_dispatch["generalized_kernel"]`` is
    ``"plain"``): the C paths cannot read wrapped tensors, and SDPA refuses a bias that needs a
    gradient there.

    ``log_preference`` is checked for NaN / ``+inf`` once per tensor version (a cached bias such
    as ALiBi's is read once), or, on the materialized path, after the fact from the output.

    Both fused CPU paths flush subnormal numbers to zero while they run (weights below
    float32's 1.2e-38, e.g. far keys under ALiBi, whose subnormal arithmetic made SDPA's
    backward with the same mask 2.5× slower); the result differs from exact arithmetic only
    by such weights.

    Args:
        q: (B, H, Nq, d) queries — the evidence ``z``.
        k: (B, H, Nk, d) keys — the templates ``t``.
        v: (B, H, Nk, dv) values.
        preference: ``u >= 0`` broadcastable to (B, H, Nq, Nk); need not be normalized
            (scaling a row of ``u`` changes nothing); ``0`` masks a key.
        log_preference: ``log u`` instead of ``u`` (any real, ``-inf`` masks a key).
        attn_mask: boolean (``True`` = take part) or additive float mask, broadcastable to
            (B, H, Nq, Nk).
        scale: the reliability ``α`` (default ``1/sqrt(d)``); must be > 0.
        is_causal: also apply SDPA's top-left causal mask.
        dropout_p: dropout probability on the weights (as in SDPA).
        impl: ``"materialized"``, ``"streaming"`` or ``"auto"``. For a full ``(…, Nq, Nk)``
            bias on CPU under autograd, ``auto`` streams through SDPA itself when
            ``B·H·Nq·Nk <= SDPA_BELOW`` (2^17: B·H = 8 at N = 128; with the bias as its
            ``attn_mask``, its math kernel when the bias needs a gradient — the Python node's
            per-call cost made it 1.2–2× that at B·H = 8, N = 64–128; a bias that needs a
            gradient: ``SDPA_BELOW_LEARNED_NATIVE`` = 2^14 where the node's C passes run, which
            beat SDPA's math kernel from B·H = 8, N = 64 on); above it,
            materialized when the bias requires grad, or, for a constant bias, when
            ``B·H·Nq·Nk <= dispatch.CROSSOVERS["generalized"]`` (2^20: B·H = 64 at
            N = 128; the chunked materialized path was 0.9–1.0× plain SDPA there, the flash
            path 1.1–1.2×; above it they tie and streaming keeps O(N) memory) — or
            ``NATIVE_CROSSOVER`` (2^26) where the node's C passes run and ``Nq·Nk >= 2^16``;
            otherwise streaming. Forward-only calls stream (on the C path: from ``Nq·Nk >= 2^18``
            they take the node), as do a key-only bias and ``dropout_p > 0`` (SDPA).
            A streaming call whose ``log_preference`` spreads over at most
            :data:`SUBNORMAL_FREE_RANGE` (ALiBi up to N = 128, T5) calls SDPA directly; a
            wider one (or a mask) runs the flash kernel with subnormals flushed.

    Returns:
        (B, H, Nq, dv). A row whose preference/mask excludes every key is all zeros, with
        finite gradients; ``Nk = 0`` gives zeros, ``Nq = 0`` (or an empty batch) an empty
        output. Any strided layout is accepted (README, "Layout and conventions").

    Raises:
        ValueError: both ``preference`` and ``log_preference``; a negative or non-finite
            preference; NaN or ±inf in ``q``, ``k`` or ``v``; shapes or a mask that do not
            broadcast to (B, H, Nq, Nk); ``scale <= 0``; ``dropout_p`` not in [0, 1); unknown
            ``impl``.
        TypeError: non-tensor or non-floating inputs.
    """
    if dispatch.use_reference("generalized", q):  # plain PyTorch, any device
        return _reference(q, k, v, preference, log_preference, attn_mask, scale, is_causal, dropout_p, impl)
    if (log_preference is not None and impl == "auto" and preference is None and attn_mask is None
            and dropout_p == 0.0 and not gpu.wanted(q)):
        # small sizes: a relative-position bias in one C call each way
        t = THRESHOLDS
        table = toeplitz_table(log_preference)
        offsets = toeplitz_offsets(log_preference) if table is None else None
        out = None
        if table is not None or offsets is not None:
            out = cpu.fused_attention(q, k, v, log_preference, table, offsets, scale, is_causal,
                                      t.generalized_wholecall_below, t.generalized_wholecall_max_head_scores)
        if out is not None:
            dispatch.record("generalized_kernel", "fused")
            dispatch.record("generalized", "materialized")
            return out
    validate_attention(q, k, v, attn_mask)
    alpha = resolve_scale(scale, q.shape[-1])
    dispatch.check_impl(impl)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    empty = empty_attention(q, k, v, preference, log_preference)
    if empty is not None:
        score_bias(q, k, preference, log_preference, attn_mask, is_causal)  # the same checks as otherwise
        return empty
    if preference is None and log_preference is None and attn_mask is None:
        dispatch.record("generalized", "streaming")
        dispatch.record("generalized_kernel", "sdpa")
        return sdpa(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=alpha)
    if dropout_p == 0.0 and not _func.under_transform() and gpu.wanted(q):  # FlexAttention
        from attnopt.functional.triton.flex_generalized import flex_generalized_attention

        dispatch.record("generalized", "triton")
        dispatch.record("generalized_kernel", "flex")
        return flex_generalized_attention(q, k, v, preference=preference, log_preference=log_preference,
                                          attn_mask=attn_mask, scale=alpha, is_causal=is_causal)
    # log_preference's values are checked below, once per path (the fused node checks its output)
    bias = score_bias(q, k, preference, log_preference, attn_mask, is_causal, check_values=False)
    if bias is not None and _func.under_transform():  # torch.func, forward AD: plain differentiable ops
        return _transformed(q, k, v, bias, log_preference, alpha, dropout_p)
    if bias is not None and dropout_p == 0.0 and cpu.traced_ops_apply(q, k, v):
        # torch.compile / export on CPU: the C passes as one op (attnopt::bs_fwd / bs_bwd) in the graph
        # (the whole-call bsf path needs the Toeplitz marks, which traced tensors do not carry)
        dispatch.record("generalized", "materialized")
        dispatch.record("generalized_kernel", "node")
        return biased_softmax_attention(q, k, v, bias, alpha)
    if is_causal and log_preference is not None and attn_mask is None and bias is not None:
        bias = causal_toeplitz(log_preference, bias)  # a relative-position bias stays one (see ._toeplitz)
    path = _path(q, k, v, bias, dropout_p, impl)
    if path == "materialized":
        dispatch.record("generalized_kernel", "node")
        return biased_softmax_attention(q, k, v, bias, alpha)  # type: ignore[arg-type]
    lo = hi = 0.0
    if log_preference is not None:
        lo, hi = check_log_preference_values(log_preference)
    plain = attn_mask is None and preference is None and hi - lo <= SUBNORMAL_FREE_RANGE
    if path == "flash" and not plain:
        dispatch.record("generalized_kernel", "flash")
        return biased_flash_attention(q, k, v, bias, alpha)  # type: ignore[arg-type]
    dispatch.record("generalized_kernel", "sdpa")
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    return sdpa(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=alpha)


#: Largest spread ``max − min`` of a log-preference for which the streaming path calls SDPA
#: itself rather than the flash kernel with subnormals flushed: the bias alone cannot push a
#: weight below float32's smallest normal (``e^{-87}``), so the flush (and its custom autograd
#: node, ~0.15 ms a call) buys nothing — ALiBi up to N = 128 (spread ``(N − 1)/2``), a T5 bias.
#: (A range of values, not a size: it stays here, not in :mod:`.._thresholds`.)
SUBNORMAL_FREE_RANGE = 64.0


def biased_softmax_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``softmax(scale·QKᵀ + bias) V`` materialized (inputs validated): the node's C passes
    (:mod:`.cpu`) where they run (traced by ``torch.compile`` / ``torch.export``: as the op
    ``attnopt::bs_fwd``), else its PyTorch version (:mod:`.materialized`)."""
    orig, compute = q.dtype, materialized.compute_dtype(q)
    qkv = q.to(compute), k.to(compute), v.to(compute)
    nonempty = all(x.numel() for x in qkv)
    traced = nonempty and cpu.traced_ops_apply(*qkv)  # torch.compile / export: the op attnopt::bs_fwd
    lib = cpu.library(*qkv, bias) if nonempty and not traced else None
    # the C path takes q, k, v of any strides (they are copied into its own layout anyway)
    contiguous = lib is None and not traced
    (qc, kc, vc), b4, batch = materialized.batched(*qkv, bias.to(compute), contiguous=contiguous)
    if traced:
        out = cpu.biased_softmax_op(qc, kc, vc, b4, scale)
    elif lib is not None:
        # a relative-position bias's values per offset j − i (heads flattened: no longer one row per head)
        offsets = toeplitz_offsets(bias) if len(batch) == 2 else None
        out = cpu.native_biased_softmax(lib, qc, kc, vc, b4, scale, offsets)
    else:
        out = materialized.biased_softmax_node(qc, kc, vc, b4, scale)
    shape = (*batch, q.shape[-2], v.shape[-1])
    if out.shape != shape:  # (a reshape to the same shape is an autograd node too)
        out = out.reshape(shape)
    return out.to(orig)


def _reference(
    q: Tensor, k: Tensor, v: Tensor, preference: Tensor | None, log_preference: Tensor | None,
    attn_mask: Tensor | None, scale: float | None, is_causal: bool, dropout_p: float, impl: str,
) -> Tensor:
    """``softmax(α·QKᵀ + log u + mask) V`` by plain PyTorch ops (``backend("reference")``)."""
    validate_attention(q, k, v, attn_mask)
    alpha = resolve_scale(scale, q.shape[-1])
    dispatch.check_impl(impl)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    bias = score_bias(q, k, preference, log_preference, attn_mask, is_causal)
    empty = empty_attention(q, k, v, preference, log_preference)
    if empty is not None:
        return empty
    return reference.attention(q, k, v, bias, alpha, dropout_p)


def _transformed(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, log_preference: Tensor | None, alpha: float,
    dropout_p: float,
) -> Tensor:
    """``softmax(α·QKᵀ + bias) V`` by PyTorch ops: the path inside ``torch.func`` transforms (``vmap``,
    ``grad``, ``jacrev``, ...), whose wrapped tensors have no memory for the C paths, whose rules the
    old-style autograd nodes lack, and under which SDPA refuses a bias that requires grad.
    ``impl`` is not followed there; ``last_dispatch`` records ``"materialized"`` / ``"plain"``."""
    if log_preference is not None:
        check_log_preference_values(log_preference)
    dispatch.record("generalized", "materialized")
    dispatch.record("generalized_kernel", "plain")
    return reference.attention(q, k, v, bias, alpha, dropout_p)


def _sdpa_below(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> int:
    """``generalized_sdpa_below``, or ``generalized_sdpa_below_learned_native`` for a learned bias on
    the C path (:mod:`.._thresholds`)."""
    if bias.requires_grad and cpu.library(q, k, v, bias) is not None:
        return THRESHOLDS.generalized_sdpa_below_learned_native
    return THRESHOLDS.generalized_sdpa_below


def _path(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, dropout_p: float, impl: str) -> str:
    """``"materialized"``, ``"flash"`` or ``"sdpa"`` (see ``impl`` in :func:`generalized_attention`).

    Records ``"materialized"`` or ``"streaming"`` (flash or SDPA) in ``dispatch.last_dispatch``.
    """
    if bias is None or dropout_p > 0.0:
        dispatch.record("generalized", "streaming")
        return "sdpa"
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, bias))
    rows = 0
    if impl == "auto" and grad and bias.shape[-2] != 1 and q.device.type == "cpu":
        rows = math.prod(broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], bias.shape[:-2]))
    if impl != "auto":
        path = impl
    elif rows and rows * q.shape[-2] * k.shape[-2] <= _sdpa_below(q, k, v, bias):
        path = "streaming"  # SDPA itself: its C++ autograd beats a Python node's per-call cost here
    elif bias.requires_grad and grad:
        path = "materialized"  # the fastest path with a bias gradient above generalized_sdpa_below
    elif rows:
        path = dispatch.choose_impl("generalized", nq=q.shape[-2], nk=k.shape[-2], batch=rows, dtype=q.dtype)
        per_head = q.shape[-2] * k.shape[-2]
        if (path == "streaming" and rows * per_head <= THRESHOLDS.generalized_native_crossover
                and per_head >= THRESHOLDS.generalized_native_min_head_scores
                and cpu.library(q, k, v, bias) is not None):
            path = "materialized"
    elif (not grad and impl == "auto" and bias.shape[-2] != 1 and q.device.type == "cpu"
          and q.shape[-2] * k.shape[-2] >= THRESHOLDS.generalized_native_forward_min_head_scores
          and cpu.library(q, k, v, bias) is not None):
        path = "materialized"  # a forward-only call on the node's C passes (one chunk of memory)
    else:
        path = "streaming"
    if dispatch.record("generalized", path) == "materialized":
        return "materialized"
    return "flash" if flash_bias_available(q, k, v, bias) else "sdpa"


@dispatch.profiled
def generalized_weights(
    q: Tensor,
    k: Tensor,
    *,
    preference: Tensor | None = None,
    log_preference: Tensor | None = None,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
) -> Tensor:
    r"""The explicit weights of :func:`generalized_attention` (for analysis), eq. (16)–(18).

    .. math:: \pi_{ij} = \frac{u_{ij} \exp(\alpha\langle q_i,k_j\rangle + m_{ij})}
              {\sum_{j'} u_{ij'} \exp(\alpha\langle q_i,k_{j'}\rangle + m_{ij'})}

    Args: as :func:`generalized_attention` (without ``v``).

    Returns:
        (B, H, Nq, Nk) row-stochastic weights; rows with no admissible key are zeros.
        Half-precision inputs are normalized in float32 and returned in the input dtype.

    Raises:
        ValueError, TypeError: as :func:`generalized_attention`.
    """
    validate_attention(q, k, None, attn_mask)
    alpha = resolve_scale(scale, q.shape[-1])
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    bias = score_bias(q, k, preference, log_preference, attn_mask, is_causal)
    empty = empty_weights(q, k, preference, log_preference)
    if empty is not None:
        return empty
    return reference.weights(q, k, bias, alpha, dropout_p).to(q.dtype)

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
import torch.nn.functional as F
from torch import Tensor

from attnopt import _func
from attnopt._validation import (
    additive_mask,
    broadcast_shapes,
    causal_additive_mask,
    check_attention_inputs,
    check_broadcastable,
    combine_additive,
    device_assert,
    empty_attention,
    empty_weights,
    host_values,
    resolve_scale,
    to_rank,
    validate_attention,
)
from attnopt.functional import _generalized_native, dispatch
from attnopt.functional import triton as gpu
from attnopt.functional._denormal import sdpa
from attnopt.functional._generalized_fused import (
    biased_flash_attention,
    biased_softmax_attention,
    flash_bias_available,
)
from attnopt.functional._softmax import safe_softmax
from attnopt.functional._toeplitz import causal_toeplitz

__all__ = [
    "generalized_attention",
    "generalized_weights",
    "preference_to_log",
    "score_bias",
    "check_log_preference_values",
]


def _safe_log(u: Tensor) -> Tensor:
    """``log u`` with ``log 0 = -inf`` and a zero (not NaN) gradient at ``u = 0``."""
    positive = u > 0
    return torch.where(positive, torch.where(positive, u, torch.ones_like(u)).log(), float("-inf"))


def preference_to_log(
    preference: Tensor | None,
    log_preference: Tensor | None,
    target: tuple[int, ...],
    dtype: torch.dtype,
    check_values: bool = True,
) -> Tensor | None:
    """Validate ``preference``/``log_preference`` and return ``log u`` broadcastable to ``target``.

    ``check_values=False`` skips the pass over ``log_preference``'s values (NaN / ``+inf``): for
    callers that check them later (:func:`check_log_preference_values`, or the fused node's
    post-hoc check).

    Raises:
        ValueError: both given; negative, NaN or infinite ``preference``; NaN or ``+inf`` in
            ``log_preference``; a shape that does not broadcast to ``target``.
        TypeError: not a floating-point tensor.
    """
    if preference is not None and log_preference is not None:
        raise ValueError("pass either preference or log_preference, not both")
    if preference is not None:
        if not isinstance(preference, Tensor) or not preference.is_floating_point():
            raise TypeError("preference must be a floating-point torch.Tensor")
        check_broadcastable("preference", preference, target)
        values = host_values(preference) if preference.numel() else None  # VALUE_CHECKS policy
        if values is not None:
            low, high = torch.aminmax(values.detach())  # one pass; NaN propagates
            if not bool(torch.isfinite(high)) or not bool(torch.isfinite(low)):
                raise ValueError("preference must be finite (use 0 to mask a key)")
            if bool(low < 0):
                raise ValueError("preference must be non-negative (u >= 0; 0 masks a key)")
        elif preference.numel():
            device_assert(preference, lambda t: (t.amin() >= 0) & torch.isfinite(t.amax()),
                          "preference must be finite and non-negative")
        log_u = _safe_log(preference) if preference.requires_grad else preference.log()
        return to_rank(log_u.to(dtype), len(target))
    if log_preference is not None:
        if not isinstance(log_preference, Tensor) or not log_preference.is_floating_point():
            raise TypeError("log_preference must be a floating-point torch.Tensor")
        check_broadcastable("log_preference", log_preference, target)
        if check_values:
            check_log_preference_values(log_preference)
        return to_rank(log_preference.to(dtype), len(target))
    return None


_LOG_PREFERENCE_ERROR = "log_preference must not contain NaN or +inf (-inf masks a key)"


def check_log_preference_values(log_preference: Tensor) -> tuple[float, float]:
    """``(min, max)`` of ``log_preference`` after checking it has no NaN or ``+inf``.

    One ``aminmax`` pass, remembered on the tensor with its version counter: a cached bias
    (ALiBi's, built once per length) is read once, not on every call; an in-place change
    bumps the version and is read again. Where value checks do not read on the host
    (:func:`attnopt._validation.host_values`: off the CPU, compiling, meta) nothing is read and
    ``(0.0, 0.0)`` is returned (the streaming path then calls SDPA directly).

    Raises:
        ValueError: NaN or ``+inf`` in ``log_preference``.
    """
    if not log_preference.numel():
        return 0.0, 0.0
    stamp = getattr(log_preference, "_attnopt_range", None)
    if stamp is not None and stamp[0] == log_preference._version:
        lo, hi = stamp[1], stamp[2]
    else:
        under = host_values(log_preference)  # under torch.func: the values under the wrappers
        if under is None:  # off the CPU, compiling, meta / fake: nothing read on the host
            device_assert(log_preference, lambda t: t.amax() < float("inf"), _LOG_PREFERENCE_ERROR)
            return 0.0, 0.0
        values = log_preference if _func.level() is None else under
        low, high = torch.aminmax(values.detach())  # NaN propagates into both
        lo, hi = float(low), float(high)
        if values is log_preference and not torch.compiler.is_compiling():
            log_preference._attnopt_range = (log_preference._version, lo, hi)  # type: ignore[attr-defined]
    if not hi < float("inf"):
        raise ValueError(_LOG_PREFERENCE_ERROR)
    return lo, hi


def score_bias(
    q: Tensor,
    k: Tensor,
    preference: Tensor | None,
    log_preference: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    dtype: torch.dtype | None = None,
    check_values: bool = True,
) -> Tensor | None:
    """Validated ``log u + mask (+ causal)`` broadcastable to ``(..., Nq, Nk)``, or ``None``.

    Shared by every mechanism that takes a preference next to SDPA-style masks. ``dtype``
    defaults to ``q.dtype``; ``check_values`` as in :func:`preference_to_log`.
    """
    nq, nk, _ = check_attention_inputs(q, k)
    dtype = q.dtype if dtype is None else dtype
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2])
    target = (*batch, nq, nk)
    log_u = preference_to_log(preference, log_preference, target, dtype, check_values)
    mask = additive_mask(attn_mask, target, dtype)
    causal = causal_additive_mask(nq, nk, dtype, q.device) if is_causal else None
    return combine_additive(log_u, mask, causal)


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
    * ``"materialized"`` (``"node"``) — one fused node (:mod:`._generalized_fused`) that works through
      the batch·head dim in L2-sized chunks, with a closed-form backward; the only path with a
      gradient for the bias (a learned T5 bias), O(Nq·Nk) memory as SDPA's math kernel;
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
        out = _generalized_native.fused_attention(q, k, v, log_preference, scale, is_causal, FUSED_BELOW,
                                                  FUSED_MAX_HEAD_SCORES)
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
    if is_causal and log_preference is not None and attn_mask is None and bias is not None:
        bias = causal_toeplitz(log_preference, bias)  # a relative-position bias stays one (see _toeplitz)
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


#: ``B·H·Nq·Nk`` up to which ``impl="auto"`` runs a relative-position bias (T5's table, ALiBi's
#: offsets; :mod:`._toeplitz`) under autograd by the whole-call C path
#: (:func:`._generalized_native.fused_attention`: the forward one C call, the backward one, the
#: products by PyTorch's own BLAS called from C), where it applies; ``last_dispatch`` then has
#: ``"generalized_kernel": "fused"``. fwd+bwd incl. the bias module, d = 64, float32, 1 thread,
#: × plain SDPA in the same run, fused vs the previous dispatch (SDPA with the bias below
#: SDPA_BELOW*, else the node), loaded 2-core machine: T5 / ALiBi B·H = 8, N = 64 (2^15)
#: 1.14–1.18 vs 2.06 / 0.94 vs 1.27; N = 128 0.94 vs 1.25 / 0.83 vs 1.12; N = 256 0.85–0.91 vs
#: 1.07 / 0.78 vs 0.98; B·H = 64, N = 64 0.72 vs 0.97 / 0.63 vs 0.87; N = 128 0.65 vs 0.81 /
#: 0.59 vs 0.73; N = 256 (2^22) 0.81 vs 0.90 / 0.74 vs 0.89. Train step of ``TransformerEncoder``
#: (E = 64, H = 4, B = 32, d = 16: B·H = 128) × the softmax arm: N = 128 (2^21) T5 0.97 vs 1.09,
#: ALiBi 0.93 vs 1.01; N = 256 (2^23) 1.03 vs 1.08, 1.03 vs 1.15. Heads of N = 512 (2^18 scores)
#: lose: B·H = 8 T5 1.14 vs 1.03; train step N = 512 1.36 vs 1.10 (a head's E, dP and dS, 1 MB
#: each, no longer share the 2 MB L2).
FUSED_BELOW = 1 << 23
#: ... and one head's ``Nq·Nk`` at most this (N = 256; see above for N = 512).
FUSED_MAX_HEAD_SCORES = 1 << 16
#: Largest spread ``max − min`` of a log-preference for which the streaming path calls SDPA
#: itself rather than the flash kernel with subnormals flushed: the bias alone cannot push a
#: weight below float32's smallest normal (``e^{-87}``), so the flush (and its custom autograd
#: node, ~0.15 ms a call) buys nothing — ALiBi up to N = 128 (spread ``(N − 1)/2``), a T5 bias.
SUBNORMAL_FREE_RANGE = 64.0
#: ``B·H·Nq·Nk`` at or below which ``impl="auto"`` hands a full bias under autograd to SDPA itself
#: (its math kernel when the bias needs a gradient): at B·H = 8, N = 64–128 the fused node's
#: per-call cost (a Python autograd node, six small matmuls) made it 1.2–2× SDPA with the same bias.
SDPA_BELOW = 1 << 17
#: The same bound for a bias that needs a gradient when the node's C passes run
#: (:mod:`._generalized_native`): fwd+bwd with a learned T5 bias, d = 64, 1 thread, vs SDPA
#: (math kernel) with the same bias: B·H = 8, N = 64: 2.30× vs 2.40× plain SDPA; N = 128:
#: 1.33× vs 1.59×; B·H = 64, N = 32: 1.52× vs 1.89×; B·H = 8, N = 32 (2^13): 4.25× vs 3.94×.
#: Rechecked after the T5 module and the node shed per-call work (the same call through
#: ``generalized_attention``, node vs SDPA's math kernel, × plain SDPA, interleaved rounds, loaded
#: machine): N = 32 3.78× vs 3.74× (a tie), N = 64 2.06× vs 2.41×, N = 96 1.49× vs 1.94×,
#: N = 128 1.23× vs 1.57×.
SDPA_BELOW_LEARNED_NATIVE = 1 << 14
#: ``B·H·Nq·Nk`` up to which ``auto`` takes the materialized node for a *constant* full bias when
#: its C passes run (else ``dispatch.CROSSOVERS["generalized"]``, 2^20): it held O(chunk) memory
#: (``E`` recomputed) and beat the flash kernel at every size measured — ALiBi, d = 64, fwd+bwd,
#: 1 thread, materialized vs streaming × plain SDPA: B·H = 8, N = 512 0.97 vs 1.13; B·H = 64,
#: N = 256 0.94 vs 1.12; B·H = 64, N = 512 0.99 vs 1.14; B·H = 8, N = 1024 1.11 vs 1.16;
#: B·H = 64, N = 1024 (2^26) 1.08 vs 1.15; d = 16, B·H = 128, N = 512 1.13–1.17 vs 1.18–1.20.
#: 2^26 is where measuring stopped.
NATIVE_CROSSOVER = 1 << 26
#: ... provided one head's ``Nq·Nk`` is at least this: in the ``TransformerEncoder`` train step
#: (E = 64, H = 4, B = 32, d = 16, inputs the strided views of split heads) ALiBi on the node's C
#: path vs the flash kernel × the softmax arm: N = 128 1.06–1.07 vs 1.01–1.02 (the flash kernel
#: reads the strided heads in place; the node copies them), N = 256 1.05 vs 1.04, N = 512 1.08–1.10
#: vs 1.10–1.12.
NATIVE_MIN_HEAD_SCORES = 1 << 16
#: One head's ``Nq·Nk`` from which a forward-only call (no autograd) takes the node's C passes
#: rather than streaming (forward, 1 thread, × plain SDPA's forward, node vs flash kernel with the
#: bias): N = 512: ALiBi 1.23 vs 1.31, T5 1.45 vs 1.60 (B·H = 8, d = 64); 1.21 vs 1.33, 1.20 vs 1.38
#: (B·H = 128, d = 16); N = 256, d = 64: 1.78 vs 1.58, 1.88 vs 1.87; N = 128, d = 16: 1.44 vs 1.30.
NATIVE_FORWARD_MIN_HEAD_SCORES = 1 << 18


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
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * alpha
    if bias is not None:
        scores = scores + bias.to(compute)
    weights = safe_softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.matmul(weights, v.to(compute)).to(q.dtype)


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
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * alpha + bias.to(compute)
    weights = safe_softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.matmul(weights, v.to(compute)).to(q.dtype)


def _sdpa_below(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> int:
    """:data:`SDPA_BELOW`, or :data:`SDPA_BELOW_LEARNED_NATIVE` for a learned bias on the C path."""
    if bias.requires_grad and _generalized_native.library(q, k, v, bias) is not None:
        return SDPA_BELOW_LEARNED_NATIVE
    return SDPA_BELOW


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
        path = "materialized"  # the fastest path with a bias gradient above SDPA_BELOW
    elif rows:
        path = dispatch.choose_impl("generalized", nq=q.shape[-2], nk=k.shape[-2], batch=rows, dtype=q.dtype)
        per_head = q.shape[-2] * k.shape[-2]
        if (path == "streaming" and rows * per_head <= NATIVE_CROSSOVER and per_head >= NATIVE_MIN_HEAD_SCORES
                and _generalized_native.library(q, k, v, bias) is not None):
            path = "materialized"
    elif (not grad and impl == "auto" and bias.shape[-2] != 1 and q.device.type == "cpu"
          and q.shape[-2] * k.shape[-2] >= NATIVE_FORWARD_MIN_HEAD_SCORES
          and _generalized_native.library(q, k, v, bias) is not None):
        path = "materialized"  # a forward-only call on the node's C passes (one chunk of memory)
    else:
        path = "streaming"
    if dispatch.record("generalized", path) == "materialized":
        return "materialized"
    return "flash" if flash_bias_available(q, k, v, bias) else "sdpa"


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
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * alpha
    if bias is not None:
        scores = scores + bias.to(compute)
    weights = safe_softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights.to(q.dtype)

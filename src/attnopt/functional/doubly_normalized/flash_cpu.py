r"""O(N)-memory Sinkhorn/DNAS passes on PyTorch's fused CPU flash kernel (internal).

Every pass is one call of ``aten._scaled_dot_product_flash_attention_for_cpu`` (returns the
output *and* the row log-sum-exp) and its backward; nothing of size ``Nq × Nk`` is formed
unless the caller passes a full ``(B, H, Nq, Nk)`` mask (which is that size already).

Notation (doubly-normalized-attention eq. 6–10, design.md §3): scores ``s_ij = scale <q_i,k_j>
+ m_ij``; column potential ``c_j = LSE_i s_ij``; row pass ``π_ij = exp(s_ij − c_j − r_i)``.

* :class:`_Dnas1` — DNAS (K = 1) with a hand-fused backward: one (d+1)-wide backward call
  (the appended column of ones in ``q`` returns ``γ_j = −Σ_i ∂L/∂t_ij`` in the last column of
  ``dk``), then ``dk_j += scale γ_j A_j`` (``A_j = Σ_i ξ_ij q_i`` is a free by-product of the
  column pass) and ``dq_i += scale e^{r_i} Σ_j π_ij γ_j k_j`` (one forward call with values
  ``γ ⊙ k``; ``e^{r_i} ≤ Nk`` so it never overflows).
* :class:`_LsePass` / :class:`_AttnPass` — one log-sum-exp pass / one row-softmax attention
  pass against a differentiable key potential; chained they give Sinkhorn-K with an unrolled
  backward: an LSE pass costs one swapped (d+1)-wide *forward* call, the final attention pass
  one (d+1)-wide backward call.

Kernel contract (checked here, never assumed). The kernel reads the last dimension of ``q``,
``k``, ``v`` (and of the incoming gradient) as if it had stride 1: a tensor whose last
dimension is strided (keys kept as a ``(B, H, d, N)`` buffer and passed transposed, a
channels-permuted or ``[..., ::2]``-sliced tensor, a stride-0 expand of the head dim) gives
silently wrong values. :func:`_fit` copies exactly those tensors and leaves every other
layout (transposed heads/sequence, sliced batch, stride-0 batch or sequence) as is. The
kernel also dies with SIGFPE on an empty ``B``, ``H``, ``Nq`` or ``Nk``; :func:`_flash`
raises instead, and the public ops answer empty shapes before they get here
(``attnopt._validation.empty_attention``).

Subnormals. Every kernel call runs with subnormal floats flushed to zero
(:func:`attnopt.functional._denormal.flush_denormal`). The passes subtract potentials from
the scores, so with peaked scores (large ``|scale <q_i, k_j>|``) or a full mask with large
finite negative entries many ``exp`` values land below float32's smallest normal number,
where x86 arithmetic is ~100× slower: flushing made DNAS fwd+bwd (B·H = 8, d = 64, 1 thread)
1.6× faster at N = 512 and 1.9× at N = 1024 with scores of standard deviation ~16, and
3.4–3.9× faster with a full mask drawn from [−120, 0]; unchanged (±2 %) on ordinary inputs.
The sums change by less than float precision (a weight below 1.2e-38 next to a row maximum
of weight ≥ 1/N).

Tensors are 4-D ``(B, H, N, ·)``, potentials and validity masks ``(B, H, N)``; ``valid``
masks mark the keys that may take part (a key no row can see gets ``-inf``, never
``+inf − inf``). The kernel returns ``lse = 0`` (not ``-inf``)
for a row without admissible key; callers use their own validity masks for such rows.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.functional._autograd import first_order_only, refuse_double_backward
from attnopt.functional._denormal import flush_denormal

_NO_DOUBLE = ("doubly_normalized_attention (streaming)", "use doubly_normalized_weights(q, k, ...) @ v")

__all__ = ["flash_available", "dnas1", "lse_pass", "attn_pass", "key_bias", "run_passes"]

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def flash_available(x: Tensor) -> bool:
    """Whether the fused CPU kernel handles ``x`` (CPU, floating dtype it implements)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _pot_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def key_bias(pot: Tensor, valid: Tensor, full_mask: Tensor | None) -> Tensor:
    """Kernel mask ``-pot_j`` (``-inf`` where not ``valid``), plus ``full_mask`` if given.

    ``pot``/``valid``: (B, H, Nk); ``full_mask``: (B, H, Nq, Nk) additive. Returns a contiguous
    (B, H, 1, Nk) or (B, H, Nq, Nk) tensor.
    """
    neg = torch.where(valid, -pot, torch.full_like(pot, float("-inf")))[..., None, :]
    if full_mask is not None:
        return (full_mask + neg).contiguous()
    return neg.contiguous()


def _fit(x: Tensor) -> Tensor:
    """``x`` in a layout the kernel reads correctly: unit stride on the last dim (a copy only then)."""
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        return x.contiguous()
    return x


def _check_sizes(*xs: Tensor) -> None:
    """Refuse empty sizes, on which the kernel crashes the process (SIGFPE) instead of raising."""
    for x in xs:
        if 0 in x.shape[:-1]:
            raise ValueError(f"internal: the fused CPU kernel cannot take an empty shape {tuple(x.shape)}")


def _flash(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    _check_sizes(q, k, v)
    q, k, v = _fit(q), _fit(k), _fit(v)
    if mask is not None:
        mask = _fit(mask)
    with flush_denormal():
        out, lse = _fwd(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse.contiguous()


def _pad_last(x: Tensor, width: int, fill_last: float | None = None) -> Tensor:
    """Zero-pad the last dim of ``x`` to ``width``; optionally set the new last column."""
    out = x.new_zeros((*x.shape[:-1], width))
    out[..., : x.shape[-1]] = x
    if fill_last is not None:
        out[..., -1] = fill_last
    return out


def _augmented_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
    causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Attention backward plus ``colsum_j = Σ_i ∂L/∂t_ij`` in one (max(d, dv)+1, rounded up to 8)-wide call.

    ``q`` gets an extra column of ones and ``k`` a zero column, so the scores are unchanged
    and the last column of ``dk`` is ``scale · colsum``. Returns ``(dq, dk, dv, colsum)``.
    """
    d, dv = q.shape[-1], v.shape[-1]
    w = -(-(max(d, dv) + 1) // 8) * 8  # a multiple of 8 runs ~15% faster than d + 1 in the kernel
    _check_sizes(q, k, v)
    qa, ka, va = _pad_last(q, w, 1.0), _pad_last(k, w), _pad_last(v, w)  # fresh, contiguous copies
    da, oa = _pad_last(dout.to(q.dtype), w), _pad_last(out, w)
    with flush_denormal():
        dq, dk, dvv = _bwd(da, qa, ka, va, oa, lse, 0.0, causal, attn_mask=mask, scale=scale)
    return dq[..., :d], dk[..., :d], dvv[..., :dv], dk[..., -1].to(_pot_dtype(q)) / scale


def _swapped(
    rows: Tensor, cols: Tensor, values: Tensor, bias: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Flash call with the roles of queries and keys swapped (``rows`` attend to ``cols``).

    ``bias`` is a kernel mask over ``cols`` ((B,H,1,Nc) or a transposed full (B,H,Nr,Nc)).
    A causal (top-left, Nr = Nc) mask becomes anti-causal when swapped; reversing both
    sequences turns it back into the kernel's causal mask.
    """
    if not causal:
        return _flash(rows, cols, values, bias, False, scale)
    rb = None if bias is None else bias.flip(-1).contiguous()
    out, lse = _flash(rows.flip(-2), cols.flip(-2), values.flip(-2), rb, True, scale)
    return out.flip(-2), lse.flip(-1)


def _column_pass(
    q: Tensor, k: Tensor, row_bias: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``A_j = Σ_i ξ_ij q_i`` and ``c_j = LSE_i(s_ij + row_bias)`` (q and k swapped)."""
    return _swapped(k, q, q, row_bias, causal, scale)


class _Dnas1(torch.autograd.Function):
    """DNAS (one Sinkhorn step) with O(N) memory in forward and backward."""

    @staticmethod
    def forward(
        q: Tensor, k: Tensor, v: Tensor, row_valid: Tensor, col_valid: Tensor,
        full_mask: Tensor | None, causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        qmask: Tensor | None = None
        if full_mask is not None or not bool(row_valid.all()):  # no mask at all is the kernel's fast path
            zeros = torch.zeros(row_valid.shape, dtype=_pot_dtype(q), device=q.device)
            qmask = key_bias(zeros, row_valid, None if full_mask is None else full_mask.transpose(-1, -2))
        a, c = _column_pass(q, k, qmask, causal, scale)
        bias = key_bias(c, col_valid, full_mask)
        out, r = _flash(q, k, v, bias, causal, scale)
        return out, r, c, a, bias

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        q, k, v, _, col_valid, _, causal, scale = inputs
        out, r, _, a, bias = output
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, out, r, a, bias, col_valid)
        ctx.mark_non_differentiable(r, output[2], a, bias)

    @staticmethod
    def backward(ctx: Any, dout: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, *_NO_DOUBLE)
        q, k, v, out, r, a, bias, col_valid = ctx.saved_tensors
        scale, causal = ctx.scale, ctx.causal
        dq0, dk0, dv, colsum = _augmented_backward(dout, q, k, v, out, r, bias, causal, scale)
        gamma = torch.where(col_valid, -colsum, torch.zeros_like(colsum))  # ∂L/∂c_j
        dk = dk0 + (scale * gamma[..., None] * a.to(gamma.dtype)).to(dk0.dtype)
        gk = (gamma[..., None] * k.to(gamma.dtype)).to(q.dtype)
        corr = _flash(q, k, gk, bias, causal, scale)[0]
        dq = dq0 + (scale * r.exp()[..., None] * corr.to(r.dtype)).to(dq0.dtype)
        return first_order_only(ctx, (dq, dk, dv, None, None, None, None, None), _NO_DOUBLE[0])


def dnas1(
    q: Tensor, k: Tensor, v: Tensor, row_valid: Tensor, col_valid: Tensor,
    full_mask: Tensor | None, causal: bool, scale: float,
) -> Tensor:
    """DNAS output (B, H, Nq, dv); rows without admissible key are zeros."""
    out: Tensor = _Dnas1.apply(q, k, v, row_valid, col_valid, full_mask, causal, scale)[0]
    return out


class _LsePass(torch.autograd.Function):
    """``l_i = LSE_j(scale <a_i, b_j> + m_ij − pot_j)`` (``pot`` differentiable).

    Backward with ``P_ij = exp(t_ij − l_i)``: ``da_i = scale ḡ_i (P b)_i`` (the forward's own
    output) and the transposed products ``Σ_i ḡ_i P_ij [a_i, 1]`` from one swapped *forward*
    call (cheaper than a backward call): with the mask ``−l_i`` over the rows of ``a`` it
    returns ``softmax_i(s_ij − l_i)``-averages and ``c'_j``, and ``P_ij = e^{c'_j − pot_j}``
    times that softmax (``c'_j − pot_j = log Σ_i P_ij <= log Na``, no overflow).
    """

    @staticmethod
    def forward(
        a: Tensor, b: Tensor, pot: Tensor, valid: Tensor, full_mask: Tensor | None, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        bias = key_bias(pot, valid, full_mask)
        out, lse = _flash(a, b, b, bias, causal, scale)
        return lse, out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        a, b, pot, valid, full_mask, causal, scale = inputs
        lse, out = output
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(a, b, out, lse, pot, valid, full_mask)
        ctx.mark_non_differentiable(out)

    @staticmethod
    def backward(ctx: Any, dl: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, *_NO_DOUBLE)
        a, b, out, lse, pot, valid, full_mask = ctx.saved_tensors
        scale, pdt, d = ctx.scale, lse.dtype, a.shape[-1]
        g = dl.to(pdt)
        da = (scale * g[..., None] * out.to(pdt)).to(a.dtype)
        w = -(-(d + 1) // 8) * 8
        x = _pad_last((g[..., None] * a.to(pdt)).to(a.dtype), w)
        x[..., -1] = g.to(a.dtype)
        everyone = torch.ones(lse.shape, dtype=torch.bool, device=lse.device)
        rb = key_bias(lse, everyone, None if full_mask is None else full_mask.transpose(-1, -2))
        t, c2 = _swapped(_pad_last(b, w), _pad_last(a, w), x, rb, ctx.causal, scale)
        zero = torch.zeros_like(pot)
        factor = torch.where(valid, torch.exp(torch.where(valid, c2.to(pdt) - pot, zero)), zero)
        t = t.to(pdt) * factor[..., None]  # an excluded column j has P_ij = 0 for every i
        db = (scale * t[..., :d]).to(b.dtype)
        dpot = torch.where(valid, -t[..., -1], zero)
        return first_order_only(ctx, (da, db, dpot, None, None, None, None), _NO_DOUBLE[0])


def lse_pass(
    a: Tensor, b: Tensor, pot: Tensor, valid: Tensor, full_mask: Tensor | None, causal: bool, scale: float
) -> Tensor:
    """(B, H, Na) log-sum-exp of ``scale <a_i, b_j> + m_ij − pot_j`` over valid ``j``."""
    lse: Tensor = _LsePass.apply(a, b, pot, valid, full_mask, causal, scale)[0]
    return lse


class _AttnPass(torch.autograd.Function):
    """``out_i = Σ_j softmax_j(scale <q_i, k_j> + m_ij − pot_j) v_j`` (``pot`` differentiable)."""

    @staticmethod
    def forward(
        q: Tensor, k: Tensor, v: Tensor, pot: Tensor, valid: Tensor, full_mask: Tensor | None,
        causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        bias = key_bias(pot, valid, full_mask)
        out, lse = _flash(q, k, v, bias, causal, scale)
        return out, lse, bias

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        q, k, v, _, valid, _, causal, scale = inputs
        out, lse, bias = output
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, out, lse, bias, valid)
        ctx.mark_non_differentiable(lse, bias)

    @staticmethod
    def backward(ctx: Any, dout: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, *_NO_DOUBLE)
        q, k, v, out, lse, bias, valid = ctx.saved_tensors
        dq, dk, dv, colsum = _augmented_backward(dout, q, k, v, out, lse, bias, ctx.causal, ctx.scale)
        dpot = torch.where(valid, -colsum, torch.zeros_like(colsum))
        return first_order_only(ctx, (dq, dk, dv, dpot, None, None, None, None), _NO_DOUBLE[0])


def attn_pass(
    q: Tensor, k: Tensor, v: Tensor, pot: Tensor, valid: Tensor, full_mask: Tensor | None,
    causal: bool, scale: float,
) -> Tensor:
    """(B, H, Nq, dv) row-softmax attention against the key potential ``pot``."""
    out: Tensor = _AttnPass.apply(q, k, v, pot, valid, full_mask, causal, scale)[0]
    return out


def run_passes(
    q: Tensor, k: Tensor, v: Tensor, iterations: int, full: Tensor | None, is_causal: bool,
    row_valid: Tensor, col_valid: Tensor, scale: float,
) -> Tensor:
    """Sinkhorn-K (K >= 1) on 4-D CPU tensors with the flash-kernel passes (``is_causal`` only with
    ``Nq = Nk``): :func:`dnas1` for K = 1, else chained :func:`lse_pass` / :func:`attn_pass`."""
    d, dv = q.shape[-1], v.shape[-1]
    if d != dv:  # the kernel wants one head size: zero columns change neither scores nor outputs
        w = max(d, dv)
        q, k, v = F.pad(q, (0, w - d)), F.pad(k, (0, w - d)), F.pad(v, (0, w - dv))
    if iterations == 1:
        return dnas1(q, k, v, row_valid, col_valid, full, is_causal, scale)[..., :dv]
    full_t = None if full is None else full.transpose(-1, -2)

    def col(f: Tensor) -> Tensor:
        if is_causal:
            flipped = lse_pass(k.flip(-2), q.flip(-2), f.flip(-1), row_valid.flip(-1), None, True, scale)
            return flipped.flip(-1)
        return lse_pass(k, q, f, row_valid, full_t, False, scale)

    f = torch.zeros(row_valid.shape, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                    device=q.device)
    g = col(f)
    for _ in range(iterations - 1):
        f = lse_pass(q, k, g, col_valid, full, is_causal, scale)
        g = col(f)
    return attn_pass(q, k, v, g, col_valid, full, is_causal, scale)[..., :dv]

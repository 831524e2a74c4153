r"""Flush subnormal floats to zero around a kernel call (internal).

Under a position bias such as ALiBi (``log u_ij = −m_h |i − j|``) most far keys get softmax
weights below float32's smallest normal number (``exp(−88) ≈ 1.2e-38``): the arithmetic on
those *subnormal* numbers is ~100× slower on x86, and made PyTorch's fused CPU attention
backward 2.5× slower with an ALiBi mask than without (B·H = 8, N = 512, d = 64). Flushing
them to zero (the CPU's FTZ/DAZ modes, :func:`torch.set_flush_denormal`) changes no sum at
float precision — a weight below 1.2e-38 next to a row maximum of weight ≥ 1/Nk — and
removes that cost. (Inside the block subnormal *inputs* also read as zero: entries of
``q``, ``k``, ``v`` or of a gradient below 1.2e-38 in float32, 2.2e-308 in float64.)

:func:`flush_denormal` turns the mode on for the calling thread only for the duration of
the block and restores the previous mode (PyTorch has no getter: the mode is read by
converting a subnormal constant), also when the block raises. With several intra-op
threads, the worker threads keep their own mode.

Peaked scores alone do it too: plain softmax attention (SDPA, B·H = 8, d = 64, 1 thread)
with scores of standard deviation ~16 took 2.1× (N = 512) and 2.8× (N = 1024) longer for
fwd+bwd than with the mode on. :func:`flushed_sdpa` is SDPA's fused CPU kernel with the
mode on in its forward and backward.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt._native import has_storage
from attnopt.functional._autograd import double_backward, tracked_vjp, under_transform

__all__ = ["flush_denormal", "flush_denormal_on", "flushed_sdpa", "sdpa"]

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def flush_denormal_on() -> bool:
    """Whether this thread flushes subnormal floats to zero now."""
    return torch.tensor(1e-40, dtype=torch.float32).item() == 0.0


@contextmanager
def flush_denormal(x: Tensor | None = None) -> Iterator[None]:
    """Flush subnormals to zero inside the block (this thread); the previous mode is restored.

    A no-op while ``torch.compile`` traces (the mode is a CPU thread state, not a graph op; reading
    it would break the graph) and where ``x`` (the kernel's input) is not a CPU tensor."""
    if torch.compiler.is_compiling() or (x is not None and not x.is_cpu) or flush_denormal_on():
        yield
        return
    switched = torch.set_flush_denormal(True)  # False (and no change) where unsupported
    try:
        yield
    finally:
        if switched:
            torch.set_flush_denormal(False)


class _FlushedFlash(torch.autograd.Function):
    """PyTorch's fused CPU flash kernel (no mask) with subnormals flushed in forward and backward."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None
    ) -> Tensor:
        with flush_denormal():
            out, lse = _fwd(q, k, v, 0.0, is_causal, scale=scale)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if double_backward(ctx):  # create_graph=True: SDPA's math form, tracked (exact double backward)
            return tracked_vjp(ctx, _math_sdpa, (q, k, v, ctx.is_causal, ctx.scale), dout)
        with flush_denormal():
            dq, dk, dv = _bwd(dout.to(q.dtype).contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal,
                              scale=ctx.scale)
        return dq, dk, dv, None, None


def _math_sdpa(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None) -> Tensor:
    """``softmax(scale·QKᵀ (+ causal −inf)) V`` in plain differentiable ops."""
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _flash_ok(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> bool:
    return (
        q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
        and q.dtype == k.dtype == v.dtype and q.dim() == k.dim() == v.dim() == 4
        and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and 0 not in q.shape[:-1] and 0 not in k.shape[:-1]
        and (not is_causal or q.shape[-2] == k.shape[-2])
        and has_storage(q, k, v)  # torch.func wrapped tensors: plain SDPA (the Function is ctx-style)
    )


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention``; under ``torch.func`` transforms its math kernel.

    SDPA's fused CPU flash kernel has no forward AD and no double backward, so ``jvp`` /
    ``jacfwd``, ``grad(grad(f))`` and ordinary autograd around ``torch.func.grad(f)`` (second
    derivatives of a transformed function) fail there; the math kernel is plain differentiable
    ops with the same semantics (a row with no admissible key gives zeros).
    """
    if under_transform():
        out: Tensor = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale)[0]
        return out
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def flushed_sdpa(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False, scale: float | None = None
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)`` without a mask, with
    subnormals flushed in forward and backward where SDPA's fused CPU flash kernel applies.

    That is CPU float32/float64, 4-D ``(B, H, N, d)`` inputs of one batch shape and head size,
    non-empty, and ``Nq = Nk`` with ``is_causal``, outside ``torch.func`` transforms; anything else
    is plain SDPA. Inputs whose
    last dimension is not unit-stride are copied (the kernel's layout contract). No double
    backward on the fused path (as SDPA's flash kernel).
    """
    if not _flash_ok(q, k, v, is_causal):
        return sdpa(q, k, v, is_causal=is_causal, scale=scale)
    qkv = [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v)]
    out: Tensor = _FlushedFlash.apply(*qkv, is_causal, scale)
    return out

r"""Softmax attention with an additive bias on PyTorch's fused CPU flash kernel (internal).

fenchel-dual-attention eq. (16)–(18): ``O = softmax(scale·QKᵀ + b) V``, *streaming*:
``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward with the bias as the
kernel's float mask, O(N) memory beyond the bias; no gradient for the bias. It runs with
subnormals flushed to zero (:mod:`attnopt.functional._denormal`): under ALiBi most far keys have
subnormal weights, which made SDPA's backward with the same mask 2.5× slower.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnopt.functional._autograd import refuse_double_backward
from attnopt.functional._denormal import flush_denormal

__all__ = ["biased_flash_attention", "flash_bias_available"]

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _FlashBias(torch.autograd.Function):
    """The CPU flash kernel with a constant float mask, subnormals flushed (no bias gradient)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float
    ) -> Tensor:
        with flush_denormal():
            out, lse = _fwd(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, bias, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "generalized_attention (fused bias)", "use generalized_weights(...) @ v")
        q, k, v, bias, out, lse = ctx.saved_tensors
        with flush_denormal():
            dq, dk, dv = _bwd(dout.to(q.dtype).contiguous(), q, k, v, out, lse, 0.0, False,
                              attn_mask=bias, scale=ctx.scale)
        return dq, dk, dv, None, None


def flash_bias_available(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> bool:
    """Whether :func:`biased_flash_attention` takes these inputs.

    CPU, float32/64, 4-D inputs of one batch shape, ``d = dv``, a bias without gradient.
    """
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and q.dim() == k.dim() == v.dim() == 4 and q.dtype == k.dtype == v.dtype
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == v.shape[-1]
            and not bias.requires_grad)


def biased_flash_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``softmax(scale·QKᵀ + bias) V`` by the fused CPU flash kernel (see :func:`flash_bias_available`)."""
    qkv = tuple(x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # the kernel's layout contract
    b = bias.to(q.dtype)
    if b.dim() < 4:
        b = b.reshape((1,) * (4 - b.dim()) + tuple(b.shape))
    if b.stride(-1) != 1 and b.shape[-1] > 1:
        b = b.contiguous()
    out: Tensor = _FlashBias.apply(*qkv, b, scale)
    return out

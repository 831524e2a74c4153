r"""Sampled implicit-kernel attention in one autograd node (internal; small CPU sizes).

implicit-kernel-attention eq. 5–9, 11 for the stock density networks: the spectral points
``w = sign(z)·(c|z| + NN₂(|z|))``, ``z = μ + σ ⊙ e`` with ``[μ, ρ] = NN₁(h)``, ``h`` the keys'
mean per head (:mod:`._spectral_fused`), then attention with the Fourier features of ``w`` and
the L^p key magnitude (:class:`attnopt.functional._kernel_fused._WholeFourier`):

.. math:: O_i = \frac{\sum_j (f(q_i, k_j)^2 + \varepsilon)\, m_j v_j}
                       {\sum_j (f(q_i, k_j)^2 + \varepsilon)\, m_j},
          \qquad \mathrm{KL} = \operatorname{mean}_b \tfrac{R}{2} \textstyle\sum_s \sum_{m,j}
          \tfrac12 (\sigma^2 + \mu^2 - 1 - 2\log\sigma).

The sampler's C call and the attention's C call, forward and backward, run inside one
:class:`torch.autograd.Function`: the points never become an autograd tensor, the keys'
gradient from the summary is added in place (no second node, no expand node, no engine sum),
and the attention's argument checks are made once. At B·H = 8, N = 64 the two nodes and their
glue cost more than the arithmetic. The function, the random stream and every gradient are
those of :meth:`attnopt.nn.ImplicitKernelAttention.attend`'s two-node path, bitwise (tested).

Taken by :meth:`~attnopt.nn.ImplicitKernelAttention.attend` without a mask, ``need_weights``
or dropout, in the quadratic mode, where the C sampler (:func:`._spectral_native.library`)
and the whole-call Fourier path (:func:`attnopt.functional._kernel_fused._whole_call`) both
apply; everything else takes the two nodes.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnopt._validation import any_nonfinite, check_finite
from attnopt.functional import dispatch
from attnopt.functional._autograd import refuse_double_backward
from attnopt.functional._kernel_fused import _whole_call, _WholeFourier
from attnopt.nn._spectral_native import _NativeSpectralSample
from attnopt.nn._spectral_native import library as sampler_library

__all__ = ["sampled_fourier_attention"]


class _Part:
    """The context of one of the two Functions whose forward / backward run inside this node."""

    needs_input_grad: tuple[bool, ...]
    saved_tensors: tuple[Tensor | None, ...]
    add_keys_grad_to: Tensor | None = None

    def __init__(self, needs: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs
        self.saved_tensors = ()

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors

    def with_saved(self, tensors: tuple[Tensor | None, ...]) -> _Part:
        """A copy holding ``tensors`` (one backward call's; ctx's parts never hold a tensor)."""
        out = _Part.__new__(_Part)
        out.__dict__.update(self.__dict__)
        out.saved_tensors = tensors
        return out


#: ``_NativeSpectralSample``'s non-tensor inputs between ``raw`` and the parameters
_SAMPLER_OPTIONS = 4
#: ``_WholeFourier``'s inputs after ``points``
_ATTENTION_OPTIONS = 7


class _SampledFourier(torch.autograd.Function):
    """q, k, v ``(B, H, N, d)``; noise ``(S, B|1, H, R/2, d)``; raw (H, H) or None; then the
    sampler's and the attention's options; then the ``8·S`` network parameters.
    Returns ``(O (B, H, Nq, dv), KL mean (0-d))``."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, noise: Tensor, raw: Tensor | None,
        sampler: tuple[Any, ...], attention: tuple[Any, ...], *params: Tensor,
    ) -> tuple[Tensor, Tensor]:
        scales, lib = sampler
        nsets, coef, eps, p, scale, cfg = attention
        k = k.contiguous()  # once for both calls (heads from a projection are transposed views)
        part1 = _Part((False,) * (3 + _SAMPLER_OPTIONS + len(params)))
        pts, kl = _NativeSpectralSample.forward(part1, k, noise, raw, scales, lib, True, True, *params)
        if any_nonfinite(pts):  # the check NonStationaryFourier.stacked makes (C bit test)
            raise ValueError("spectral points must be finite (the density networks gave NaN or ±inf)")
        part2 = _Part((False, ctx.needs_input_grad[1], False, False) + (False,) * _ATTENTION_OPTIONS)
        out = _WholeFourier.forward(part2, q, k, v, pts, None, eps, coef, nsets, p, scale, cfg)
        ctx.parts = (part1, part2)
        ctx.split = len(part1.saved_tensors)
        ctx.save_for_backward(*part1.saved_tensors, *part2.saved_tensors)
        part1.saved_tensors = part2.saved_tensors = ()  # held by ctx only (out -> ctx -> out: no cycle)
        return out, kl

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dkl: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(
            ctx, "ImplicitKernelAttention (sampled points, whole-call node)",
            "the Fourier-feature attention has no double backward at these sizes either")
        # this call's copies take the saved tensors (ctx's parts never hold one: no out -> ctx -> out
        # cycle, and a retained graph can run backward again)
        saved = ctx.saved_tensors
        part1 = ctx.parts[0].with_saved(saved[: ctx.split])
        part2 = ctx.parts[1].with_saved(saved[ctx.split :])
        need_q, need_k, need_v, need_noise, need_raw = ctx.needs_input_grad[:5]
        need_params = ctx.needs_input_grad[7:]
        need_points = need_k or need_noise or need_raw or any(need_params)
        part2.needs_input_grad = (need_q, need_k, need_v, need_points) + (False,) * _ATTENTION_OPTIONS
        dq, dk, dv, dpts = _WholeFourier.backward(part2, dout)[:4]
        dnoise = draw = None
        grads: tuple[Tensor | None, ...] = (None,) * len(need_params)
        if dpts is not None:
            options = (False,) * _SAMPLER_OPTIONS
            part1.needs_input_grad = (need_k, need_noise, need_raw, *options, *need_params)
            part1.add_keys_grad_to = dk  # the summary's share of dk (dh/N on every key) added in C
            sampled = _NativeSpectralSample.backward(part1, dpts, dkl)
            dnoise, draw = sampled[1:3]
            grads = sampled[3 + _SAMPLER_OPTIONS :]
        return (dq, dk, dv, dnoise, draw, None, None, *grads)


def sampled_fourier_attention(
    q: Tensor, k: Tensor, v: Tensor, noise: Tensor, raw: Tensor | None, scales: tuple[float, ...],
    params: list[Tensor], p: float, eps: float,
) -> tuple[Tensor, Tensor] | None:
    """``(O, KL batch mean)`` in one node, or None where it does not apply.

    Args:
        q, k, v: ``(B, H, N, d)`` heads (no mask).
        noise: ``(S, B|1, H, R/2, d)`` base noise.
        raw: the copula's raw parameter ``(H, H)`` or None.
        scales: the densities' ``base_scale`` per set.
        params: :func:`._spectral_fused.fusable` of the densities.
        p: the magnitude exponent (``1 <= p <= 2``).
        eps: the ``ε`` of ``f² + ε`` (``> 0``).
    """
    if not (eps > 0 and 1.0 <= p <= 2.0) or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    same = q.shape[:2] == k.shape[:2] == v.shape[:2] and k.shape[2] == v.shape[2] and q.shape[3] == k.shape[3]
    if not same:
        return None  # (the two-node path reports bad shapes)
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        return None
    nq, nk = q.shape[2], k.shape[2]
    path = dispatch.choose_impl("kernel", nq=nq, nk=nk, batch=q.shape[0] * q.shape[1], dtype=q.dtype)
    if path != "materialized":
        return None
    lib = sampler_library(k, noise, raw, params, True)
    if lib is None:
        return None
    nsets = len(scales)
    r = 2 * noise.shape[-2]
    # the attention's checks, with the points' stand-in: k has their dtype, device and storage kind
    cfg = _whole_call(q, k, v, k, None)
    if cfg is None:
        return None
    check_finite(q=q, k=k, v=v)  # kernel_attention's entry check (shapes and dtypes are checked above)
    dispatch.record("kernel", "materialized")
    coef = 1.0 / math.sqrt(r) if nsets == 1 else 1.0 / (2 * math.sqrt(r))
    scale = 1.0 / math.sqrt(q.shape[-1])
    out: tuple[Tensor, Tensor] = _SampledFourier.apply(
        q, k, v, noise, raw, (scales, lib), (nsets, coef, float(eps), float(p), scale, cfg), *params)
    return out

r"""The L^p magnitude of kernel attention (implicit-kernel-attention eq. 9, 11) (internal).

The key term ``s‖k_j‖_p²/2`` of ``α_ij ∝ sim(q_i, k_j) exp(s(‖q_i‖_p² + ‖k_j‖_p²)/2)`` (the query
term is constant along a row and cancels), with a closed-form backward that stays finite at
``x = 0`` for every ``p``. Shared by the router, the fused nodes and the Triton kernels.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnopt.functional._autograd import double_backward, under_transform

__all__ = ["key_bias", "log_magnitude"]


def log_magnitude(x: Tensor, p: float, scale: float) -> Tensor:
    r"""``s·‖x‖_p²/2`` per row: (..., N, d) -> (..., N), in float64 for ``p < 1``.

    For ``p < 1`` the norm grows like ``d^{2/p}`` and would overflow float32, so it is computed
    in float64 (and clamped below float64's maximum: beyond that the largest keys tie). Exact
    zeros get a zero gradient.
    """
    if 1 <= p <= 2 and x.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        # (Σ|x|^p)^{2/p}: both powers have exponent >= 1, so it is finite with a zero gradient
        # at 0; one node with a closed-form backward, ~20 small ops cheaper than the guarded
        # log-domain form below
        dt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        if p == 2:
            total = x.to(dt).square().sum(-1)
            return (0.5 * scale * total).clamp(max=torch.finfo(dt).max / 8)
        if torch.compiler.is_compiling():  # dynamo cannot trace a Function with a custom jvp:
            # the same function in plain ops (gradient 0 at x_i = 0 too: both exponents >= 1)
            total = x.to(dt).abs().pow(float(p)).sum(-1)
            return (0.5 * scale * total.pow(2.0 / p)).clamp(max=torch.finfo(dt).max / 8)
        out: Tensor = _LpHalfSquare.apply(x.to(dt), float(p), float(scale))[0]
        return out
    if p < 1:
        dt = torch.float64
    else:
        dt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    ax = x.to(dt).abs()
    pos = ax > 0
    powed = torch.where(pos, torch.where(pos, ax, torch.ones_like(ax)).pow(p), torch.zeros_like(ax))
    total = powed.sum(-1)
    tpos = total > 0
    safe_total = torch.where(tpos, total, torch.ones_like(total))
    log_total = torch.where(tpos, safe_total.log(), total.new_tensor(-1e4))
    la = math.log(0.5 * scale) + (2.0 / p) * log_total
    return la.clamp(max=math.log(torch.finfo(dt).max) - 2.0).exp()


def _abs_pow(ax: Tensor, e: float) -> Tensor:
    """``|x|^e`` for ``0 <= e <= 1`` by the cheapest exact op (``pow`` is ~10× a ``sqrt``)."""
    if e == 0.5:
        return ax.sqrt()
    if e == 1.0:
        return ax
    if e == 0.0:
        return torch.ones_like(ax)
    return ax.pow(e)


class _LpHalfSquare(torch.autograd.Function):
    r"""``a = s·(Σ_i |x_i|^p)^{2/p} / 2`` for ``1 <= p <= 2`` (the L^p magnitude, eq. 11).

    Backward: ``∂a/∂x_i = s·T^{2/p−1}·|x_i|^{p−1}·sign(x_i)`` with ``T = Σ|x|^p`` (0 where
    ``x_i = 0`` for ``p > 1``; ``T^{2/p−1}`` has a non-negative exponent).
    """

    generate_vmap_rule = True  # forward and backward are out-of-place torch ops: vmap batches them

    @staticmethod
    def forward(x: Tensor, p: float, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        ax = x.abs()
        pw = _abs_pow(ax, p - 1.0)  # |x|^{p-1}
        total = (ax * pw).sum(-1)
        cap = torch.finfo(x.dtype).max / 8
        out = (0.5 * scale * total.pow(2.0 / p)).clamp(max=cap)
        return out, pw, total

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
        # new-style (forward without ctx) so that torch.func transforms accept it
        x, p, scale = inputs
        out, pw, total = output
        ctx.p, ctx.scale = p, scale
        ctx.mark_non_differentiable(pw, total)
        live = out < torch.finfo(x.dtype).max / 8
        ctx.save_for_backward(x, pw, total, live)
        if under_transform():  # forward mode happens there only (torch.func, forward_ad dual levels)
            ctx.save_for_forward(x, live)

    @staticmethod
    def jvp(ctx: Any, x_t: Tensor, *_: Any) -> tuple[Tensor, None, None]:
        """Forward mode (``torch.func.jvp`` / ``jacfwd``, ``torch.autograd.forward_ad``): the
        backward's formula contracted with the tangent, recomputed from ``x`` in tracked ops (so
        that it is differentiable again, e.g. under ``hessian``)."""
        x, live = ctx.saved_for_forward
        ax = x.abs()
        pw = _abs_pow(ax, ctx.p - 1.0)
        total = (ax * pw).sum(-1)
        coef = torch.where(live, ctx.scale * total.pow(2.0 / ctx.p - 1.0), 0.0)
        return coef * (pw * x.sign() * x_t).sum(-1), None, None

    @staticmethod
    def backward(
        ctx: Any, g: Tensor, _gpw: Tensor | None, _gtotal: Tensor | None
    ) -> tuple[Tensor | None, None, None]:
        x, pw, total, live = ctx.saved_tensors
        if double_backward(ctx):  # create_graph=True: recompute with tracked ops (exact double backward)
            ax = x.abs()
            pw = _abs_pow(ax, ctx.p - 1.0)
            total = (ax * pw).sum(-1)
        coef = torch.where(live, g * ctx.scale * total.pow(2.0 / ctx.p - 1.0), 0.0)
        return pw * x.sign() * coef.unsqueeze(-1), None, None


def key_bias(k: Tensor, magnitude_p: float | None, scale: float, dtype: torch.dtype) -> Tensor | None:
    """Key magnitude ``s‖k_j‖_p²/2`` shifted by its (detached) max over keys: (..., 1, Nk), ≤ 0."""
    if magnitude_p is None:
        return None
    a = log_magnitude(k, float(magnitude_p), scale)
    a = a - a.amax(dim=-1, keepdim=True).detach()
    return a.to(dtype).unsqueeze(-2)

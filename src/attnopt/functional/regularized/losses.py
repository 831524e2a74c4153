r"""Fenchel–Young losses of the sparse maps: sparsemax loss and α-entmax loss (every α > 0).

For a regularizer Ω and its map ``p = ∇Ω*(s) = argmax_{p∈Δ} <s,p> − Ω(p)``
(sdpa-one-sided-eot §4; Blondel, Martins & Niculae, 2020),

.. math:: L_Ω(s; y) = Ω^*(s) + Ω(y) − \langle s, y\rangle
          = \langle s, p − y\rangle + Ω(y) − Ω(p) \;\ge 0,
          \qquad \nabla_s L_Ω = p − y,

zero iff ``p = y``. With the Tsallis regularizer
``Ω_α(p) = Σ_j (p_j^α − p_j)/(α(α−1))`` this is the α-entmax loss (``α = 2``: sparsemax loss,
``α = 1``: Shannon, i.e. ``cross_entropy`` for class indices and ``KL(y‖softmax s)`` for a
target distribution).

How it is computed: ``p`` by :func:`attnopt.functional.regularized.entmax` without autograd; the loss is
``<s, p − y> + Ω_α(y) − Ω_α(p)`` with ``p`` held fixed, so the gradient in ``s`` is exactly
``p − y`` (closed form, no backward through the map) and, for a tensor α, the gradient in α
is ``∂_α Ω_α(y) − ∂_α Ω_α(p)`` (envelope theorem). ``Ω_α`` is evaluated as
``(1/α) Σ p log p · E((α−1) log p)`` with ``E(x) = (eˣ − 1)/x``, finite and smooth across α = 1.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt._validation import check_tensor, device_assert, host_readable, host_values
from attnopt.functional.regularized._maps import entmax

__all__ = ["entmax_loss", "sparsemax_loss", "tsallis_negentropy"]

Reduction = Literal["none", "mean", "sum"]
_E_TERMS = 16  # Taylor terms of (e^x − 1)/x used for |x| < 1/2


def _expm1_over_x(x: Tensor) -> Tensor:
    """``(eˣ − 1)/x`` (``1`` at 0), differentiable, without cancellation."""
    small = x.abs() < 0.5
    xd = torch.where(small, torch.ones_like(x), x)
    direct = torch.expm1(xd) / xd
    series = torch.full_like(x, 1.0 / math.factorial(_E_TERMS + 1))
    for k in range(_E_TERMS - 1, -1, -1):
        series = series * x + 1.0 / math.factorial(k + 1)
    return torch.where(small, series, direct)


def tsallis_negentropy(p: Tensor, alpha: float | Tensor, dim: int = -1) -> Tensor:
    r"""``Ω_α(p) = Σ_j (p_j^α − p_j)/(α(α−1))`` along ``dim`` (``α = 1``: ``Σ p log p``).

    Computed as ``(1/α) Σ_j p_j l_j E((α−1) l_j)``, ``l = log p``, ``E(x) = (eˣ−1)/x``: exact for
    every α > 0, continuous (and differentiable in α) at α = 1; ``p_j = 0`` contributes 0.

    Args:
        p: (..., C) non-negative weights (a point of the simplex along ``dim``).
        alpha: a float > 0 or a tensor broadcastable to ``p`` with size 1 along ``dim``.
        dim: the simplex dimension.
    Returns:
        (...) the regularizer's value per slice.
    """
    pos = p > 0
    logp = torch.where(pos, p.clamp_min(torch.finfo(p.dtype).tiny).log(), torch.zeros_like(p))
    term = p * logp * _expm1_over_x((alpha - 1) * logp)
    return (term / alpha).sum(dim=dim)


def _check_reduction(reduction: str) -> None:
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")


def _check_scores(scores: Tensor) -> None:
    message = "scores must not contain NaN or +inf (use -inf to rule a class out)"
    values = host_values(scores)  # the VALUE_CHECKS policy
    if values is None:
        device_assert(scores, lambda t: ~(torch.isnan(t) | torch.isposinf(t)).any(), message)
    elif bool((torch.isnan(values) | torch.isposinf(values)).any()):
        raise ValueError(message)


def _targets(scores: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor | None]:
    """Target distribution in class-last layout and the kept mask (class indices only)."""
    check_tensor("target", target, min_dim=0, floating=False)
    if target.is_floating_point():
        if target.shape != scores.shape:
            raise ValueError(
                f"a probability target must have the shape of scores {tuple(scores.shape)}, "
                f"got {tuple(target.shape)}"
            )
        y = target.movedim(1, -1) if scores.dim() > 1 else target
        yv = host_values(y)  # value checks: the VALUE_CHECKS policy (off the CPU: none, or async)
        if yv is None:
            device_assert(
                y, lambda t: ((t >= 0) & torch.isfinite(t)).all() & ((t.sum(-1) - 1).abs() <= 1e-4).all(),
                "a probability target must be finite, non-negative and sum to 1 along dim 1")
        else:
            if bool((yv < 0).any()) or not bool(torch.isfinite(yv).all()):
                raise ValueError("a probability target must be finite and non-negative")
            if not torch.allclose(yv.sum(-1), torch.ones((), dtype=yv.dtype, device=yv.device), atol=1e-4):
                raise ValueError("a probability target must sum to 1 along the class dimension (dim 1)")
        return y.to(scores.dtype), None
    if target.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise TypeError(f"target must hold class indices (int64) or probabilities, got {target.dtype}")
    want = scores.shape[:1] + scores.shape[2:] if scores.dim() > 1 else torch.Size([])
    if target.shape != want:
        raise ValueError(f"class-index target must have shape {tuple(want)}, got {tuple(target.shape)}")
    c = scores.shape[1] if scores.dim() > 1 else scores.shape[0]
    keep = target != ignore_index
    idx = torch.where(keep, target, torch.zeros_like(target)).long()
    message = f"target class indices must be in [0, {c}) (or ignore_index={ignore_index})"
    iv = host_values(idx)
    if iv is None:
        device_assert(idx, lambda t: ((t >= 0) & (t < c)).all(), message)
    elif bool(((iv < 0) | (iv >= c)).any()):
        raise ValueError(message)
    y = F.one_hot(idx, c).to(scores.dtype)
    return y, keep


def _reduce(loss: Tensor, keep: Tensor | None, reduction: str) -> Tensor:
    if keep is not None:
        loss = torch.where(keep, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if keep is None:
        return loss.sum() / max(loss.numel(), 1)
    return loss.sum() / keep.sum().clamp_min(1).to(loss.dtype)  # on the device: no host read


def entmax_loss(
    scores: Tensor,
    target: Tensor,
    alpha: float | Tensor = 1.5,
    *,
    reduction: Reduction = "mean",
    ignore_index: int = -100,
) -> Tensor:
    r"""α-entmax Fenchel–Young loss ``<s, p − y> + Ω_α(y) − Ω_α(p)``, ``p = entmax(s, α)``.

    Layout and ``reduction``/``ignore_index`` as :func:`torch.nn.functional.cross_entropy`:
    ``α = 1`` *is* ``cross_entropy`` for class indices (computed by it); for a probability
    target it is ``cross_entropy − H(y) = KL(y‖softmax s)`` (the Fenchel–Young loss is zero iff
    the map hits the target). Gradient in ``scores``: ``p − y`` (closed form).

    Args:
        scores: (N, C), (C,) or (N, C, d1, …) real scores (``-inf`` allowed: such a class gets
            ``p = 0``; a target on it gives ``+inf``).
        target: class indices (N,) / () / (N, d1, …), or probabilities of the shape of ``scores``.
        alpha: a float > 0, or a tensor of one α per sample, shape (N, d1, …) (or with the class
            dim kept as size 1); a tensor α receives a gradient.
        reduction: ``"none"`` | ``"mean"`` | ``"sum"``; the mean is over non-ignored samples
            (0 when all are ignored, where ``cross_entropy`` gives NaN).
        ignore_index: a class index whose samples give 0 and leave the mean (indices only).
    Returns:
        The loss, per sample (``"none"``) or reduced.
    Raises:
        TypeError: non-floating ``scores``, a target that is neither int nor float.
        ValueError: shapes that do not match, indices out of range, a probability target off
            the simplex, bad ``alpha`` (see :func:`attnopt.functional.regularized.entmax`) or ``reduction``.
    """
    check_tensor("scores", scores)
    _check_scores(scores)
    _check_reduction(reduction)
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    y, keep = _targets(scores, target, ignore_index)
    s = scores.movedim(1, -1) if scores.dim() > 1 else scores
    a: float | Tensor
    if isinstance(alpha, Tensor):
        a = alpha
        if a.dim() == scores.dim() and a.dim() > 1 and a.shape[1] == 1:
            a = a.squeeze(1)
        try:
            a = torch.broadcast_to(a, s.shape[:-1]).unsqueeze(-1)
        except RuntimeError as exc:
            raise ValueError(
                f"alpha of shape {tuple(alpha.shape)} must broadcast to one value per sample "
                f"{tuple(s.shape[:-1])}"
            ) from exc
    else:
        a = alpha
    if isinstance(a, float | int) and not isinstance(a, bool) and float(a) == 1.0:
        if keep is not None:
            if not host_readable(keep):  # no host read: 0 for ignored samples, the mean over kept ones
                ce = F.cross_entropy(scores, target, reduction="none", ignore_index=ignore_index)
                return _reduce(ce, keep, reduction)
            if reduction == "mean" and not bool(keep.any()):
                return scores.sum() * 0.0  # all ignored: 0 (cross_entropy gives NaN)
            return F.cross_entropy(scores, target, reduction=reduction, ignore_index=ignore_index)
        else:
            loss = F.cross_entropy(scores, target.to(scores.dtype), reduction="none")
            loss = loss + torch.special.xlogy(y, y).sum(-1)
        return _reduce(loss, keep, reduction)
    with torch.no_grad():
        p = entmax(s.detach(), a.detach() if isinstance(a, Tensor) else a)
    diff = p - y
    lin = torch.where(diff != 0, s * diff, torch.zeros_like(s)).sum(-1)
    omega_y = tsallis_negentropy(y, a)
    omega_p = tsallis_negentropy(p, a)
    loss = lin + omega_y - omega_p
    return _reduce(loss, keep, reduction)


def sparsemax_loss(
    scores: Tensor, target: Tensor, *, reduction: Reduction = "mean", ignore_index: int = -100
) -> Tensor:
    r"""Sparsemax loss: :func:`entmax_loss` with ``α = 2``,
    ``<s, p − y> + ½‖y‖² − ½‖p‖²``, ``p = sparsemax(s)`` (Martins & Astudillo, 2016)."""
    return entmax_loss(scores, target, 2.0, reduction=reduction, ignore_index=ignore_index)

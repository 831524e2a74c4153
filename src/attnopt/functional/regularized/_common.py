r"""Shared math of the sparse maps (internal helper, not an implementation).

sdpa-one-sided-eot Prop. 4.2–4.3. What every implementation of sparsemax / α-entmax uses: the
shift by the row max (with the NaN / ``+inf`` check), the default tolerances, the map written
from its threshold, ``p = [(α−1)(x − max x) − θ]₊^{1/(α−1)}`` (:func:`map_from_threshold`), and
the closed-form backward ``∂L/∂s = g ⊙ (d − Σ g d / Σ g)``, ``g = p^{2−α}`` on the support
(:func:`closed_form_backward`). :class:`MapKernels` is what the router hands the attention leaves
(:mod:`.materialized`, :mod:`.streaming`): the map implementations it chose, so that leaves never
import each other.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnopt._validation import device_assert, host_values

__all__ = ["MapKernels", "closed_form_backward", "compute_dtype", "default_tol", "map_from_threshold",
           "shift", "warn_not_converged"]

_HALF = (torch.float16, torch.bfloat16)
SCORES_ERROR = "scores must not contain NaN or +inf (use -inf to mask an entry)"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision, else ``dtype``."""
    return torch.float32 if dtype in _HALF else dtype


def default_tol(dtype: torch.dtype) -> float:
    """The default tolerance on ``|Σp − 1|`` of the threshold searches."""
    return 1e-12 if dtype == torch.float64 else 1e-6


def shift(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``x − max x`` along ``dim`` and the mask of slices that are entirely ``−inf``."""
    m = x.amax(dim=dim, keepdim=True)
    check_scores_max(m)
    empty = torch.isneginf(m)
    m = torch.where(empty, torch.zeros_like(m), m)
    return x - m, empty


def check_scores_max(m: Tensor) -> None:
    """NaN / ``+inf`` in the slice maxima ``m``: a ``ValueError`` where value checks read on the
    host (:data:`attnopt._validation.VALUE_CHECKS`), else a device-side assert or nothing."""
    values = host_values(m)
    if values is None:
        device_assert(m, lambda t: ~(torch.isnan(t) | torch.isposinf(t)).all(), SCORES_ERROR)
    elif bool((torch.isnan(values) | torch.isposinf(values)).any()):
        raise ValueError(SCORES_ERROR)


def warn_not_converged(name: str, max_iter: int, err: float) -> None:
    """The ``RuntimeWarning`` of a threshold search that did not reach its tolerance."""
    warnings.warn(
        f"{name}: threshold search did not reach tol after max_iter={max_iter} iterations "
        f"(max |sum p - 1| = {err:.3g})",
        RuntimeWarning,
        stacklevel=4,
    )


def map_from_threshold(x: Tensor, theta: Tensor, alpha: float, dim: int) -> Tensor:
    """``p = [(α−1)(x − max x) − θ]₊^{1/(α−1)}`` (renormalized for α ≠ 2), as in the forward."""
    z, empty = shift(x, dim)
    if alpha != 2.0:
        z.mul_(alpha - 1)
    z.sub_(theta).relu_()
    if alpha == 1.5:
        z.square_()
    elif alpha != 2.0:
        z.pow_(1.0 / (alpha - 1))
    if alpha != 2.0:
        z.div_(z.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny))
    return z.masked_fill_(empty, 0.0)



def closed_form_backward(
    p: Tensor, grad: Tensor, alpha: Tensor | float, dim: int, tracked: bool = False
) -> Tensor:
    """``g ⊙ (d − Σ g d / Σ g)`` with ``g = p^{2−α}`` on the support, in plain PyTorch ops (any device).

    ``tracked``: out-of-place ops, differentiable in ``p``, ``grad`` and ``α`` (double backward);
    they also run under ``torch.func`` transforms (tensors without storage, that the in-place
    forms cannot write into).
    """
    if tracked:
        g = torch.where(p > 0, p.clamp_min(torch.finfo(p.dtype).tiny).pow(2 - alpha), 0.0)
        gsum = g.sum(dim=dim, keepdim=True)
        gd = g * grad
        return gd - g * gd.sum(dim=dim, keepdim=True) / torch.where(gsum > 0, gsum, torch.ones_like(gsum))
    if isinstance(alpha, float) and alpha == 2.0:
        g = torch.sign(p)
    elif isinstance(alpha, float) and alpha == 1.5:
        g = torch.sqrt(p)
    elif isinstance(alpha, float) and alpha < 2.0:
        g = torch.pow(p, 2.0 - alpha)  # 0 off the support
    else:
        g = torch.where(p > 0, p.clamp_min(torch.finfo(p.dtype).tiny).pow(2 - alpha), 0.0)
    gsum = g.sum(dim=dim, keepdim=True)
    out = torch.mul(g, grad)
    q = out.sum(dim=dim, keepdim=True) / torch.where(gsum > 0, gsum, torch.ones_like(gsum))
    return out.sub_(g.mul_(q))


@dataclass(frozen=True)
class MapKernels:
    """The map implementations the router chose, handed to the attention leaves.

    Attributes:
        forward: ``(x, alpha, dim, max_iter, tol) -> (p, θ)`` of the float-α map (θ as in
            :func:`map_from_threshold`).
        backward: ``(p, grad, alpha, dim) -> ∂L/∂x`` (the closed form).
        native_forward: ``(x, alpha, max_iter, in_place=...) -> (p, θ, redo)``, the C kernel of
            sparsemax / 1.5-entmax along the last dim (:func:`.cpu.forward`).
        native_available: whether that kernel runs now (built, ``ATTNOPT_NATIVE`` not ``0``).
        tracked: the attention in tracked plain ops, ``(q, k, v, mask, beta, alpha, scale, causal)
            -> out`` (:func:`.reference.sparse_attention` with the map bound): the double backward.
    """

    forward: Callable[[Tensor, float, int, int, float], tuple[Tensor, Tensor]]
    backward: Callable[[Tensor, Tensor, float, int], Tensor]
    native_forward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    native_available: Callable[[], bool]
    tracked: Callable[..., Tensor]

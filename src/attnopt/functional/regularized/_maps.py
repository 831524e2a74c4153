r"""Sparse prediction maps: sparsemax and α-entmax, and the choice of their implementation (router part).

sdpa-one-sided-eot Prop. 4.2–4.3. Both are regularized argmax maps over the simplex,

.. math:: p^\star = \arg\max_{p \in \Delta} \langle s, p\rangle - \Omega(p),

with ``Ω = ½‖p‖²`` (sparsemax, ``p = [s − θ]₊``) and the Tsallis regularizer
``Ω = Σ_j (p_j^α − p_j) / (α(α−1))`` (α-entmax, ``p = [(α−1)s − θ]₊^{1/(α−1)}``). The
threshold ``θ`` is the root of the decreasing function ``Σ_j p_j(θ) − 1``.

This module is part of the family router (:mod:`attnopt.functional.regularized`): it holds the
public maps, their autograd Functions, and *the* choice of the forward implementation
(:func:`threshold_map`) and of the backward (:func:`map_backward`). The implementations, one per
leaf, none importing another:

=====================  ==========================================  ================================
map                    reference (any device, exact / to ``tol``)  fast paths
=====================  ==========================================  ================================
sparsemax (α = 2)      :mod:`.sort` (sort-based closed form)       C kernel :mod:`.cpu` (CPU, last
                                                                   dim, float32/64)
1.5-entmax             :mod:`.sort`                                C kernel :mod:`.cpu`
other float α > 0,     :mod:`.search` (safeguarded Newton)         :mod:`.groups` (CPU, α > 1, long
tensor α                                                           contiguous rows)
α = 1 (softmax)        ``torch.softmax``                           —
=====================  ==========================================  ================================

Choice (forward): α ∈ {1.5, 2} → the C kernel where it applies (rows it does not settle: the
sort-based form), the sort-based form elsewhere (a GPU, meta / fake tensors, ``dim`` not last,
``backend("reference")``, no C compiler or ``ATTNOPT_NATIVE=0``); while ``torch.compile`` /
``torch.export`` traces CPU tensors and the C library is built, the ``attnopt::sparse_map_fwd`` op
(one node in the graph; rows its C search does not settle take the sort-based value inside the
op, so the graph has no selection). Other α: :mod:`.groups` on long contiguous CPU rows where the
candidates are few, else the Newton search (cache-blocked on CPU). Backward: the C kernel
(``attnopt::sparse_map_bwd`` under tracing) for α ∈ {1.5, 2}, the row-blocked CPU form of
:mod:`.groups` for float ``1 < α ≤ 2``, else the closed form of :mod:`._common` in plain ops.

Backward (closed form, only the output is saved): with ``g = p^{2−α}`` on the support,
``∂L/∂s = g ⊙ (d − (Σ g d)/(Σ g))`` for the incoming gradient ``d`` (every α > 0); for a
tensor ``α`` the gradient with respect to ``α`` is the one of Peters et al. (2019), rewritten
without the 0/0 at ``α = 1`` (:func:`_alpha_backward`).

Conventions: ``−inf`` scores get exactly 0; a slice that is entirely ``−inf`` gives zeros
(and zero gradient); float16/bfloat16 are computed in float32 and returned in the input dtype.
``torch.func``: ``jacrev`` (Jacobians, also of a tensor ``α``) and ``vmap`` over the scores work;
forward-mode AD (``jvp``, ``hessian``) does not (no ``jvp`` rule) — use ``jacrev(jacrev(f))``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnopt._native import has_storage
from attnopt._validation import check_tensor, device_assert, host_readable, host_values
from attnopt.functional import dispatch
from attnopt.functional._autograd import double_backward, reduce_to, under_transform
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.dispatch import current_backend
from attnopt.functional.regularized import cpu, groups, search
from attnopt.functional.regularized._common import (
    check_scores_max,
    closed_form_backward,
    compute_dtype,
    default_tol,
    shift,
)
from attnopt.functional.regularized.sort import entmax15_sort, sparsemax_sort

__all__ = ["entmax", "entmax15", "entmax_bisect", "map_backward", "sparsemax", "threshold_map"]


def threshold_map(x: Tensor, alpha: float, dim: int, max_iter: int, tol: float) -> tuple[Tensor, Tensor]:
    """``(p, θ)`` of the float-α map along ``dim`` (θ as in :func:`._common.map_from_threshold`):
    the router's choice of implementation (see the module docstring)."""
    if alpha in (1.5, 2.0):
        return _exact_map(x, alpha, dim, max_iter)
    a = torch.full((), alpha, dtype=x.dtype, device=x.device)
    if current_backend() != "reference" and alpha > 1.0 and groups.usable(x, dim):

        def solve(t: Tensor, th0: Tensor | None, cap: int | None) -> tuple[Tensor, Tensor]:
            return search.entmax_search(t, a, -1, tol, cap or max_iter, th0, warn=cap is None)

        res = groups.group_forward(x, alpha, solve)
        if res is not None:
            return res
    core = lambda c, d: search.entmax_search(c, a, d, tol, max_iter)  # noqa: E731
    if current_backend() == "reference":
        return core(x, dim)
    return search.chunked(core, x, dim, THRESHOLDS.entmax_block_entries)


def _sorted(x: Tensor, alpha: float, dim: int) -> tuple[Tensor, Tensor]:
    z, empty = shift(x, dim)
    return (sparsemax_sort if alpha == 2.0 else entmax15_sort)(z, empty, dim)


cpu.FALLBACK[:] = [lambda x, alpha: _sorted(x, alpha, -1)]  # the op's unsettled rows (a leaf imports no leaf)


def _op_applies(x: Tensor, dim: int) -> bool:
    """Whether a traced call (``torch.compile`` / ``torch.export``) takes the ``attnopt::sparse_map_*``
    ops: CPU float32/64 along the last dim, the C library built (:data:`.cpu.ready()`, a plain bool
    set at import), no ``torch.func`` transform, not ``backend("reference")``."""
    return (cpu.ready() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
            and x.dim() >= 1 and dim % x.dim() == x.dim() - 1 and not under_transform()
            and current_backend() != "reference")


def _exact_map(x: Tensor, alpha: float, dim: int, max_iter: int) -> tuple[Tensor, Tensor]:
    """Sparsemax (``alpha = 2``) / 1.5-entmax: the C kernel, its op under tracing, or the sort."""
    if torch.compiler.is_compiling() and _op_applies(x, dim) and x.numel():
        # rows the C search does not settle take the sort-based value inside the op (cpu.FALLBACK)
        p, theta, _ = torch.ops.attnopt.sparse_map_fwd(x, alpha, max_iter)
        return p, theta
    if host_readable(x) and current_backend() != "reference" and cpu.usable(x, dim):
        p, theta, redo = cpu.forward(x, alpha, max_iter)
        if redo.numel():  # rows the C search did not settle: the sort-based closed form
            n = x.shape[-1]
            p_redo, theta_redo = _sorted(x.reshape(-1, n).index_select(0, redo), alpha, -1)
            p.view(-1, n).index_copy_(0, redo, p_redo)
            theta.view(-1, 1).index_copy_(0, redo, theta_redo)
        return p, theta
    return _sorted(x, alpha, dim)  # a GPU, meta / fake tensors, dim not last, no C: exact, fixed op count


def map_backward(p: Tensor, grad: Tensor, alpha: Tensor | float, dim: int, tracked: bool = False) -> Tensor:
    """``g ⊙ (d − Σ g d / Σ g)`` with ``g = p^{2−α}`` on the support: the router's choice of the
    backward implementation (C kernel, its op under tracing, row-blocked CPU form, plain ops).

    ``tracked``: out-of-place ops, differentiable in ``p``, ``grad`` and ``α`` (double backward).
    """
    exact = isinstance(alpha, float) and alpha in (1.5, 2.0) and grad.shape == p.shape
    if (not tracked and exact and torch.compiler.is_compiling() and _op_applies(p, dim) and p.numel()
            and grad.dtype == p.dtype):
        out: Tensor = torch.ops.attnopt.sparse_map_bwd(p, grad, alpha)
        return out
    # create_graph=True: p is the tracked output, the support is locally constant; torch.func
    # transforms: tensors without storage
    if tracked or not (has_storage(p) and has_storage(grad)):
        return closed_form_backward(p, grad, alpha, dim, tracked=True)
    if exact and cpu.usable(p, dim):
        return cpu.backward(p, grad, float(alpha))
    if (isinstance(alpha, float) and 1.0 < alpha <= 2.0 and groups.usable(p, dim)
            and grad.shape == p.shape and grad.dtype == p.dtype):
        return groups.backward_rows(p, grad, alpha)
    return closed_form_backward(p, grad, alpha, dim)


_PHI_TERMS = 14  # Taylor terms of (e^x − 1 − x)/x² used for |x| < 1/2 (error < 1e-17)


def _phi(x: Tensor) -> Tensor:
    """``(eˣ − 1 − x)/x²`` without cancellation (``1/2`` at ``x = 0``)."""
    small = x.abs() < 0.5
    xd = torch.where(small, torch.ones_like(x), x)
    direct = (torch.expm1(xd) - xd) / (xd * xd)
    series = torch.full_like(x, 1.0 / math.factorial(_PHI_TERMS + 1))
    for k in range(_PHI_TERMS - 1, -1, -1):
        series = series * x + 1.0 / math.factorial(k + 2)
    return torch.where(small, series, direct)


def _alpha_backward(p: Tensor, grad: Tensor, alpha: Tensor, dim: int) -> Tensor:
    """``Σ_j d_j ∂p_j/∂α`` per slice (:func:`_alpha_derivative`)."""
    return (grad * _alpha_derivative(p, alpha, dim)).sum(dim=dim, keepdim=True)


def _alpha_derivative(p: Tensor, alpha: Tensor, dim: int) -> Tensor:
    r"""``∂p_j/∂α`` (the shape of ``p``), including across ``α = 1``.

    Peters et al. (2019) give ``∂p/∂α = (p − p̃)/ε² − (p log p − p̃ Σ p log p)/ε`` with
    ``ε = α − 1``, ``p̃ = p^{1−ε}/Σ p^{1−ε}``: a 0/0 at ``α = 1``. With ``l = log p``,
    ``w = p^{−ε} = 1 − εl + ε²l²φ(−εl)`` (``φ(x) = (eˣ−1−x)/x²``) it is exactly

    .. math:: \partial_\alpha p_j = \frac{p_j}{W}\big[(1 − εl_j) C − l_j^2 φ_j (1 − εA)\big],
              \ W = Σ p w,\ A = Σ p l,\ C = Σ p l^2 φ,

    finite at ``ε = 0`` (``p_j (Σ p l² − l_j²)/2``). Used for ``|ε| < 1``; the original form
    (no cancellation there) elsewhere.
    """
    support = p > 0
    tiny = torch.finfo(p.dtype).tiny
    am1 = (alpha - 1).to(p.dtype)
    logp = torch.where(support, p.clamp_min(tiny).log(), 0.0)
    # stable form (|ε| < 1)
    xe = -am1 * logp
    phi = _phi(xe)
    w = torch.where(support, torch.exp(xe), 0.0)
    big_w = (p * w).sum(dim=dim, keepdim=True)
    a_ = (p * logp).sum(dim=dim, keepdim=True)
    l2phi = logp * logp * phi
    c_ = (p * l2phi).sum(dim=dim, keepdim=True)
    inner = (1 - am1 * logp) * c_ - l2phi * (1 - am1 * a_)
    stable = p * inner / torch.where(big_w > 0, big_w, torch.ones_like(big_w))
    # original form (|ε| ≥ 1)
    g = torch.where(support, p.clamp_min(tiny).pow(2 - alpha), 0.0)
    gsum = g.sum(dim=dim, keepdim=True)
    skew = g / torch.where(gsum > 0, gsum, torch.ones_like(gsum))
    plogp = p * logp
    safe = torch.where(am1 == 0, torch.ones_like(am1), am1)
    original = (p - skew) / (safe * safe) - (plogp - skew * a_) / safe
    return torch.where(am1.abs() < 1, stable, original)


def _rowwise_vmap(fn: Any, in_dims: tuple[Any, ...], x: Tensor, dim: int, *rest: Any) -> tuple[Tensor, int]:
    """``torch.func.vmap`` rule of a map along ``dim``: the vmapped dimension is one more batch dimension.

    ``dim`` is the non-negative dimension of the unbatched (logical) tensor.
    """
    return fn(x.movedim(in_dims[0], 0), dim + 1, *rest), 0


def _save_for_forward(ctx: Any, *tensors: Tensor) -> None:
    """Keep the output for :func:`_map_jvp` under ``torch.func`` or a forward-AD dual level only
    (~100 ns check otherwise)."""
    if under_transform():
        ctx.save_for_forward(*tensors)  # sets ctx.saved_for_forward


def _forward_saved(ctx: Any, op: str) -> tuple[Tensor, ...]:
    saved: tuple[Tensor, ...] | None = getattr(ctx, "saved_for_forward", None)
    if saved is None:
        raise NotImplementedError(
            f"{op}: forward-mode AD needs the map to run under torch.func (jvp, jacfwd, hessian) or "
            "inside a torch.autograd.forward_ad dual level"
        )
    return saved


def _map_jvp(ctx: Any, x_t: Tensor, alpha: Tensor | float, op: str) -> Tensor:
    """Forward-mode derivative ``J x_t`` of the map: ``J`` is symmetric, so it is the backward's
    formula (tracked: out-of-place, differentiable again, e.g. under ``hessian``)."""
    p = _forward_saved(ctx, op)[0]
    compute = compute_dtype(p.dtype)
    a = alpha.to(compute) if isinstance(alpha, Tensor) else alpha
    return map_backward(p.to(compute), x_t.to(compute), a, ctx.dim, tracked=True).to(p.dtype)


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, max_iter: int) -> Tensor:
        compute = compute_dtype(x.dtype)
        return threshold_map(x.to(compute), 2.0, dim, max_iter, 0.0)[0].to(x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)
        _save_for_forward(ctx, output)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, dim: int, max_iter: int) -> tuple[Tensor, int]:  # noqa: ARG004
        return _rowwise_vmap(_Sparsemax.apply, in_dims, x, dim, max_iter)

    @staticmethod
    def jvp(ctx: Any, x_t: Tensor, *_: Any) -> Tensor:
        return _map_jvp(ctx, x_t, 2.0, "sparsemax")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        (p,) = ctx.saved_tensors
        compute = compute_dtype(p.dtype)
        gx = map_backward(p.to(compute), grad.to(compute), 2.0, ctx.dim, double_backward(ctx))
        return gx.to(p.dtype), None, None


class _Entmax(torch.autograd.Function):
    """Entmax for a fixed Python-float α (no gradient with respect to α)."""

    @staticmethod
    def forward(x: Tensor, alpha: float, dim: int, tol: float, max_iter: int) -> Tensor:
        compute = compute_dtype(x.dtype)
        return threshold_map(x.to(compute), alpha, dim, max_iter, tol)[0].to(x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.alpha, ctx.dim = inputs[1], inputs[2]
        ctx.save_for_backward(output)
        _save_for_forward(ctx, output)

    @staticmethod
    def jvp(ctx: Any, x_t: Tensor, *_: Any) -> Tensor:
        return _map_jvp(ctx, x_t, ctx.alpha, "entmax")

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, alpha: float, dim: int, tol: float, max_iter: int  # noqa: ARG004
    ) -> tuple[Tensor, int]:
        apply = lambda xb, d: _Entmax.apply(xb, alpha, d, tol, max_iter)  # noqa: E731
        return _rowwise_vmap(apply, in_dims, x, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        (p,) = ctx.saved_tensors
        compute = compute_dtype(p.dtype)
        gx = map_backward(p.to(compute), grad.to(compute), ctx.alpha, ctx.dim, double_backward(ctx))
        return gx.to(p.dtype), None, None, None, None


class _EntmaxAlpha(torch.autograd.Function):
    """Entmax for a tensor α (broadcastable, size 1 along ``dim``), differentiable in α."""

    @staticmethod
    def forward(x: Tensor, alpha: Tensor, dim: int, tol: float, max_iter: int) -> Tensor:
        compute = compute_dtype(x.dtype)
        p = search.entmax_search(x.to(compute), alpha.to(compute), dim, tol, max_iter)[0]
        return p.to(x.dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.dim = inputs[2]
        ctx.save_for_backward(output, inputs[1])
        _save_for_forward(ctx, output, inputs[1])

    @staticmethod
    def jvp(ctx: Any, x_t: Tensor | None, alpha_t: Tensor | None, *_: Any) -> Tensor:
        p, alpha = _forward_saved(ctx, "entmax")
        out = None if x_t is None else _map_jvp(ctx, x_t, alpha, "entmax")
        if alpha_t is not None:
            compute = compute_dtype(p.dtype)
            da = _alpha_derivative(p.to(compute), alpha.to(compute), ctx.dim) * alpha_t.to(compute)
            out = da.to(p.dtype) if out is None else out + da.to(p.dtype)
        assert out is not None
        return out

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[Any, ...], x: Tensor, alpha: Tensor, dim: int, tol: float, max_iter: int  # noqa: ARG004
    ) -> tuple[Tensor, int]:
        if in_dims[1] is not None:  # entmax() validates α's values, which vmap cannot do batched
            raise ValueError("torch.func.vmap over a tensor alpha is not supported; vmap over scores only")
        apply = lambda xb, d: _EntmaxAlpha.apply(xb, alpha, d, tol, max_iter)  # noqa: E731
        return _rowwise_vmap(apply, in_dims, x, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        p, alpha = ctx.saved_tensors
        compute = compute_dtype(p.dtype)
        pc, gc, ac = p.to(compute), grad.to(compute), alpha.to(compute)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = map_backward(pc, gc, ac, ctx.dim, double_backward(ctx)).to(p.dtype)
        ga = None
        if ctx.needs_input_grad[1]:
            ga = reduce_to(_alpha_backward(pc, gc, ac, ctx.dim), alpha.shape).to(alpha.dtype)
        return gx, ga, None, None, None


class _SparsemaxTraced(torch.autograd.Function):
    """:class:`_Sparsemax` without its ``jvp`` / ``vmap`` rules: what ``torch.compile`` traces (dynamo
    refuses a Function with a custom ``jvp``); the same forward and closed-form backward."""

    forward = staticmethod(_Sparsemax.forward)
    setup_context = staticmethod(_Sparsemax.setup_context)
    backward = staticmethod(_Sparsemax.backward)


class _EntmaxTraced(torch.autograd.Function):
    """:class:`_Entmax` for ``torch.compile`` (see :class:`_SparsemaxTraced`)."""

    forward = staticmethod(_Entmax.forward)
    setup_context = staticmethod(_Entmax.setup_context)
    backward = staticmethod(_Entmax.backward)


class _EntmaxAlphaTraced(torch.autograd.Function):
    """:class:`_EntmaxAlpha` for ``torch.compile`` (see :class:`_SparsemaxTraced`)."""

    forward = staticmethod(_EntmaxAlpha.forward)
    setup_context = staticmethod(_EntmaxAlpha.setup_context)
    backward = staticmethod(_EntmaxAlpha.backward)


def _sparsemax_fn() -> type[torch.autograd.Function]:
    return _SparsemaxTraced if torch.compiler.is_compiling() else _Sparsemax


def _entmax_fn() -> type[torch.autograd.Function]:
    return _EntmaxTraced if torch.compiler.is_compiling() else _Entmax


def _entmax_alpha_fn() -> type[torch.autograd.Function]:
    return _EntmaxAlphaTraced if torch.compiler.is_compiling() else _EntmaxAlpha


def _softmax(scores: Tensor, dim: int) -> Tensor:
    """``torch.softmax`` (α = 1) with the conventions of the sparse maps: NaN/``+inf`` rejected,
    an all ``−inf`` slice gives zeros (and zero gradient), half precision computed in float32."""
    m = scores.detach().amax(dim=dim, keepdim=True)
    check_scores_max(m)
    x = scores.to(compute_dtype(scores.dtype))
    empty = torch.isneginf(m)
    if not host_readable(m) or bool(empty.any()):
        return torch.softmax(x.masked_fill(empty, 0.0), dim=dim).masked_fill(empty, 0.0).to(scores.dtype)
    return torch.softmax(x, dim=dim).to(scores.dtype)


def _check_dim(scores: Tensor, dim: int) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -scores.dim() <= dim < scores.dim():
        raise ValueError(f"dim={dim} is out of range for scores with {scores.dim()} dimensions")
    return dim % scores.dim()


def _check_iter(tol: float | None, max_iter: int, dtype: torch.dtype) -> float:
    if not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")
    if tol is None:
        return default_tol(compute_dtype(dtype))
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    return float(tol)


@dispatch.profiled
def sparsemax(scores: Tensor, dim: int = -1, *, max_iter: int = 1000) -> Tensor:
    r"""Euclidean projection of scores onto the simplex (sdpa-one-sided-eot Prop. 4.2).

    .. math:: p = \arg\max_{p \in \Delta} \langle s, p \rangle - \tfrac12 \|p\|^2 = [s - \theta]_+

    Exact: Michelot's algorithm (Newton on the threshold) ends when the support is stable.

    Args:
        scores: (..., S) real scores; ``-inf`` entries get weight 0.
        dim: dimension that sums to one (also positional, as ``entmax.sparsemax(X, dim)``).
        max_iter: safety bound on the (finitely many) support updates.
    Returns:
        (..., S) weights, non-negative, summing to 1 along ``dim``; a slice that is entirely
        ``-inf`` gives zeros. Same dtype as ``scores`` (half precision computed in float32).
    Raises:
        TypeError: ``scores`` is not a floating-point tensor.
        ValueError: NaN or ``+inf`` in ``scores``; ``dim`` out of range.
    """
    check_tensor("scores", scores)
    dim = _check_dim(scores, dim)
    _check_iter(None, max_iter, scores.dtype)
    if scores.shape[dim] == 0:
        return scores.clone()
    out: Tensor = _sparsemax_fn().apply(scores, dim, max_iter)
    return out


@dispatch.profiled
def entmax(
    scores: Tensor,
    alpha: float | Tensor = 1.5,
    dim: int = -1,
    *,
    tol: float | None = None,
    max_iter: int = 100,
) -> Tensor:
    r"""α-entmax, the Tsallis-regularized argmax (sdpa-one-sided-eot Prop. 4.3), every ``α > 0``.

    .. math:: p = \arg\max_{p \in \Delta} \langle s, p \rangle
              - \sum_j \frac{p_j^\alpha - p_j}{\alpha(\alpha - 1)}
              = [1 + (\alpha - 1)(s - \tau)]_+^{1/(\alpha - 1)}

    ``α = 1`` is ``softmax`` exactly (the limit of the Tsallis regularizer is Shannon's),
    ``α ∈ (0, 1)`` gives dense maps, ``α > 1`` sparse ones, ``α = 2`` is :func:`sparsemax`.
    α = 1.5 and 2 are exact (closed-form threshold on the support); other α stop when
    ``|Σp − 1| ≤ tol``.

    Args:
        scores: (..., S) real scores; ``-inf`` entries get weight 0.
        alpha: a float > 0, or a tensor broadcastable to ``scores`` with size 1 along ``dim``
            (e.g. per head ``(H, 1, 1)``), values > 0 that may mix ``α < 1``, ``α = 1`` and
            ``α > 1``; a tensor α receives a gradient (continuous across ``α = 1``).
        dim: dimension that sums to one.
        tol: stopping tolerance on ``|Σp − 1|`` (default 1e-6, 1e-12 for float64).
        max_iter: maximum Newton iterations (a ``RuntimeWarning`` if ``tol`` is not reached).
    Returns:
        (..., S) non-negative weights summing to 1 along ``dim``; all ``-inf`` slices give
        zeros. Same dtype as ``scores`` (half precision computed in float32).
    Raises:
        TypeError: non-floating ``scores`` or ``alpha`` of another type.
        ValueError: ``alpha <= 0`` or not finite, a tensor ``alpha`` that does not broadcast
            with size 1 along ``dim``, NaN/``+inf`` scores, ``dim`` out of range, bad
            ``tol``/``max_iter``.
    """
    check_tensor("scores", scores)
    dim = _check_dim(scores, dim)
    tol_ = _check_iter(tol, max_iter, scores.dtype)
    if isinstance(alpha, Tensor):
        if not alpha.is_floating_point():
            raise TypeError(f"alpha must be a floating-point tensor, got {alpha.dtype}")
        a_values = host_values(alpha)
        if a_values is None:
            device_assert(alpha, lambda t: ((t > 0) & torch.isfinite(t)).all(), "alpha must be > 0, finite")
        elif not bool((a_values > 0).all()) or not bool(torch.isfinite(a_values).all()):
            raise ValueError("alpha must be > 0 and finite everywhere")
        try:
            full = torch.broadcast_shapes(alpha.shape, scores.shape)
        except RuntimeError as exc:
            raise ValueError(f"alpha of shape {tuple(alpha.shape)} does not broadcast to scores") from exc
        if tuple(full) != tuple(scores.shape):
            raise ValueError(f"alpha of shape {tuple(alpha.shape)} does not broadcast to scores")
        lead = scores.dim() - alpha.dim()
        if dim - lead >= 0 and alpha.shape[dim - lead] != 1:
            raise ValueError(f"alpha must have size 1 along dim={dim}, got shape {tuple(alpha.shape)}")
        if scores.shape[dim] == 0:
            return scores.clone()
        out: Tensor = _entmax_alpha_fn().apply(scores, alpha, dim, tol_, max_iter)
        return out
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a float or a tensor, got {type(alpha).__name__}")
    alpha = float(alpha)
    if not alpha > 0.0 or alpha == float("inf"):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha}")
    if scores.shape[dim] == 0:
        return scores.clone()
    if alpha == 1.0:
        return _softmax(scores, dim)
    if alpha == 2.0:
        res: Tensor = _sparsemax_fn().apply(scores, dim, max(max_iter, 1000))
        return res
    res = _entmax_fn().apply(scores, alpha, dim, tol_, max_iter)
    return res


@dispatch.profiled
def entmax15(scores: Tensor, dim: int = -1) -> Tensor:
    r"""1.5-entmax, :func:`entmax` with ``α = 1.5`` (sdpa-one-sided-eot Prop. 4.3); exact.

    The signature of the ``entmax`` package's ``entmax15(X, dim=-1)`` (its ``k`` partial-sort
    knob is not taken: the threshold here is found without sorting), so that its users can switch
    by changing the import.

    Args:
        scores: (..., S) real scores; ``-inf`` entries get weight 0.
        dim: dimension that sums to one.
    Returns:
        (..., S) non-negative weights summing to 1 along ``dim`` (all ``-inf`` slices: zeros).
    Raises:
        TypeError, ValueError: as :func:`entmax`.
    """
    return entmax(scores, 1.5, dim)


@dispatch.profiled
def entmax_bisect(
    scores: Tensor, alpha: float | Tensor = 1.5, dim: int = -1, *, tol: float | None = None,
    max_iter: int = 100,
) -> Tensor:
    r"""α-entmax for any ``α > 0``: :func:`entmax` under the ``entmax`` package's name.

    ``entmax.entmax_bisect(X, alpha, dim)`` finds the threshold by bisection; this one by a
    safeguarded Newton search on the same equation ``Σ_j [(α − 1)s_j − τ]_+^{1/(α−1)} = 1`` (same
    result to ``tol``; α = 1.5 and 2 exact). Its ``n_iter`` / ``ensure_sum_one`` knobs are
    ``max_iter`` / ``tol`` here (keyword-only); a tensor ``alpha`` receives a gradient as there.

    Args:
        scores: (..., S) real scores; ``-inf`` entries get weight 0.
        alpha: ``α > 0``, a float or a tensor (see :func:`entmax`).
        dim: dimension that sums to one.
        tol, max_iter: as :func:`entmax`.
    Returns:
        (..., S) non-negative weights summing to 1 along ``dim``.
    Raises:
        TypeError, ValueError: as :func:`entmax`.
    """
    return entmax(scores, alpha, dim, tol=tol, max_iter=max_iter)

r"""Sparse prediction maps: sparsemax and α-entmax (sdpa-one-sided-eot Prop. 4.2–4.3).

Both are regularized argmax maps over the simplex,

.. math:: p^\star = \arg\max_{p \in \Delta} \langle s, p\rangle - \Omega(p),

with ``Ω = ½‖p‖²`` (sparsemax, ``p = [s − θ]₊``) and the Tsallis regularizer
``Ω = Σ_j (p_j^α − p_j) / (α(α−1))`` (α-entmax, ``p = [(α−1)s − θ]₊^{1/(α−1)}``). The
threshold ``θ`` is the root of the decreasing function ``Σ_j p_j(θ) − 1``.

How it is computed (no fixed iteration count hiding error):

* every α > 0 (α ≠ 1.5, 2; tensor α): safeguarded Newton in the ``q``-exponential form
  ``p = exp(log1p(ε(s − m − τ))/ε)``, ``ε = α − 1`` (see :func:`_entmax_general_forward`),
  accurate as ``α → 1``; ``α = 1`` is ``torch.softmax``. Iteration stops when
  ``|Σp − 1| ≤ tol`` for every slice (a warning is raised otherwise), and ``p`` is
  renormalized.
* α = 2 (sparsemax): the Newton step is Michelot's algorithm and ends, in finitely many steps,
  when the support stops changing — the result is the exact projection.
* α = 1.5: once Newton has converged, the threshold is recomputed in closed form on the
  support (the quadratic of the sort-based algorithm), so the result is exact to rounding.
  Large contiguous CPU inputs (last dim) take :mod:`attnopt.functional.regularized.entmax15_passes`
  instead: the same closed form from a group-max guess, verified in a second pass, with reruns
  and this dense search for the rows it rejects — two streaming passes per cache block.
* α = 1.5 and 2 off the CPU (a GPU, meta / fake tensors, inside ``torch.compile``): the
  sort-based closed forms of :mod:`attnopt.functional.regularized.sort` (exact, no host sync, a
  fixed op count); other α there run the Newton search below for exactly ``max_iter``
  iterations with converged slices frozen (the same result as stopping early; no warning).
* α = 1.5 and 2 along the last dim of float32/float64 CPU tensors: the C kernels of
  :mod:`attnopt.functional.regularized.cpu` (same closed forms, same acceptance of the support,
  a few sweeps per row in the L1 cache; forward and backward), when a C compiler is available
  and ``ATTNOPT_NATIVE`` is not ``0``; the PyTorch paths above are their fallback.

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
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnopt._validation import check_tensor, device_assert, host_readable, host_values
from attnopt.functional._autograd import double_backward, reduce_to, under_transform
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.dispatch import current_backend
from attnopt.functional.regularized import cpu as _native_maps
from attnopt.functional.regularized import groups as _groups
from attnopt.functional.regularized.entmax15_passes import entmax15_passes
from attnopt.functional.regularized.sort import entmax15_sort, sparsemax_sort

__all__ = ["sparsemax", "entmax", "entmax15", "entmax_bisect"]

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


def _default_tol(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-6


def _shift(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``x − max x`` along ``dim`` and the mask of slices that are entirely ``−inf``."""
    m = x.amax(dim=dim, keepdim=True)
    _check_scores_max(m)
    empty = torch.isneginf(m)
    m = torch.where(empty, torch.zeros_like(m), m)
    return x - m, empty


_SCORES_ERROR = "scores must not contain NaN or +inf (use -inf to mask an entry)"


def _check_scores_max(m: Tensor) -> None:
    """NaN / ``+inf`` in the slice maxima ``m``: a ``ValueError`` where value checks read on the
    host (:data:`attnopt._validation.VALUE_CHECKS`), else a device-side assert or nothing."""
    values = host_values(m)
    if values is None:
        device_assert(m, lambda t: ~(torch.isnan(t) | torch.isposinf(t)).all(), _SCORES_ERROR)
    elif bool((torch.isnan(values) | torch.isposinf(values)).any()):
        raise ValueError(_SCORES_ERROR)


def _warn(name: str, max_iter: int, err: float) -> None:
    warnings.warn(
        f"{name}: threshold search did not reach tol after max_iter={max_iter} iterations "
        f"(max |sum p - 1| = {err:.3g})",
        RuntimeWarning,
        stacklevel=4,
    )


def _sparsemax_forward(
    x: Tensor, dim: int, max_iter: int, theta0: Tensor | None = None, warn: bool = True
) -> tuple[Tensor, Tensor]:
    """Michelot's algorithm = Newton on ``Σ[z − θ]₊ − 1``; exact when the support is stable.

    ``theta0``: a lower bound on the threshold to start from (default ``−1``); every iterate
    stays a lower bound, so a capped run (``warn=False``) still returns one.
    """
    z, empty = _shift(x, dim)
    theta = torch.full_like(z.narrow(dim, 0, 1), -1.0) if theta0 is None else theta0.clamp_min(-1.0)
    t = torch.empty_like(z)  # reused buffers: fresh large tensors cost page faults on CPU
    sign = torch.empty_like(z)
    count_prev: Tensor | None = None
    converged = False
    for _ in range(max_iter):
        torch.sub(z, theta, out=t).relu_()
        count = torch.sign(t, out=sign).sum(dim=dim, keepdim=True)
        total = t.sum(dim=dim, keepdim=True)
        theta = theta + (total - 1) / count.clamp_min(1)
        if count_prev is not None and torch.equal(count, count_prev):
            converged = True
            break
        count_prev = count
    del sign
    if not converged and warn:
        _warn("sparsemax", max_iter, float("nan"))
    torch.sub(z, theta, out=t).relu_()
    return t.masked_fill_(empty, 0.0), theta


def _entmax15_forward(
    x: Tensor, dim: int, tol: float, max_iter: int, theta0: Tensor | None = None, warn: bool = True
) -> tuple[Tensor, Tensor]:
    """Newton on ``‖[z − θ]₊‖₂ − 1`` then the exact threshold on the support found.

    ``theta0``: a lower bound to start from (Newton from below is monotone, so every iterate
    is a lower bound too).
    """
    z, empty = _shift(x, dim)
    z.mul_(0.5)
    theta = torch.full_like(z.narrow(dim, 0, 1), -1.0) if theta0 is None else theta0.clamp_min(-1.0)
    tiny = torch.finfo(z.dtype).tiny
    eps = torch.finfo(z.dtype).eps
    t = torch.empty_like(z)
    for _ in range(max_iter):
        torch.sub(z, theta, out=t).relu_()
        s1 = t.sum(dim=dim, keepdim=True)
        norm = torch.linalg.vector_norm(t, 2, dim=dim, keepdim=True)
        dev = torch.where(empty, torch.zeros_like(norm), norm * norm - 1)
        step = (norm - 1) * norm / s1.clamp_min(tiny)
        # done at the tolerance, or when the step is below rounding (float32, huge rows)
        if bool(((dev.abs() <= tol) | (step.abs() <= 2 * eps)).all()):
            break
        theta = theta + step
    else:
        if not warn:  # a capped run for a lower bound: the Newton iterate is one (the closed form is not)
            return t, theta
        _warn("entmax(alpha=1.5)", max_iter, float(dev.abs().max()))
    # closed-form threshold on the support S = {t > 0}: Σ_S (t − δ)² = 1, smaller root
    torch.sub(z, theta, out=t).relu_()
    k = torch.sign(t, out=z).sum(dim=dim, keepdim=True).clamp_min(1)
    s1 = t.sum(dim=dim, keepdim=True)
    s2 = torch.linalg.vector_norm(t, 2, dim=dim, keepdim=True).square()
    disc = s1 * s1 - k * (s2 - 1)
    delta = (s1 - disc.clamp_min(0).sqrt()) / k
    delta = torch.where((disc >= 0) & (delta >= 0), delta, torch.zeros_like(delta))
    t.sub_(delta).relu_().square_()
    t.div_(t.sum(dim=dim, keepdim=True).clamp_min(tiny))
    return t.masked_fill_(empty, 0.0), theta + delta


def _qlog_base(u: Tensor, eps: Tensor) -> Tensor:
    """``log p = log1p(ε u)/ε`` with ``ε u`` clamped at ``−1`` (``p = 0`` there); ``ε ≠ 0``."""
    return torch.log1p((eps * u).clamp_min(-1.0)).div_(eps)


def _entmax_general_forward(
    x: Tensor, alpha: Tensor, dim: int, tol: float, max_iter: int,
    theta0: Tensor | None = None, warn: bool = True,
) -> tuple[Tensor, Tensor]:
    r"""Every ``α > 0`` (tensor ``α`` broadcast, size 1 along ``dim``): safeguarded Newton.

    In score units, ``p_j = [1 + ε(x_j − m − τ)]₊^{1/ε}`` with ``ε = α − 1`` (the Tsallis
    ``q``-exponential: ``ε → 0`` is ``exp``), computed as ``exp(log1p(ε u)/ε)`` — accurate for
    ``α`` near 1, where the power form ``t^{1/ε}`` loses ``1/ε`` digits. Newton runs on
    ``g(τ) = S(τ)^ε − 1`` (``S = Σ p``): convex decreasing for ``0 < ε ≤ 1``, concave increasing
    for ``ε < 0``, so from ``τ = 0`` (``S ≥ 1``) the iterates rise monotonically to the root; the
    step ``S·(1 − S^{−ε})/(ε Σ p^{1−ε})`` is exact for softmax (``ε → 0``). A bracket
    ``[0, (1 − n^{−ε})/ε]`` guards ``α > 2``. Rows with ``α = 1`` are replaced by softmax.

    Returns ``(p, θ)`` with ``θ = ετ − 1`` (the threshold of ``[(α−1)(x − m) − θ]₊``).
    """
    xs, empty = _shift(x, dim)
    am1 = (alpha - 1).to(xs.dtype)
    tiny = torch.finfo(xs.dtype).tiny
    eps_f = torch.finfo(xs.dtype).eps
    e = torch.where(am1 == 0, torch.full_like(am1, 1e-20 if xs.dtype == torch.float64 else 1e-12), am1)
    n = x.shape[dim]
    shape = list(xs.shape)
    shape[dim] = 1
    e = e.expand(shape)
    lo = torch.zeros(shape, dtype=xs.dtype, device=xs.device)
    hi = -torch.expm1(-e * math.log(n)) / e
    tau = lo.clone() if theta0 is None else ((theta0 + 1) / e).clamp(min=lo, max=hi)
    on_host = host_readable(xs)  # else a fixed max_iter count: converged slices stay frozen below
    big = bool((am1 >= 1).any()) if on_host else True  # p^{1-ε} infinite (or 0·inf) at p = 0: mask it
    for _ in range(max_iter):
        q = _qlog_base(xs - tau, e)
        p = torch.exp(q)
        total = p.sum(dim=dim, keepdim=True)
        w = torch.exp(q.mul_(1 - e))
        if big:
            w = torch.where(p > 0, w, 0.0)
        deriv = w.sum(dim=dim, keepdim=True)
        dev = torch.where(empty, torch.zeros_like(total), total - 1)
        done = (dev.abs() <= tol) | (hi - lo <= 4 * eps_f * (1 + hi.abs()))
        if on_host and bool(done.all()):
            break
        lo = torch.where(dev > 0, tau, lo)
        hi = torch.where(dev > 0, hi, tau)
        logs = total.clamp_min(tiny).log()
        step = total * (-torch.expm1(-e * logs)) / e / deriv.clamp_min(tiny)
        new = tau + step
        bad = ~((new > lo) & (new < hi)) | ~torch.isfinite(new)
        new = torch.where(bad, 0.5 * (lo + hi), new)
        tau = torch.where(done, tau, new)
    else:
        if not warn:  # a capped run for a lower bound: lo (where Σp ≥ 1) is one
            return xs, e * lo - 1
        if on_host:  # (off the host no warning: it would read a value)
            _warn("entmax", max_iter, float(dev.abs().max()))
    p = torch.exp(_qlog_base(xs - tau, e))
    p = p.div_(p.sum(dim=dim, keepdim=True).clamp_min(tiny))
    if not on_host or bool((am1 == 0).any()):
        p = torch.where(am1 == 0, torch.softmax(xs.masked_fill(empty, 0.0), dim=dim), p)
    return p.masked_fill_(empty, 0.0), e * tau - 1


def _chunked(
    core: Callable[[Tensor, int], tuple[Tensor, Tensor]], x: Tensor, dim: int, elements: int
) -> tuple[Tensor, Tensor]:
    """Run ``core`` over blocks of rows that fit in cache (last-dim, contiguous inputs only).

    The threshold search passes over its rows several times; on blocks of ~``elements``
    entries those passes hit the CPU cache instead of memory (2-3x faster on large inputs).
    """
    n = x.shape[-1] if x.dim() else 1
    if x.device.type != "cpu" or dim != x.dim() - 1 or x.dim() < 2 or not x.is_contiguous() \
            or x.numel() <= 2 * elements:
        return core(x, dim)
    flat = x.view(-1, n)
    rows = max(1, elements // n)
    out = torch.empty_like(flat)
    theta = torch.empty((flat.shape[0], 1), dtype=x.dtype, device=x.device)
    for i in range(0, flat.shape[0], rows):
        out[i : i + rows], theta[i : i + rows] = core(flat[i : i + rows], -1)
    return out.view(x.shape), theta.view(*x.shape[:-1], 1)


def _threshold_map(x: Tensor, alpha: float, dim: int, max_iter: int, tol: float) -> tuple[Tensor, Tensor]:
    """Forward of the float-α map returning ``(p, θ)``; :func:`_map_from_threshold` recomputes ``p``.

    Sparsemax and 1.5-entmax along the last dim of a float32/float64 CPU tensor run
    the C kernels of :mod:`attnopt.functional.regularized.cpu` when they are built (the
    PyTorch paths below are the fallback). Otherwise large CPU inputs (last dim) go through
    the exact candidate-group path of :mod:`attnopt.functional.regularized.groups` when their rows
    are sparse, else the dense search.
    """
    core: Callable[[Tensor, int], tuple[Tensor, Tensor]]
    solve: _groups.Solver
    if alpha in (1.5, 2.0) and not host_readable(x):  # a GPU, meta / fake tensors, a compiled graph
        z, empty = _shift(x, dim)  # the sort-based closed forms: exact, no host read, fixed op count
        return (sparsemax_sort if alpha == 2.0 else entmax15_sort)(z, empty, dim)
    if alpha == 2.0:
        elements = THRESHOLDS.sparsemax_block_entries
        core = lambda c, d: _sparsemax_forward(c, d, max_iter)  # noqa: E731

        def solve(t: Tensor, th0: Tensor | None, cap: int | None) -> tuple[Tensor, Tensor]:
            return _sparsemax_forward(t, -1, cap or max_iter, th0, warn=cap is None)
    elif alpha == 1.5:
        elements = THRESHOLDS.entmax_block_entries
        core = lambda c, d: _entmax15_forward(c, d, tol, max_iter)  # noqa: E731

        def solve(t: Tensor, th0: Tensor | None, cap: int | None) -> tuple[Tensor, Tensor]:
            return _entmax15_forward(t, -1, tol, cap or max_iter, th0, warn=cap is None)
    else:
        a = torch.full((), alpha, dtype=x.dtype, device=x.device)
        elements = THRESHOLDS.entmax_block_entries
        core = lambda c, d: _entmax_general_forward(c, a, d, tol, max_iter)  # noqa: E731

        def solve(t: Tensor, th0: Tensor | None, cap: int | None) -> tuple[Tensor, Tensor]:
            return _entmax_general_forward(t, a, -1, tol, cap or max_iter, th0, warn=cap is None)
    if current_backend() == "reference":  # the plain searches above, nothing CPU-specific
        return core(x, dim)
    if alpha in (1.5, 2.0) and _native_maps.usable(x, dim):
        p, theta, redo = _native_maps.forward(x, alpha, max_iter)
        if redo.numel():  # rows the C search did not settle: the PyTorch search (warns if it fails too)
            n = x.shape[-1]
            p_redo, theta_redo = core(x.reshape(-1, n).index_select(0, redo), -1)
            p.view(-1, n).index_copy_(0, redo, p_redo)
            theta.view(-1, 1).index_copy_(0, redo, theta_redo)
        return p, theta
    if alpha == 1.5 and _groups.usable(x, dim):

        def dense(z: Tensor, c0: Tensor) -> tuple[Tensor, Tensor]:  # z: shifted rows, c0: a lower bound
            p, th = _entmax15_forward(z, -1, tol, max_iter, (0.5 * c0).clamp_min(-1.0))
            return p, 2.0 * th

        return entmax15_passes(x, tol, dense)
    if alpha > 1.0 and _groups.usable(x, dim):
        res = _groups.group_forward(x, alpha, solve)
        if res is not None:
            return res
    return _chunked(core, x, dim, elements)


def _map_from_threshold(x: Tensor, theta: Tensor, alpha: float, dim: int) -> Tensor:
    """``p = [(α−1)(x − max x) − θ]₊^{1/(α−1)}`` (renormalized for α ≠ 2), as in the forward."""
    z, empty = _shift(x, dim)
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


def _support_weight(p: Tensor, alpha: float, out: Tensor) -> Tensor:
    """``p^{2−α}`` on the support, 0 elsewhere, written into ``out`` (float ``1 < α ≤ 2``).

    ``sqrt``/``pow`` of exact zeros take a slow path on x86 CPUs (~20x): computed as
    ``p · max(p, 1e-30)^{1−α}`` (``p · rsqrt`` for α = 1.5), exactly 0 off the support.
    """
    if alpha == 2.0:
        return torch.sign(p, out=out)
    torch.clamp_min(p, 1e-30, out=out)
    if alpha == 1.5:
        out.rsqrt_()
    else:
        out.pow_(1.0 - alpha)
    return out.mul_(p)


def _backward_rows(p: Tensor, grad: Tensor, alpha: float) -> Tensor:
    """The backward below on cache-sized row blocks of a contiguous last-dim ``p`` (CPU).

    Five streaming ops per block, all in cache, one reused ``g`` buffer and no full-size
    temporary besides the result: about what ``torch.softmax``'s backward costs.
    """
    n = p.shape[-1]
    pf = p.view(-1, n)
    gf = grad.reshape(-1, n)
    out = torch.empty_like(pf)
    step = max(1, THRESHOLDS.sparsemax_block_entries // n)
    local = threading.local()  # one cache-sized buffer per worker thread

    def block(i: int, j: int) -> bool:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = torch.empty((step, n), dtype=p.dtype, device=p.device)
        w = _support_weight(pf[i:j], alpha, buf[: j - i])
        wsum = w.sum(dim=-1, keepdim=True)
        o = torch.mul(w, gf[i:j], out=out[i:j])
        q = o.sum(dim=-1, keepdim=True) / torch.where(wsum > 0, wsum, torch.ones_like(wsum))
        o.addcmul_(w, q, value=-1.0)
        return True

    _groups.run_blocks(block, [(i, min(pf.shape[0], i + step)) for i in range(0, pf.shape[0], step)])
    return out.view(p.shape)


def _entmax_backward(
    p: Tensor, grad: Tensor, alpha: Tensor | float, dim: int, tracked: bool = False
) -> Tensor:
    """``g ⊙ (d − Σ g d / Σ g)`` with ``g = p^{2−α}`` on the support (few large temporaries).

    ``tracked``: out-of-place ops, differentiable in ``p``, ``grad`` and ``α`` (double backward).
    They also run under ``torch.func`` transforms (tensors without storage: ``jacrev`` vmaps
    this backward over a batched ``grad``, and the in-place forms below cannot write into ``p``).
    """
    # create_graph=True: p is the tracked output, the support is locally constant
    if tracked or not (_native_maps.has_storage(p) and _native_maps.has_storage(grad)):
        g = torch.where(p > 0, p.clamp_min(torch.finfo(p.dtype).tiny).pow(2 - alpha), 0.0)
        gsum = g.sum(dim=dim, keepdim=True)
        gd = g * grad
        return gd - g * gd.sum(dim=dim, keepdim=True) / torch.where(gsum > 0, gsum, torch.ones_like(gsum))
    if (isinstance(alpha, float) and alpha in (1.5, 2.0) and grad.shape == p.shape
            and _native_maps.usable(p, dim) and _native_maps.has_storage(grad)):
        return _native_maps.backward(p, grad, alpha)
    if (isinstance(alpha, float) and 1.0 < alpha <= 2.0 and _groups.usable(p, dim)
            and grad.shape == p.shape and grad.dtype == p.dtype):
        return _backward_rows(p, grad, alpha)
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
    compute = _compute_dtype(p.dtype)
    a = alpha.to(compute) if isinstance(alpha, Tensor) else alpha
    return _entmax_backward(p.to(compute), x_t.to(compute), a, ctx.dim, tracked=True).to(p.dtype)


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(x: Tensor, dim: int, max_iter: int) -> Tensor:
        compute = _compute_dtype(x.dtype)
        return _threshold_map(x.to(compute), 2.0, dim, max_iter, 0.0)[0].to(x.dtype)

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
        compute = _compute_dtype(p.dtype)
        gx = _entmax_backward(p.to(compute), grad.to(compute), 2.0, ctx.dim, double_backward(ctx))
        return gx.to(p.dtype), None, None


class _Entmax(torch.autograd.Function):
    """Entmax for a fixed Python-float α (no gradient with respect to α)."""

    @staticmethod
    def forward(x: Tensor, alpha: float, dim: int, tol: float, max_iter: int) -> Tensor:
        compute = _compute_dtype(x.dtype)
        return _threshold_map(x.to(compute), alpha, dim, max_iter, tol)[0].to(x.dtype)

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
        compute = _compute_dtype(p.dtype)
        gx = _entmax_backward(p.to(compute), grad.to(compute), ctx.alpha, ctx.dim, double_backward(ctx))
        return gx.to(p.dtype), None, None, None, None


class _EntmaxAlpha(torch.autograd.Function):
    """Entmax for a tensor α (broadcastable, size 1 along ``dim``), differentiable in α."""

    @staticmethod
    def forward(x: Tensor, alpha: Tensor, dim: int, tol: float, max_iter: int) -> Tensor:
        compute = _compute_dtype(x.dtype)
        p = _entmax_general_forward(x.to(compute), alpha.to(compute), dim, tol, max_iter)[0]
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
            compute = _compute_dtype(p.dtype)
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
        compute = _compute_dtype(p.dtype)
        pc, gc, ac = p.to(compute), grad.to(compute), alpha.to(compute)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = _entmax_backward(pc, gc, ac, ctx.dim, double_backward(ctx)).to(p.dtype)
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
    _check_scores_max(m)
    x = scores.to(_compute_dtype(scores.dtype))
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
        return _default_tol(_compute_dtype(dtype))
    if not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    return float(tol)


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

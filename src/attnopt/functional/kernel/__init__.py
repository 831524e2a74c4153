r"""Kernel attention: similarity kernel × L^p magnitude (implicit-kernel-attention eq. 9, 11).

.. math:: \alpha_{ij} \propto \mathrm{sim}(q_i, k_j)\,
          \exp\!\big(s(\|q_i\|_p^2 + \|k_j\|_p^2)/2\big),\qquad
          \mathrm{sim} = \begin{cases} k(q_i,k_j) & \text{positive kernel (RBF, periodic)}\\
                                       f(q_i,k_j)^2 + \varepsilon & \text{kernel that can be negative}
                         \end{cases}

computed in the log domain as ``softmax_j(log sim_ij + s‖k_j‖_p²/2 + mask_ij)`` (the query
magnitude is constant along a row and cancels). ``ε = 1e-5`` follows the authors' energy
``log(f² + 1e-5)``. With :class:`~attnopt.kernels.RBF` (``l² = √d``) and ``p = 2`` this is
exactly SDPA (Prop. 1) and is computed by SDPA. ``magnitude_p=None`` drops the magnitude
(the "RBF-only" attention of Tsai et al.).

``mode="linear"`` (kernels with a feature map) computes the same output in O(N) time and
memory (see :mod:`attnopt.functional.kernel.linear`). On a CUDA tensor with Triton installed (or
under ``attnopt.backend("triton")``) the quadratic mode with a squared feature kernel or RBF runs
the Triton kernels of :mod:`attnopt.functional.triton.kernel` (``last_dispatch["kernel"] == "triton"``;
random Fourier kernels with features and magnitude fused in the kernel), and so does the causal
linear mode with a random Fourier kernel (a chunked scan).

Implementations on the CPU (this router picks):
the whole call of :mod:`.fourier` (Fourier-feature kernels at small sizes, forward and backward one
C call each), its per-pass node above that size, the fused Expsin node (:mod:`.periodic`, C passes
of :mod:`.periodic_cpu`), the sampled node (:mod:`.sampled_fourier`, for the modules), the linear
form (:mod:`.linear`) and the plain log-domain ops (:func:`_quadratic`, also ``backend("reference")``).
Under ``torch.compile`` / ``torch.export`` on CPU tensors a call the eager router would give to the
whole call becomes the op ``attnopt::ffw_fwd`` (backward ``attnopt::ffw_bwd``) in the graph, one it
would give to the per-pass node (above the whole call's size, or with a key weight computed outside,
e.g. a magnitude outside ``[1, 2]``) ``attnopt::ff_fwd`` (``ff_bwd``), a fused Expsin call
``attnopt::px_fwd`` (``px_bwd``), where the C library is there (:func:`attnopt._native.ready`,
answered at trace time: no ctypes inside the traced region); other traced calls run the plain ops.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from attnopt import _func
from attnopt._func import all_true, largest
from attnopt._native import has_storage
from attnopt._validation import (
    additive_mask,
    broadcast_shapes,
    causal_additive_mask,
    check_attention_inputs,
    combine_additive,
    device_assert,
    empty_attention,
    empty_weights,
    host_readable,
    host_values,
    resolve_scale,
    validate_attention,
)
from attnopt.functional import dispatch
from attnopt.functional import triton as gpu
from attnopt.functional._autograd import under_transform
from attnopt.functional._denormal import sdpa
from attnopt.functional._dropout import check_dropout_p, dropout_attention
from attnopt.functional._softmax import safe_softmax
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel import (
    fourier_cpu,  # (also registers attnopt::ffw_*, ff_*, lp_magnitude)
    periodic,
    periodic_cpu,
    spectral,
    spectral_cpu,
)
from attnopt.functional.kernel._fourier_whole import whole_applies, whole_ready
from attnopt.functional.kernel.chunked import chunked_feature_kernel_attention
from attnopt.functional.kernel.fourier import fused_fourier_attention, fused_fourier_magnitude_attention
from attnopt.functional.kernel.linear import linear_kernel_attention
from attnopt.functional.kernel.magnitude import key_bias, log_magnitude
from attnopt.kernels import RBF, Kernel, Periodic
from attnopt.kernels._base import check_dim

__all__ = ["kernel_attention", "kernel_weights", "log_magnitude", "sample_spectral_points",
           "split_key_query_mask"]

Mode = Literal["quadratic", "linear"]


def split_key_query_mask(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Factor an additive mask ``(…, Nq, Nk)`` into a key mask and the fully masked query rows.

    The linear mode sums over keys once for all queries, so it takes masks of the form
    ``mask_ij = key_j`` for every query ``i`` that has an admissible key — e.g. key padding,
    or the models' key padding ∪ query padding (padded queries' rows all ``-inf``).

    Returns:
        ``(key (…, 1, Nk), dead (…, Nq, 1))``: the shared row of the live queries (``0`` where
        every query is dead) and a boolean marking the rows with no admissible key (their output
        is 0, as in the quadratic mode).
    Raises:
        ValueError: the live rows differ (a query-dependent mask, e.g. causal ∪ padding).
    """
    dead = torch.isneginf(mask).all(dim=-1, keepdim=True)
    inf = torch.full((), float("inf"), dtype=mask.dtype, device=mask.device)
    key = torch.where(dead, inf, mask).amin(dim=-2, keepdim=True)
    same = torch.where(dead, key, mask).eq(key).all()
    message = (
        "mode='linear' needs a key mask: attn_mask may only mask keys (the same keys for every "
        "query) and whole query rows (use mode='quadratic' or is_causal for causal masks)"
    )
    if host_values(same) is None:  # off the CPU / compiling: the VALUE_CHECKS policy
        device_assert(same, lambda t: t, message)
    elif not (bool(same) if _func.level() is None else all_true(same)):
        raise ValueError(
            "mode='linear' needs a key mask: attn_mask may only mask keys (the same keys for every "
            "query) and whole query rows; got a query-dependent mask of shape "
            f"{tuple(mask.shape)} (use mode='quadratic' or is_causal for causal masks)"
        )
    return torch.where(torch.isposinf(key), torch.zeros_like(key), key), dead


def _check_options(kernel: object, magnitude_p: float | None, eps: float, mode: str) -> None:
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel must be an attnopt.kernels.Kernel, got {type(kernel).__name__}")
    if magnitude_p is not None and not (math.isfinite(float(magnitude_p)) and float(magnitude_p) > 0):
        raise ValueError(f"magnitude_p must be a finite number > 0 or None, got {magnitude_p}")
    if not (math.isfinite(float(eps)) and float(eps) >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if mode not in ("quadratic", "linear"):
        raise ValueError(f"mode must be 'quadratic' or 'linear', got {mode!r}")


def _log_similarity(kernel: Kernel, q: Tensor, k: Tensor, eps: float) -> Tensor:
    if kernel.squared:
        return torch.log(kernel(q, k).square() + eps)
    return kernel.log_gram(q, k)


def _prepare(
    q: Tensor,
    k: Tensor,
    kernel: object,
    magnitude_p: float | None,
    scale: float | None,
    eps: float,
    mode: str,
) -> tuple[float, torch.dtype, Tensor | None]:
    _, _, d = check_attention_inputs(q, k)
    _check_options(kernel, magnitude_p, eps, mode)
    s = resolve_scale(scale, d)
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    return s, compute, key_bias(k, magnitude_p, s, compute)


def _full_mask(
    q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool, dtype: torch.dtype
) -> Tensor | None:
    nq, nk = q.shape[-2], k.shape[-2]
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2])
    mask = additive_mask(attn_mask, (*batch, nq, nk), dtype)
    causal = causal_additive_mask(nq, nk, dtype, q.device) if is_causal else None
    return combine_additive(mask, causal)


def _direct_ok(kernel: Kernel, mask: Tensor | None, eps: float, q: Tensor, k: Tensor) -> bool:
    """The exp-free path: a squared kernel with ``|f|`` bounded, ε > 0, no query-dependent mask.

    Bounded kernels (``|f| ≤ 1``, random Fourier) always qualify. An unbounded kernel with
    features (e.g. :class:`~attnopt.kernels.Linear`) qualifies when the Cauchy–Schwarz bound
    ``f² ≤ b² = max‖φ(q)‖²·max‖φ(k)‖²`` keeps the direct form exact: ``Σ_j (f² + ε)`` cannot
    overflow (``b² ≤ max/(4·Nk)``), and a key whose ``m_j`` underflows (``< tiny``) has relative
    weight below ``b²·tiny/ε ≤`` machine epsilon. Otherwise the log-domain path runs.
    """
    key_only = mask is None or mask.dim() < 2 or mask.shape[-2] == 1
    if not (kernel.squared and eps > 0 and key_only):
        return False
    if kernel.bounded:
        return True
    if not kernel.has_features:
        return False
    kernel._check(q, k)
    if _func.level() is None and not host_readable(q):  # the bound is read on the host: CPU only
        return False  # (elsewhere the log-domain evaluation: exact too, with no host sync)
    with torch.no_grad():
        bq = kernel.features(q).norm(dim=-1).amax()
        bk = kernel.features(k).norm(dim=-1).amax()
        if _func.level() is None:
            b2 = float(bq.double() * bk.double()) ** 2
        else:  # inside torch.func (no float() under vmap): the largest over the examples
            b2 = (largest(bq.double()) * largest(bk.double())) ** 2
    fi = torch.finfo(q.dtype)
    return b2 <= min(fi.max / (4.0 * max(1, k.shape[-2])), fi.eps * eps / fi.tiny)


def _quadratic(
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    kernel: Kernel,
    bias: Tensor | None,
    mask: Tensor | None,
    eps: float,
) -> Tensor:
    """Chunked over queries: returns weights (v None) or the output.

    Two equivalent evaluations. Log domain (general): ``softmax(log sim + bias + mask)``.
    Direct (bounded squared kernels, ``ε > 0``, key-only masks): ``w = (f² + ε)·m_j`` with
    ``m_j = exp(a_j − max a)`` — no ``log``/``exp`` over the ``Nq × Nk`` scores. A key whose
    ``m_j`` underflows has true relative weight below ``e^{-87}(1 + ε)/ε`` (float32) because
    ``f² ≤ 1``, so nothing measurable is lost.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    batch = math.prod(broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    chunk_elements = THRESHOLDS.kernel_quadratic_chunk_elements
    chunk = nq if v is None else max(1, min(nq, chunk_elements // max(1, batch * nk)))
    direct = _direct_ok(kernel, mask, eps, q, k)
    m: Tensor | None = None
    if direct and mask is None:
        m = None if bias is None else bias.exp()  # the bias is already ≤ 0 with max 0
    elif direct:
        a = combine_additive(bias, mask)
        if a is not None:
            c = a.amax(dim=-1, keepdim=True).detach()
            m = torch.exp(a - torch.where(torch.isfinite(c), c, torch.zeros_like(c)))
    if direct and v is not None and kernel.has_features and torch.compiler.is_compiling():
        out = _traced_weighted_fourier(q, k, v, kernel, m, eps)  # the fused node's op, where it runs
        if out is not None:
            return out
    # the fused / blocked nodes need real storage: torch.func's wrapped tensors take the plain ops
    if direct and v is not None and kernel.has_features and has_storage(q, k, v, m):
        rows = math.prod(broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
        path = dispatch.choose_impl("kernel", nq=nq, nk=nk, batch=rows, dtype=q.dtype)
        if dispatch.record("kernel", path) == "materialized":
            kernel._check(q, k)
            fourier = kernel.fourier_sets()
            if fourier is not None:
                sets, coef = fourier
                check_dim("spectral points", sets[0], q)
                return fused_fourier_attention(q, k, m, v, eps, coef, sets)
        # other feature maps (Linear, user kernels): one node at every size (whole below
        # kernel_whole_elements scores, cache-sized blocks above)
        kernel._check(q, k)
        return chunked_feature_kernel_attention(kernel.features(q), kernel.features(k), m, v, eps)
    dispatch.record("kernel", "streaming")
    vm: Tensor | None = None
    if direct and v is not None:
        mt = torch.ones_like(v[..., :1]) if m is None else m.transpose(-2, -1).to(v.dtype)
        vm = torch.cat([v * mt, mt.expand(*v.shape[:-1], 1)], dim=-1)
        per_row = max(1, batch * nk)  # at least 64 queries a block (fewer, smaller matmuls cost more)
        t = THRESHOLDS
        chunk = max(1, min(nq, max(t.kernel_direct_chunk_elements // per_row,
                                   min(64, t.kernel_direct_max_elements // per_row))))
    phi_k: Tensor | None = None
    if direct and kernel.has_features:  # feature maps once, not per query chunk
        kernel._check(q, k)
        phi_k = kernel.features(k).transpose(-2, -1)
        q = kernel.features(q)
    outs = []
    for start in range(0, nq, chunk):
        qc = q[..., start : start + chunk, :]
        if direct:
            f = kernel(qc, k) if phi_k is None else torch.matmul(qc, phi_k)
            # in place only where no autodiff sees it (forward-mode AD of mul_(f, f) on f itself is wrong)
            tracked = torch.is_grad_enabled() and (f.requires_grad or (vm is not None and vm.requires_grad))
            if tracked or under_transform():
                w = f.square() + eps
            else:
                w = f.mul_(f).add_(eps)
            if v is None:
                if m is not None:
                    w = w * m
                total = w.sum(-1, keepdim=True)
                outs.append(w / torch.where(total > 0, total, torch.ones_like(total)))
                continue
            assert vm is not None
            o = torch.matmul(w, vm)  # [Σ w m v, Σ w m]: the key weight rides on the values
            total = o[..., -1:]
            ok = total > 0
            outs.append(torch.where(ok, o[..., :-1] / torch.where(ok, total, torch.ones_like(total)), 0.0))
            continue
        logits = _log_similarity(kernel, qc, k, eps)
        if bias is not None:
            logits = logits + bias
        if mask is not None:
            mc = mask if mask.dim() < 2 or mask.shape[-2] == 1 else mask[..., start : start + chunk, :]
            logits = logits + mc
        # every logit is finite without a mask (ε > 0 or a positive kernel): the fused softmax is safe
        finite = mask is None and (eps > 0 or not kernel.squared)
        w = torch.softmax(logits, dim=-1) if finite else safe_softmax(logits, dim=-1)
        outs.append(w if v is None else torch.matmul(w, v))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _fused_fourier(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kernel: object,
    magnitude_p: float | None,
    attn_mask: Tensor | None,
    scale: float | None,
    mode: str,
    is_causal: bool,
    eps: float,
) -> Tensor | None:
    """The short path of :func:`kernel_attention`, or None where it does not apply.

    Fourier-feature kernels (IKA_S / IKA_NS / IKAN), ``ε > 0``, an L^p magnitude with
    ``1 <= p <= 2`` (or none), a key-only mask without gradient, not causal, float32/float64,
    at sizes ``dispatch`` materializes: features, key weights and attention in one node
    (:func:`~attnopt.functional.kernel.fourier.fused_fourier_magnitude_attention`; at small sizes its
    whole-call path, forward and backward one C call each), the same function as the general path
    up to float rounding. Inputs are validated by the caller.
    """
    _check_options(kernel, magnitude_p, eps, mode)
    assert isinstance(kernel, Kernel)
    if mode != "quadratic" or is_causal or not (kernel.squared and kernel.bounded and eps > 0):
        return None
    if magnitude_p is not None and not 1.0 <= float(magnitude_p) <= 2.0:
        return None
    if torch.compiler.is_compiling():
        return _traced_fourier(q, k, v, kernel, magnitude_p, attn_mask, scale, eps)
    if q.dtype not in (torch.float32, torch.float64) or not has_storage(q, k, v, attn_mask):
        return None
    query_dependent = attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1
    if attn_mask is not None and (attn_mask.requires_grad or query_dependent):
        return None
    stack = kernel.fourier_stack()
    if stack is None:
        return None
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    batch: tuple[int, ...] = q.shape[:-2]
    if not k.shape[:-2] == v.shape[:-2] == batch:
        batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    path = dispatch.choose_impl("kernel", nq=nq, nk=nk, batch=math.prod(batch), dtype=q.dtype)
    if path != "materialized":
        return None
    s = resolve_scale(scale, d)
    key_mask = None
    if attn_mask is not None:
        full = additive_mask(attn_mask, (*batch, nq, nk), q.dtype)
        assert full is not None
        key_mask = full.squeeze(-2)
    points, nsets, coef = stack
    check_dim("spectral points", points, q)
    dispatch.record("kernel", "materialized")
    p = None if magnitude_p is None else float(magnitude_p)
    return fused_fourier_magnitude_attention(q, k, v, points, nsets, coef, eps, p, s, key_mask)


def _traced_fourier(
    q: Tensor, k: Tensor, v: Tensor, kernel: Kernel, magnitude_p: float | None, attn_mask: Tensor | None,
    scale: float | None, eps: float,
) -> Tensor | None:
    """:func:`_fused_fourier` while ``torch.compile`` / ``torch.export`` traces: where the eager call
    would run the fused Fourier node (CPU float32/64 tensors, the same size rules, the C library
    there: :func:`fourier_cpu.ff_ready`), its op — the whole call ``attnopt::ffw_fwd`` (backward
    ``ffw_bwd``) where that applies, else the per-pass ``attnopt::ff_fwd`` (``ff_bwd``) —, else None
    (the caller's plain ops). Nothing here reads tensor memory or loads a library."""
    if not fourier_cpu.ff_ready() or not q.device.type == k.device.type == v.device.type == "cpu":
        return None
    if under_transform() or q.dtype not in (torch.float32, torch.float64):
        return None
    if attn_mask is not None and (attn_mask.requires_grad or attn_mask.device.type != "cpu"
                                  or (attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1)):
        return None
    stack = kernel.fourier_stack()
    if stack is None:
        return None
    points, nsets, coef = stack
    if points.device.type != "cpu":
        return None
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    batch: tuple[int, ...] = q.shape[:-2]
    if not k.shape[:-2] == v.shape[:-2] == batch:
        batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if dispatch.choose_impl("kernel", nq=nq, nk=nk, batch=math.prod(batch), dtype=q.dtype) != "materialized":
        return None
    check_dim("spectral points", points, q)
    s = resolve_scale(scale, d)
    key_mask = None
    if attn_mask is not None:
        full = additive_mask(attn_mask, (*batch, nq, nk), q.dtype)
        assert full is not None
        key_mask = full.squeeze(-2)
    dispatch.record("kernel", "materialized")
    p = None if magnitude_p is None else float(magnitude_p)
    need_k = k.requires_grad and torch.is_grad_enabled()
    if whole_ready() and whole_applies(q, k, v, points):
        out, _ = torch.ops.attnopt.ffw_fwd(q, k, v, points.to(q.dtype), key_mask, float(eps), float(coef),
                                           nsets, p, float(s), need_k)
        return out if q.shape[:-2] else out.view(nq, out.shape[-1])
    return fourier_cpu.traced_pass_attention(q, k, v, points, nsets, coef, eps, p, s, key_mask, need_k)


def _traced_weighted_fourier(
    q: Tensor, k: Tensor, v: Tensor, kernel: Kernel, m: Tensor | None, eps: float
) -> Tensor | None:
    """:func:`_quadratic`'s fused Fourier node with a given key weight ``m (…, 1, Nk)`` (a magnitude
    outside ``[1, 2]``, a mask with a gradient, half inputs computed in float32) while ``torch.compile``
    / ``torch.export`` trace: the op ``attnopt::ff_fwd`` (``ff_bwd``) where the eager call runs
    :func:`~attnopt.functional.kernel.fourier.fused_fourier_attention` and the C library is there
    (:func:`fourier_cpu.ff_ready`), else None (the plain ops). Shapes only, no tensor memory read."""
    if not fourier_cpu.ff_ready() or under_transform() or q.dtype not in (torch.float32, torch.float64):
        return None
    if any(x is not None and x.device.type != "cpu" for x in (q, k, v, m)):
        return None
    fourier = kernel.fourier_sets()
    if fourier is None or any(w.device.type != "cpu" for w in fourier[0]):
        return None
    rows = math.prod(broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    if dispatch.record("kernel", dispatch.choose_impl("kernel", nq=q.shape[-2], nk=k.shape[-2], batch=rows,
                                                      dtype=q.dtype)) != "materialized":
        return None
    kernel._check(q, k)
    sets, coef = fourier
    check_dim("spectral points", sets[0], q)
    return fourier_cpu.traced_weighted_attention(q, k, m, v, eps, coef, sets)


def _periodic(
    q: Tensor, k: Tensor, v: Tensor, kernel: Periodic, magnitude_p: float | None,
    attn_mask: Tensor | None, scale: float | None, is_causal: bool, eps: float,
) -> Tensor | None:
    """The fused Expsin node (:mod:`.periodic`, its C passes in :mod:`.periodic_cpu`), or None where it
    does not apply (a length-scale so small that ``c = 1/l²`` > ``MAX_C``, a float mask that needs a
    gradient, or ``torch.func``'s wrapped tensors, which the plain ops of the general path take)."""
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    c = kernel.inv_sq_lengthscale(q.shape[-1])
    if not periodic.periodic_fused_ok(c, compute, attn_mask):
        return None
    # traced (compile / export): the op attnopt::px_fwd where an eager call would run the C passes
    traced = torch.compiler.is_compiling()
    if traced:
        devices = {x.device.type for x in (q, k, v, attn_mask) if x is not None}
        if not (periodic_cpu.ready() and devices == {"cpu"} and compute in (torch.float32, torch.float64)) \
                or under_transform():
            return None
    elif not has_storage(q, k, v, attn_mask):
        return None
    _check_options(kernel, magnitude_p, eps, "quadratic")
    s = resolve_scale(scale, q.shape[-1])
    l2 = magnitude_p is not None and float(magnitude_p) == 2.0
    bias = None if l2 else key_bias(k, magnitude_p, s, compute)
    mask = None if attn_mask is None and not is_causal else _full_mask(q, k, attn_mask, is_causal, compute)
    dispatch.record("kernel", "materialized")
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    omega = 2.0 * math.pi / kernel.period
    prep = periodic.prepare(qc, kc, vc, magnitude_scale=s if l2 else None, key_bias=bias, mask=mask)
    lib = None if traced else periodic_cpu.library(qc, kc, vc, prep.e3, prep.m3)

    def rows(x: Tensor) -> Tensor:  # no tracked view where the node can flatten x itself
        same = tuple(x.shape[:-2]) == prep.batch and x.is_contiguous()
        return x if same else periodic.flat(x, prep.batch)

    if traced:
        out = periodic_cpu.traced_periodic_attention(
            rows(qc), rows(kc), rows(vc), prep.e3, prep.m3, prep.rep, omega * omega, float(c), prep.s,
            prep.save, prep.batch)
    elif lib is None:
        out = periodic.periodic_node(qc, kc, vc, prep, omega=omega, c=c)
    else:  # the same node with its elementwise passes in C
        out = periodic_cpu.native_periodic_attention(
            lib, rows(qc), rows(kc), rows(vc), prep.e3, prep.m3, prep.rep, omega * omega, float(c), prep.s,
            prep.save, THRESHOLDS.periodic_chunk_bytes, prep.batch)
    return out.to(q.dtype)


def _rbf_key_bias_sdpa(
    q: Tensor, k: Tensor, v: Tensor, inv_l2: float, bias: Tensor | None, mask: Tensor | None
) -> Tensor:
    r"""RBF attention with a key bias, by SDPA on inputs with one more feature.

    .. math:: \mathrm{softmax}_j\big(-\tfrac{\|q_i-k_j\|^2}{2l^2} + b_j + m_{ij}\big)
              = \mathrm{softmax}_j\big(l^{-2}\,[q_i, 1]^\top [k_j, c_j] + m_{ij}\big),\qquad
              c_j = -\tfrac12\|k_j\|^2 + l^2 b_j

    (the query's ``‖q_i‖²`` is constant along a row and cancels). The key bias rides on the keys,
    so the fused SDPA kernel computes it and its gradient (through the concatenation): an
    ``Nk``-wide bias passed as ``attn_mask`` needs a gradient and sent SDPA to its materialized
    math path (train step N = 512, B·H = 128, d = 16, 1 thread: RBF-only 3.1× → 1.2× softmax).
    ``v`` gets a zero column when ``dv = d`` (the CPU flash kernel takes one head dimension).

    Shapes: q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv), bias (..., 1, Nk) or None,
    mask additive, broadcastable to (..., Nq, Nk), or None. Returns (..., Nq, dv).
    """
    c = -0.5 * k.square().sum(-1, keepdim=True)
    if bias is not None:
        c = c + bias.transpose(-2, -1) * (1.0 / inv_l2)
    qa = torch.cat([q, torch.ones_like(q[..., :1])], dim=-1)
    ka = torch.cat([k, c], dim=-1)
    dv = v.shape[-1]
    va = torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1) if dv == q.shape[-1] else v
    out = sdpa(qa, ka, va, attn_mask=None if mask is None else mask.contiguous(), scale=inv_l2)
    return out[..., :dv]


def _on_triton(
    q: Tensor, k: Tensor, v: Tensor, kernel: Kernel, magnitude_p: float | None, attn_mask: Tensor | None,
    scale: float | None, is_causal: bool, eps: float,
) -> Tensor | None:
    """The Triton kernels (:mod:`attnopt.functional.triton.kernel`), or None where they do not apply."""
    from attnopt.functional.triton.kernel import supported, triton_kernel_attention

    _check_options(kernel, magnitude_p, eps, "quadratic")
    if not supported(kernel) or (attn_mask is not None and attn_mask.requires_grad):
        return None
    dispatch.record("kernel", "triton")
    return triton_kernel_attention(q, k, v, kernel=kernel, magnitude_p=magnitude_p, attn_mask=attn_mask,
                                   scale=scale, is_causal=is_causal, eps=eps)


def _linear_on_triton(
    q: Tensor, k: Tensor, v: Tensor, kernel: Kernel, magnitude_p: float | None, key_mask: Tensor | None,
    scale: float, eps: float,
) -> Tensor | None:
    """The causal linear mode's Triton scan (:func:`attnopt.functional.triton.kernel.triton_linear_causal`),
    or None where it does not apply (no Fourier form, a key mask that needs a gradient)."""
    from attnopt.functional.triton.kernel import triton_linear_causal

    if kernel.fourier_stack() is None or (key_mask is not None and key_mask.requires_grad):
        return None
    dispatch.record("kernel", "triton")
    return triton_linear_causal(q, k, v, kernel=kernel, magnitude_p=magnitude_p, key_mask=key_mask,
                                scale=scale, eps=eps)


@dispatch.profiled
def kernel_weights(
    q: Tensor,
    k: Tensor,
    *,
    kernel: Kernel,
    magnitude_p: float | None = 2.0,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    eps: float = 1e-5,
) -> Tensor:
    r"""The weights of :func:`kernel_attention` (implicit-kernel-attention eq. 9, 11).

    .. math:: \alpha_{ij} = \frac{\mathrm{sim}_{ij}\, e^{s\|k_j\|_p^2/2 + m_{ij}}}
              {\sum_{l} \mathrm{sim}_{il}\, e^{s\|k_l\|_p^2/2 + m_{il}}}

    Args: as :func:`kernel_attention` (without ``v`` and ``mode``).

    Returns:
        (..., Nq, Nk) row-stochastic weights in the input dtype (half precision is computed
        in float32); a row with no admissible key is all zeros.

    Raises:
        ValueError, TypeError: as :func:`kernel_attention`.
    """
    validate_attention(q, k, None, attn_mask)
    empty = empty_weights(q, k)
    if empty is not None:  # the same checks as otherwise, then the empty-size policy
        _check_options(kernel, magnitude_p, eps, "quadratic")
        resolve_scale(scale, q.shape[-1])
        _full_mask(q, k, attn_mask, is_causal, q.dtype)
        return empty
    _, compute, bias = _prepare(q, k, kernel, magnitude_p, scale, eps, "quadratic")
    mask = _full_mask(q, k, attn_mask, is_causal, compute)
    w = _quadratic(q.to(compute), k.to(compute), None, kernel, bias, mask, eps)
    return w.to(q.dtype)


@dispatch.profiled
def kernel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    kernel: Kernel,
    magnitude_p: float | None = 2.0,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    mode: Mode = "quadratic",
    is_causal: bool = False,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
) -> Tensor:
    r"""Implicit-kernel attention, similarity × magnitude (implicit-kernel-attention eq. 9, 11).

    .. math:: \mathrm{out}_i = \sum_j \alpha_{ij} v_j,\qquad
              \alpha_{ij} \propto \mathrm{sim}(q_i,k_j)\, e^{s(\|q_i\|_p^2+\|k_j\|_p^2)/2}

    with ``sim = kernel(q, k)`` for positive kernels and ``kernel(q, k)² + eps`` for kernels
    that can be negative (``kernel.squared``), as the paper squares ``f``.

    Args:
        q: (B, H, Nq, d) queries.
        k: (B, H, Nk, d) keys.
        v: (B, H, Nk, dv) values.
        kernel: an :mod:`attnopt.kernels` kernel. ``RBF()`` with ``magnitude_p=2`` is SDPA.
        magnitude_p: ``p > 0`` of the L^p magnitude; ``None`` = no magnitude term (RBF-only).
            ``p → 0⁺`` makes rows one-hot (Prop. 5). Conditioning: with ``p < 1`` (or large
            keys) rows come out one-hot, the exact ``dq``/``dk`` are ~0, and what is returned is
            the rounding of ``dP − δ`` times the magnitude's large derivative (float32: entries up
            to ~3 where float64 gives ~5e-9, measured at p = 0.5, d = 64): use float64 there.
        attn_mask: boolean (``True`` = take part) or additive float mask broadcastable to
            (B, H, Nq, Nk). ``mode="linear"`` accepts key masks, (..., 1, Nk), and masks that
            are a key mask on every row that is not fully masked (key ∪ query padding, as the
            models build them; :func:`split_key_query_mask`).
        scale: ``s`` of the magnitude (default ``1/sqrt(d)``), > 0. It does not change the
            kernel: give the kernel its own length-scale.
        mode: ``"quadratic"`` (explicit scores, chunked over queries) or ``"linear"`` (exact
            O(N·R²·dv) form via ``features(x) ⊗ features(x)``, kernels with ``has_features``).
            The linear form is exact in exact arithmetic, but ``f² = ⟨φ⊗φ, φ⊗φ⟩`` sums ``D²``
            terms whose size is set by the dominant keys: rounding is amplified ~25–1000×
            (measured, R = 16, d = 64, L¹ magnitude: float32 output 9e-4 and ``dq`` 4e-3 relative
            to the largest entry, against 2e-5 / 4e-5 for the quadratic mode; float64 1.8e-12).
            Pass float64 inputs where that matters.
        is_causal: SDPA's top-left causal mask (``mode="linear"`` needs ``Nq == Nk``).
        eps: ``ε ≥ 0`` added to ``f²`` for squared kernels (the authors' ``1e-5``); ignored
            by positive kernels. Both modes include it exactly.
        dropout_p: dropout probability on the weights ``α`` before the sum over values (as in
            SDPA: applied whenever > 0). A call with ``dropout_p > 0`` runs on the materialized
            ``Nq × Nk`` weights (:func:`kernel_weights`' plain ops, :mod:`.._dropout`), in either
            ``mode``: the linear form never holds ``α``.

    Returns:
        (B, H, Nq, dv) in the input dtype; a row with no admissible key is zeros (every row
        when ``Nk = 0``; ``Nq = 0`` gives an empty output).

    Raises:
        TypeError: ``kernel`` not a :class:`~attnopt.kernels.Kernel`; non-floating inputs.
        ValueError: NaN or ±inf in ``q``, ``k``, ``v``; a mask that does not broadcast to
            (B, H, Nq, Nk); mismatched shapes, ``magnitude_p <= 0``, ``eps < 0``, unknown ``mode``,
            ``mode="linear"`` with a kernel without features, a query-dependent mask (other
            than whole masked rows), or a causal mask with ``Nq != Nk``.
    """
    validate_attention(q, k, v, attn_mask)
    dropout_p = check_dropout_p(dropout_p)
    empty = empty_attention(q, k, v)
    if empty is not None:  # the same checks as otherwise, then the empty-size policy
        _check_options(kernel, magnitude_p, eps, mode)
        resolve_scale(scale, q.shape[-1])
        _full_mask(q, k, attn_mask, is_causal, q.dtype)
        return empty
    if dropout_p > 0.0:  # the fused / linear paths never hold α: drop on the materialized weights
        _, compute, bias = _prepare(q, k, kernel, magnitude_p, scale, eps, mode)
        mask = _full_mask(q, k, attn_mask, is_causal, compute)
        w = _quadratic(q.to(compute), k.to(compute), None, kernel, bias, mask, eps)
        return dropout_attention(w, v, dropout_p, q.dtype)
    if dispatch.use_reference("kernel", q):  # plain PyTorch, any device: the quadratic log-domain form
        _check_options(kernel, magnitude_p, eps, mode)
        if mode == "linear" and is_causal and q.shape[-2] != k.shape[-2]:
            raise ValueError(f"mode='linear' with is_causal needs Nq == Nk, got {q.shape[-2]}, {k.shape[-2]}")
        s, compute, bias = _prepare(q, k, kernel, magnitude_p, scale, eps, "quadratic")
        mask = _full_mask(q, k, attn_mask, is_causal, compute)
        ref = _quadratic(q.to(compute), k.to(compute), v.to(compute), kernel, bias, mask, eps).to(q.dtype)
        dispatch.use_reference("kernel", q)  # (recorded again: the helpers above record their paths)
        return ref
    if mode == "quadratic" and gpu.wanted(q) and not under_transform():
        out = _on_triton(q, k, v, kernel, magnitude_p, attn_mask, scale, is_causal, eps)
        if out is not None:
            return out
    if isinstance(kernel, Periodic) and mode == "quadratic":
        out = _periodic(q, k, v, kernel, magnitude_p, attn_mask, scale, is_causal, eps)
        if out is not None:
            return out
    fast = _fused_fourier(q, k, v, kernel, magnitude_p, attn_mask, scale, mode, is_causal, eps)
    if fast is not None:
        return fast
    s, compute, bias = _prepare(q, k, kernel, magnitude_p, scale, eps, mode)
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    if mode == "linear":
        nq, nk = q.shape[-2], k.shape[-2]
        key_mask, dead_rows = None, None
        if attn_mask is not None:
            batch = broadcast_shapes(q.shape[:-2], k.shape[:-2])
            if attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1:
                full = additive_mask(attn_mask, (*batch, nq, nk), compute)
                assert full is not None
                key_mask, dead_rows = split_key_query_mask(full)
            else:
                key_mask = additive_mask(attn_mask, (*batch, 1, nk), compute)
        if is_causal and nq != nk:
            raise ValueError(f"mode='linear' with is_causal needs Nq == Nk, got {nq} and {nk}")
        out = None
        if is_causal and gpu.wanted(q) and not under_transform():  # the chunked scan in Triton
            out = _linear_on_triton(q, k, v, kernel, magnitude_p, key_mask, s, eps)
        if out is None:
            key_bias = combine_additive(bias, key_mask)
            out = linear_kernel_attention(qc, kc, vc, kernel=kernel, key_bias=key_bias, is_causal=is_causal,
                                          eps=eps)
        if dead_rows is not None:
            out = out.masked_fill(dead_rows, 0.0)
        return out.to(q.dtype)
    mask = _full_mask(q, k, attn_mask, is_causal, compute)
    if isinstance(kernel, RBF):
        # log sim + bias = qᵀk/l² − ‖k‖²/(2l²) + bias + (row constant): SDPA with a key bias,
        # which cancels exactly when l² = 1/s and p = 2 (Prop. 1).
        inv_l2 = kernel.inv_sq_lengthscale(q.shape[-1])
        if magnitude_p is not None and float(magnitude_p) == 2.0 and math.isclose(inv_l2, s, rel_tol=1e-12):
            out = sdpa(qc, kc, vc, attn_mask=None if mask is None else mask.contiguous(), scale=inv_l2)
        else:
            out = _rbf_key_bias_sdpa(qc, kc, vc, inv_l2, bias, mask)
        return out.to(q.dtype)
    return _quadratic(qc, kc, vc, kernel, bias, mask, eps).to(q.dtype)


def sample_spectral_points(
    h: Tensor, noise: Tensor, densities: torch.nn.ModuleList, params: list[Tensor],
    copula_raw: Tensor | None = None, kl_mean: bool = False, keys: bool = False,
) -> tuple[Tensor, Tensor]:
    """All sets' spectral points and the KL, one node.

    Args:
        h: (..., H, d) head summaries.
        noise: (S, ..., H, R/2, d) standard-normal base noise, broadcastable.
        densities: the ``S`` :class:`~attnopt.nn.spectral.ImplicitSpectralDensity` modules.
        params: :func:`.spectral.fusable` of ``densities``.
        copula_raw: the :class:`~attnopt.nn.spectral.GaussianCopula`'s ``raw`` (H, H) parameter, or
            None: the noise is correlated across the heads by its factor ``L̃`` inside the node.
        kl_mean: return the KL's mean over the examples (0-d; taken inside the C node, no
            autograd node of its own) in place of the per-example KL.
        keys: ``h`` is given as the keys ``(..., H, N ≥ 1, d)``, and the summary is their mean over
            ``N`` (``sum / N``, bitwise ``mean``), taken inside the C node (no nodes of its own).
    The C sampler of :mod:`.spectral_cpu` runs where it applies (CPU float32/64, stock
    networks; traced: the op ``attnopt::ss_fwd``), else the node of :mod:`.spectral`.

    Returns:
        ``(points (..., H, S·R, d), kl (...))``: set ``s`` is rows ``[sR, (s+1)R)``, each
        ``[w⁺ ‖ −w⁺]``; ``kl = (R/2) Σ_s [Σ_{m,j} KL(N(μ, σ²) ‖ N(0, 1)) − (d/2)·log det C]``
        (the copula term with ``copula_raw`` only).
    """
    scales = tuple(float(getattr(dens, "base_scale")) for dens in densities)  # noqa: B009
    if torch.compiler.is_compiling():  # traced: the C sampler as the op attnopt::ss_fwd (ss_bwd)
        if not under_transform() and spectral_cpu.traced_applies(h, noise, copula_raw, params, keys):
            pts, kl, _, _ = torch.ops.attnopt.ss_fwd(h, noise, copula_raw, list(params), list(scales),
                                                     kl_mean, keys)
            return pts, kl
        lib = None
    else:
        lib = spectral_cpu.library(h, noise, copula_raw, params, keys)
    if lib is not None:  # the whole forward and backward in C (CPU float32/64)
        return spectral_cpu.native_sample(h, noise, copula_raw, scales, params, lib, kl_mean, keys)
    if keys:
        h = torch.div(h.sum(dim=-2), h.shape[-2])
    pts, kl = spectral.spectral_sample_node(h, noise, copula_raw, scales, params)
    return pts, (kl.mean() if kl_mean else kl)

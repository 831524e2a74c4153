r"""Implicit-kernel attention (IKA / IKAN / MIKAN) in Triton (IKA eq. 9–16).

Weights ``α_ij ∝ sim(q_i, k_j) · exp(s‖k_j‖_p²/2 + m_ij)`` (the query's magnitude cancels along
a row), computed as a flash pass with scores in the log domain:

* random Fourier kernels (stationary or not: IKA, IKAN, MIKAN, any kernel with
  :meth:`~attnopt.kernels.Kernel.fourier_stack`): features, magnitude (``1 ≤ p ≤ 2``) and
  attention fused in one pass (:mod:`._fourier`), ``t_ij = log((φ(q_i)·φ(k_j))² + ε) + a_j + m_ij``,
  with a Triton backward to ``q``, ``k``, ``v`` and the spectral points (learned or sampled: the
  gradient reaches the density networks through autograd); nothing of size ``N × 2R`` is stored.
  A magnitude with ``p`` outside ``[1, 2]`` is made by :func:`~attnopt.functional.kernel.
  log_magnitude` in PyTorch (float64 for ``p < 1``) and enters as the column bias (O(N));
* other squared kernels with a feature map (the linear kernel): the flash primitive's score mode 1
  (:func:`attnopt.functional.triton._flash.flash`) on features made in PyTorch;
* the RBF kernel: ``t_ij = <q_i, k_j>/l² − ‖k_j‖²/(2l²) + b_j + m_ij`` (dot-product scores, the
  key term in the column bias);
* ``mode="linear"`` with ``is_causal`` (random Fourier kernels): the chunked scan of
  :mod:`._fourier_scan`.

Not routed here: positive kernels other than RBF (periodic), a mask that needs a gradient,
non-causal ``mode="linear"`` (the portable O(N) path).
"""
from __future__ import annotations

from torch import Tensor

from attnopt._validation import broadcast_shapes, resolve_scale
from attnopt.functional.triton import check_device
from attnopt.functional.triton._flash import INTERPRETED, flash
from attnopt.functional.triton._fourier import ika_attention, magnitude_mode
from attnopt.functional.triton._fourier_scan import ika_causal_scan
from attnopt.functional.triton._shapes import _to4, prepare
from attnopt.kernels import RBF, Kernel

__all__ = ["supported", "triton_kernel_attention", "triton_linear_causal"]


def supported(kernel: Kernel) -> bool:
    """Whether :func:`triton_kernel_attention` computes attention with ``kernel``."""
    return isinstance(kernel, RBF) or (kernel.squared and kernel.has_features)


def triton_kernel_attention(
    q: Tensor, k: Tensor, v: Tensor, *, kernel: Kernel, magnitude_p: float | None, attn_mask: Tensor | None,
    scale: float | None, is_causal: bool, eps: float,
) -> Tensor:
    """Quadratic-mode ``kernel_attention`` on validated, non-empty inputs and a :func:`supported` kernel.

    Returns:
        (…, Nq, dv) in ``q``'s dtype; rows with no admissible key are zeros.
    Raises:
        RuntimeError: the kernels cannot run on this device.
    """
    from attnopt.functional.kernel.magnitude import key_bias as _key_bias

    check_device(q, INTERPRETED)
    s = resolve_scale(scale, q.shape[-1])
    causal = 1 if is_causal else 0
    if isinstance(kernel, RBF):
        inv_l2 = kernel.inv_sq_lengthscale(q.shape[-1])
        p = prepare(q, k, v, attn_mask)
        bias = -0.5 * inv_l2 * p.k.to(p.pot).square().sum(-1)
        mag = _key_bias(k, magnitude_p, s, p.pot)
        if mag is not None:
            bias = bias + _to4(mag, p.batch).reshape(bias.shape)
        assert p.v is not None
        out = flash(p.q, p.k, p.v, p.key_bias + bias, p.mask, causal, inv_l2)[0]
        return p.restore(out)
    stack = kernel.fourier_stack()
    if stack is not None:
        return _fourier(q, k, v, stack, magnitude_p, attn_mask, s, is_causal, eps)
    p = prepare(kernel.features(q), kernel.features(k), v, attn_mask)
    assert p.v is not None
    cb = p.key_bias
    mag = _key_bias(k, magnitude_p, s, p.pot)
    if mag is not None:
        cb = cb + _to4(mag.expand(*p.batch, 1, k.shape[-2]), p.batch).reshape(cb.shape)
    out = flash(p.q, p.k, p.v, cb, p.mask, causal, 1.0, score=1, eps=float(eps))[0]
    return p.restore(out)


def _fourier(
    q: Tensor, k: Tensor, v: Tensor, stack: tuple[Tensor, int, float], magnitude_p: float | None,
    attn_mask: Tensor | None, scale: float, is_causal: bool, eps: float,
) -> Tensor:
    """The fused kernel of :mod:`._fourier` for ``stack = (W (…, S·R, d), S, c)``."""
    from attnopt.functional.kernel.magnitude import key_bias as _key_bias

    points, sets, coef = stack
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], points.shape[:-2])
    q = q.expand(*batch, *q.shape[-2:])  # points with batch dimensions of their own widen the call
    p = prepare(q, k, v, attn_mask)
    assert p.v is not None
    cb = p.key_bias
    inside = magnitude_mode(magnitude_p) >= 0
    if not inside:  # p < 1 or p > 2: the magnitude in PyTorch (float64 for p < 1), as a column bias
        mag = _key_bias(k, magnitude_p, scale, p.pot)
        assert mag is not None
        cb = cb + _to4(mag.expand(*p.batch, 1, k.shape[-2]), p.batch).reshape(cb.shape)
    w4 = _to4(points.to(p.pot), p.batch)
    mp = magnitude_p if inside else None
    out = ika_attention(p.q, p.k, p.v, w4, cb, p.mask, causal=is_causal, magnitude_p=mp, scale=scale, eps=eps,
                        coef=coef, sets=sets)[0]
    return p.restore(out)


def triton_linear_causal(
    q: Tensor, k: Tensor, v: Tensor, *, kernel: Kernel, magnitude_p: float | None, key_mask: Tensor | None,
    scale: float, eps: float,
) -> Tensor:
    """Causal ``mode="linear"`` for a random Fourier kernel: the chunked scan of :mod:`._fourier_scan`.

    Args:
        q, k, v: validated (…, N, ·) inputs (non-empty, ``Nq == Nk``).
        kernel: a kernel with :meth:`~attnopt.kernels.Kernel.fourier_stack`.
        magnitude_p: as ``kernel_attention``. key_mask: additive (…, 1, Nk) key mask or None.
        scale: ``s`` of the magnitude. eps: ``ε``.
    Returns:
        (…, N, dv) in ``q``'s dtype; a row with no admissible key is 0.
    Raises:
        RuntimeError: the kernels cannot run on this device.
    """
    from attnopt.functional.kernel.magnitude import key_bias as _key_bias

    check_device(q, INTERPRETED)
    stack = kernel.fourier_stack()
    assert stack is not None
    points, sets, coef = stack
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], points.shape[:-2])
    p = prepare(q.expand(*batch, *q.shape[-2:]), k, v, None)
    assert p.v is not None
    cb = p.key_bias
    if key_mask is not None:
        cb = cb + _to4(key_mask.to(p.pot).expand(*p.batch, 1, k.shape[-2]), p.batch).reshape(cb.shape)
    inside = magnitude_mode(magnitude_p) >= 0
    if not inside:
        mag = _key_bias(k, magnitude_p, scale, p.pot)
        assert mag is not None
        cb = cb + _to4(mag.expand(*p.batch, 1, k.shape[-2]), p.batch).reshape(cb.shape)
    mp = magnitude_p if inside else None
    out = ika_causal_scan(p.q, p.k, p.v, _to4(points.to(p.pot), p.batch), cb.contiguous(), magnitude_p=mp,
                          scale=scale, eps=eps, coef=coef, sets=sets)
    return p.restore(out)

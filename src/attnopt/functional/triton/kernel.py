r"""Implicit-kernel attention (IKA / IKAN / MIKAN) on the Triton flash primitive (IKA eq. 9–16).

Weights ``α_ij ∝ sim(q_i, k_j) · exp(s‖k_j‖_p²/2 + m_ij)`` (the query's magnitude cancels along
a row), computed as a flash pass with scores in the log domain:

* squared kernels with a feature map (random Fourier, stationary or not — IKA, IKAN, MIKAN —
  and the linear kernel): ``t_ij = log((φ(q_i)·φ(k_j))² + ε) + b_j + m_ij``, the kernel's score
  mode 1 (:func:`attnopt.functional.triton._flash.flash`); its backward returns ``dφ(q)``,
  ``dφ(k)`` and ``db``;
* the RBF kernel: ``t_ij = <q_i, k_j>/l² − ‖k_j‖²/(2l²) + b_j + m_ij`` (dot-product scores, the
  key term in the column bias).

The features ``φ(x) = c·[cos(x Wᵀ), sin(x Wᵀ)]`` (``N × 2R``) and the magnitude bias
``b_j = s‖k_j‖_p²/2 − max`` are O(N) tensors made by the kernel and :func:`~attnopt.functional.
kernel.log_magnitude` in PyTorch, so gradients reach the spectral points (learned or sampled) and
the keys through autograd; the ``Nq × Nk`` similarity never exists. Not routed here: positive
kernels other than RBF (periodic), ``mode="linear"``, a mask that needs a gradient.
"""
from __future__ import annotations

from torch import Tensor

from attnopt._validation import resolve_scale
from attnopt.functional.triton import check_device
from attnopt.functional.triton._flash import INTERPRETED, flash
from attnopt.functional.triton._shapes import _to4, prepare
from attnopt.kernels import RBF, Kernel

__all__ = ["supported", "triton_kernel_attention"]


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
    from attnopt.functional.kernel import _key_bias

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
    p = prepare(kernel.features(q), kernel.features(k), v, attn_mask)
    assert p.v is not None
    cb = p.key_bias
    mag = _key_bias(k, magnitude_p, s, p.pot)
    if mag is not None:
        cb = cb + _to4(mag.expand(*p.batch, 1, k.shape[-2]), p.batch).reshape(cb.shape)
    out = flash(p.q, p.k, p.v, cb, p.mask, causal, 1.0, score=1, eps=float(eps))[0]
    return p.restore(out)

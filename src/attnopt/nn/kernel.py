"""Multi-head kernel attention with a fixed kernel: RBF-only, Expsin, Linear (implicit-kernel Table 2)."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from attnopt.functional.kernel import kernel_attention, kernel_weights
from attnopt.kernels import Kernel
from attnopt.nn._multihead import MultiheadBase

__all__ = ["KernelMultiheadAttention"]


class KernelMultiheadAttention(MultiheadBase):
    r"""``nn.MultiheadAttention(batch_first=True)`` whose weights are similarity × magnitude.

    Each head computes :func:`attnopt.functional.kernel_attention`:
    ``α_ij ∝ sim(q_i, k_j) · exp(s‖k_j‖_p²/2)`` (implicit-kernel-attention eq. 9, 11) with a
    fixed :mod:`attnopt.kernels` kernel. ``RBF()`` with ``magnitude_p=2`` is SDPA (Prop. 1);
    ``magnitude_p=None`` drops the magnitude (RBF-only).

    Args:
        embed_dim, num_heads: as ``nn.MultiheadAttention``.
        kernel: an :class:`attnopt.kernels.Kernel` (``RBF()``, ``Periodic(P)``, ``Linear()``).
        magnitude_p: ``p > 0`` of the L^p magnitude, or ``None`` for none.
        mode: ``"quadratic"`` or ``"linear"`` (kernels with a feature map; key padding, also
            combined with query padding, and ``is_causal``, not other query-dependent masks).
        bias, kdim, vdim, dropout: as ``nn.MultiheadAttention`` (dropout on the weights in training
            mode; such calls materialize the ``Nq × Nk`` weights, also in the linear mode).
    Raises:
        TypeError: ``kernel`` not a :class:`~attnopt.kernels.Kernel`.
        ValueError: bad sizes or ``magnitude_p``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kernel: Kernel,
        *,
        magnitude_p: float | None = 2.0,
        mode: Literal["quadratic", "linear"] = "quadratic",
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim, dropout=dropout)
        if not isinstance(kernel, Kernel):
            raise TypeError(f"kernel must be an attnopt.kernels.Kernel, got {type(kernel).__name__}")
        if magnitude_p is not None and not float(magnitude_p) > 0:
            raise ValueError(f"magnitude_p must be > 0 or None, got {magnitude_p}")
        if mode not in ("quadratic", "linear"):
            raise ValueError(f"mode must be 'quadratic' or 'linear', got {mode!r}")
        self.kernel, self.magnitude_p, self.mode = kernel, magnitude_p, mode

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        out = kernel_attention(
            q,
            k,
            v,
            kernel=self.kernel,
            magnitude_p=self.magnitude_p,
            attn_mask=mask,
            is_causal=is_causal,
            mode=self.mode,
            dropout_p=self.dropout_p,
        )
        weights = None
        if need_weights:
            weights = kernel_weights(
                q, k, kernel=self.kernel, magnitude_p=self.magnitude_p, attn_mask=mask, is_causal=is_causal
            )
        return out, weights

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kernel={type(self.kernel).__name__}, "
            f"magnitude_p={self.magnitude_p}"
        )

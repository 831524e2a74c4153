"""Exact MEM / Fenchel-dual attention modules (fenchel-dual-attention eq. 7, 9–10)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from attnopt.dual.mem_attention import mem_estimate, mem_weights
from attnopt.nn._multihead import MultiheadBase
from attnopt.nn.preference import PreferenceModule

__all__ = ["MEMEstimate", "MEMAttention"]


class MEMEstimate(nn.Module):
    r"""The exact MEM estimate ĥ as a layer: ``forward(templates, z, preference=None) -> ĥ``.

    Thin wrapper of :func:`attnopt.dual.mem_estimate` (differentiable by implicit
    differentiation). Shapes: ``templates (..., n, d)``, ``z (..., d)``,
    ``preference (..., n)`` -> ``(..., d)``.

    Args:
        alpha: reliability α > 0.
        tol, max_iter: Newton solver knobs.
    Raises:
        ValueError: ``alpha <= 0``, ``tol <= 0`` or ``max_iter < 1`` (at call time).
    """

    def __init__(self, alpha: float = 1.0, *, tol: float = 1e-8, max_iter: int = 50) -> None:
        super().__init__()
        self.alpha, self.tol, self.max_iter = alpha, tol, max_iter

    def forward(self, templates: Tensor, z: Tensor, preference: Tensor | None = None) -> Tensor:
        return mem_estimate(
            templates, z, preference=preference, alpha=self.alpha, tol=self.tol, max_iter=self.max_iter
        )

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, tol={self.tol}, max_iter={self.max_iter}"


class MEMAttention(MultiheadBase):
    r"""Multi-head attention whose weights are the *exact* MEM solution (not its approximation).

    Same call convention as ``nn.MultiheadAttention(batch_first=True)`` and as
    :class:`~attnopt.nn.GeneralizedMultiheadAttention`; each head uses
    :func:`attnopt.dual.mem_attention` (templates = keys, evidence = queries,
    ``α = scale``). For small α it matches ``GeneralizedMultiheadAttention`` with the same
    weights (eq. 14–16). Each forward runs a batched Newton solve and the backward one extra
    Hessian solve: use it for analysis and small models.

    Args:
        embed_dim: E.  num_heads: H.
        preference: optional :class:`~attnopt.nn.PreferenceModule` giving ``log u``.
        scale: α (default ``1/sqrt(E/H)``).
        tol, max_iter: Newton solver knobs.
        bias, kdim, vdim, dropout: as ``nn.MultiheadAttention`` (dropout on the weights).

    Shapes: ``query (B, Nq, E)``, ``key (B, Nk, kdim)``, ``value (B, Nk, vdim)`` ->
    ``(B, Nq, E)`` and, with ``need_weights=True``, weights ``(B, Nq, Nk)`` (the head
    average, as ``nn.MultiheadAttention``; ``(B, H, Nq, Nk)`` with ``average_attn_weights=False``).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        preference: PreferenceModule | None = None,
        *,
        scale: float | None = None,
        tol: float = 1e-8,
        max_iter: int = 50,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim, dropout=dropout)
        if preference is not None and not isinstance(preference, PreferenceModule):
            raise TypeError(f"preference must be a PreferenceModule or None, got {type(preference).__name__}")
        if scale is not None and not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.preference = preference
        self.scale, self.tol, self.max_iter = scale, tol, max_iter

    def input_bias(self, query: Tensor, key: Tensor) -> Tensor | None:
        """``log u`` from the preference module (``None`` for uniform ``u``)."""
        return None if self.preference is None else self.preference.log_preference(query, key)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        w = mem_weights(
            q, k, log_preference=mask, scale=self.scale, is_causal=is_causal, tol=self.tol,
            max_iter=self.max_iter,
        )
        wd = F.dropout(w, p=self.dropout) if self.training and self.dropout > 0 else w
        return wd @ v, (w if need_weights else None)

"""Multi-head regularized (one-sided entropic OT) attention (sdpa-one-sided-eot §3–4)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from attnopt.functional.regularized import regularized_attention, regularized_attention_weights
from attnopt.functional.regularized.regularizers import Regularizer, Shannon
from attnopt.nn._multihead import MultiheadBase

__all__ = ["RegularizedMultiheadAttention"]


class RegularizedMultiheadAttention(MultiheadBase):
    r"""``nn.MultiheadAttention(batch_first=True)`` whose weights solve a regularized argmax.

    Each head computes :func:`attnopt.regularized_attention`:
    ``p_i = argmax_{p∈Δ} <s_i, p> − Ω(p) − β_h Σ_j p_j |i − j|`` — ``Shannon(τ)`` (softmax,
    SDPA), ``SquaredL2()`` (sparsemax), ``Tsallis(α)`` (α-entmax), plus the ALiBi locality
    ``β`` (Prop. 4.4).

    Args:
        embed_dim: E.
        num_heads: H.
        regularizer: default ``Shannon()``; a tensor-``α`` :class:`~attnopt.functional.Tsallis`
            is registered as a parameter only if you wrap it yourself (it is used as given).
        locality: ``None``, a number (all heads) or an ``(H,)`` tensor of slopes ``β_h`` (e.g.
            ``ALiBiPreference(H).slopes``).
        learn_locality: make ``β`` a trainable parameter (requires ``locality``).
        bias, kdim, vdim, dropout: as ``nn.MultiheadAttention``. Dropout on the weights (training
            mode) materializes the ``Nq × Nk`` weights.

    Shapes: ``query (B, Nq, E)``, ``key (B, Nk, kdim)``, ``value (B, Nk, vdim)`` ->
    ``(B, Nq, E)`` and, with ``need_weights=True``, weights ``(B, Nq, Nk)`` (the head
    average, as ``nn.MultiheadAttention``; ``(B, H, Nq, Nk)`` with ``average_attn_weights=False``).

    Raises:
        TypeError: a regularizer without ``conjugate_grad``.
        ValueError: a per-head ``locality`` not of shape ``(H,)``, non-finite ``locality``,
            ``learn_locality`` without ``locality``.
    """

    locality: Tensor | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        regularizer: Regularizer | None = None,
        locality: float | Tensor | None = None,
        *,
        learn_locality: bool = False,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim, dropout=dropout)
        reg = Shannon() if regularizer is None else regularizer
        if not callable(getattr(reg, "conjugate_grad", None)):
            raise TypeError(f"regularizer must provide conjugate_grad(scores, dim), got {type(reg).__name__}")
        self.regularizer = reg
        if locality is None:
            if learn_locality:
                raise ValueError("learn_locality=True needs an initial locality")
            self.locality = None
            return
        beta = torch.as_tensor(locality, dtype=torch.get_default_dtype()).detach().clone()
        if beta.dim() == 1 and beta.shape != (num_heads,):
            raise ValueError(f"per-head locality must have shape ({num_heads},), got {tuple(beta.shape)}")
        if beta.dim() > 1:
            raise ValueError(f"locality must be a number or an (H,) tensor, got shape {tuple(beta.shape)}")
        if not bool(torch.isfinite(beta).all()):
            raise ValueError("locality must be finite")
        if learn_locality:
            self.locality = nn.Parameter(beta)
        else:
            self.register_buffer("locality", beta)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        reg, beta = self.regularizer, self.locality
        out = regularized_attention(
            q, k, v, regularizer=reg, attn_mask=mask, locality=beta, is_causal=is_causal,
            dropout_p=self.dropout_p,
        )
        weights = None
        if need_weights:
            weights = regularized_attention_weights(
                q, k, regularizer=reg, attn_mask=mask, locality=beta, is_causal=is_causal
            )
        return out, weights

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, regularizer={self.regularizer!r}"

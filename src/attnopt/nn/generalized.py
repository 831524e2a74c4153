"""Multi-head generalized attention with a preference module (fenchel-dual-attention eq. 16–18)."""
from __future__ import annotations

from torch import Tensor

from attnopt.functional.generalized import generalized_attention, generalized_weights
from attnopt.nn._multihead import MultiheadBase
from attnopt.nn.preference import PreferenceModule

__all__ = ["GeneralizedMultiheadAttention"]


class GeneralizedMultiheadAttention(MultiheadBase):
    r"""``nn.MultiheadAttention(batch_first=True)`` with a preference ``u`` per head.

    Each head computes :func:`attnopt.generalized_attention` with
    ``log_preference = preference.log_preference(query, key)`` plus the masks;
    ``preference=None`` is ordinary multi-head attention (uniform ``u``, eq. 16).

    Args:
        embed_dim: E.
        num_heads: H.
        preference: a :class:`~attnopt.nn.PreferenceModule` (``T5RelativePreference``,
            ``ALiBiPreference``, ``KeyPreference``) or ``None``.
        bias, kdim, vdim, dropout: as ``nn.MultiheadAttention``.

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
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim, dropout=dropout)
        if preference is not None and not isinstance(preference, PreferenceModule):
            raise TypeError(f"preference must be a PreferenceModule or None, got {type(preference).__name__}")
        self.preference = preference

    def input_bias(self, query: Tensor, key: Tensor) -> Tensor | None:
        """``log u`` from the preference module (``None`` for uniform ``u``)."""
        return None if self.preference is None else self.preference.log_preference(query, key)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        log_u = mask  # the preference's log u was folded into the mask by input_bias
        p = self.dropout if self.training else 0.0
        out = generalized_attention(q, k, v, log_preference=log_u, is_causal=is_causal, dropout_p=p)
        weights = None
        if need_weights:
            weights = generalized_weights(q, k, log_preference=log_u, is_causal=is_causal)
        return out, weights

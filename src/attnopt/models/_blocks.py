"""Pre-LN Transformer blocks, positions and per-layer attention selection (no Lightning here)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnopt.nn.registry import attention_spec, make_attention

__all__ = [
    "EncoderBlock",
    "DecoderBlock",
    "SinusoidalPositions",
    "LearnedPositions",
    "make_positions",
    "layer_attentions",
    "self_attention_mask",
    "call_attention",
    "auxiliary_loss",
]

AttentionChoice = str | Sequence[str]
OptionsChoice = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


def layer_attentions(
    attention: AttentionChoice,
    options: OptionsChoice,
    num_layers: int,
    d_model: int,
    num_heads: int,
    *,
    what: str = "attention",
) -> nn.ModuleList:
    """One registry module per layer from a name (all layers) or a list of names (one per layer).

    ``options`` is one dict for every layer or a list of dicts, one per layer.

    Raises:
        ValueError: a list of the wrong length, an unknown name/option, or ``"ot"`` (a pooling
            layer, not self-attention: use :class:`attnopt.models.ViT` ``ot_last_layer``).
    """
    names = [attention] * num_layers if isinstance(attention, str) else list(attention)
    if len(names) != num_layers:
        raise ValueError(f"{what} must be a name or a list of {num_layers} names, got {len(names)}")
    if options is None or isinstance(options, Mapping):
        opts: list[Mapping[str, Any]] = [dict(options or {})] * num_layers
    else:
        opts = list(options)
        if len(opts) != num_layers:
            raise ValueError(
                f"{what} options must be a dict or a list of {num_layers} dicts, got {len(opts)}"
            )
    mods = nn.ModuleList()
    for name, o in zip(names, opts, strict=True):
        if not attention_spec(name).multihead_convention:
            raise ValueError(
                f"{what} {name!r} is a pooling layer, not self-attention; "
                "use attnopt.models.ViT(ot_last_layer=True)"
            )
        mods.append(make_attention(name, d_model, num_heads, **dict(o)))
    return mods


def self_attention_mask(
    padding: Tensor | None, nq: int, nk: int, *, causal: bool = False, query_padding: Tensor | None = None
) -> Tensor | None:
    """Boolean mask ``(B|1, 1, Nq, Nk)`` (``True`` = not allowed) from padding and causality.

    Padding *queries* are masked too (their rows are all ``True``, a documented finite result in
    every mechanism), so that mechanisms normalizing over queries (DNAS, HNAS, Sinkhorn) see
    only real tokens: a padded batch gives the unpadded results.

    This ``Nq × Nk`` mask is what the models passed before they handed padding to the modules
    (:func:`call_attention`, O(N)); it remains the reference of that path and serves modules
    without ``query_padding_mask``.
    """
    mask: Tensor | None = None
    if padding is not None:
        mask = padding[:, None, None, :]
        qp = padding if query_padding is None and nq == nk else query_padding
        if qp is not None:
            mask = mask | qp[:, None, :, None]
    elif query_padding is not None:
        mask = query_padding[:, None, :, None].expand(-1, 1, nq, nk)
    if causal:
        ref = padding if padding is not None else query_padding
        dev = ref.device if ref is not None else None
        tri = torch.ones(nq, nk, dtype=torch.bool, device=dev).triu(nk - nq + 1).view(1, 1, nq, nk)
        mask = tri if mask is None else mask | tri
    return mask


def _takes_query_padding(module: nn.Module) -> bool:
    """Whether ``module.forward`` accepts ``query_padding_mask`` (the registry modules do)."""
    cls = type(module)
    cached = _QUERY_PADDING.get(cls)
    if cached is None:
        try:
            cached = "query_padding_mask" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            cached = False
        _QUERY_PADDING[cls] = cached
    return cached


_QUERY_PADDING: dict[type, bool] = {}


def call_attention(
    attention: nn.Module,
    query: Tensor,
    kv: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
) -> Tensor:
    """Run ``attention(query, kv, kv)`` with padding given as O(N) masks; returns its output.

    ``key_padding_mask (B, Nk)`` and ``query_padding_mask (B, Nq)`` are boolean (``True`` =
    padding). Registry modules receive them as they are (the module turns key padding into a
    ``(B, 1, 1, Nk)`` mask, zeroes padded query rows and folds query padding into its
    normalizations over queries), with ``is_causal`` kept as a flag: the result is that of the
    mask ``key padding ∪ query padding (∪ causal)``. A module without ``query_padding_mask``
    (e.g. ``nn.MultiheadAttention``) gets ``key_padding_mask`` and, with ``is_causal``, a shared
    ``(Nq, Nk)`` causal ``attn_mask``; its padded query rows are then set to zero.
    """
    if query_padding_mask is not None and not _takes_query_padding(attention):
        if is_causal and attn_mask is None:
            nq, nk = query.shape[1], kv.shape[1]
            attn_mask = torch.ones(nq, nk, dtype=torch.bool, device=query.device).triu(1)
        out, _ = attention(
            query, kv, kv, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal
        )
        return out.masked_fill(query_padding_mask.unsqueeze(-1), 0.0)
    extra = {} if query_padding_mask is None else {"query_padding_mask": query_padding_mask}
    out, _ = attention(
        query, kv, kv, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal, **extra
    )
    return out


class _FeedForward(nn.Sequential):
    def __init__(self, d_model: int, dim_feedforward: int, dropout: float) -> None:
        super().__init__(
            nn.Linear(d_model, dim_feedforward),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(dim_feedforward, d_model),
        )


class EncoderBlock(nn.Module):
    r"""Pre-LN Transformer block around any registry attention module.

    .. math:: x \leftarrow x + \mathrm{drop}(\mathrm{Attn}(\mathrm{LN}(x), m, m)),\qquad
              x \leftarrow x + \mathrm{drop}(\mathrm{FFN}(\mathrm{LN}(x)))

    with ``m = LN(x)`` (self-attention) or ``m = memory`` (keys/values from another sequence).

    Padding is passed as O(N) masks (:func:`call_attention`): ``key_padding_mask (B, M|N)`` for
    the keys and ``query_padding_mask (B, N)`` for the queries (bool, ``True`` = padding).

    Args:
        d_model: E.
        attention: a module with the ``nn.MultiheadAttention(batch_first=True)`` convention
            (e.g. from :func:`attnopt.nn.make_attention`).
        dim_feedforward: hidden width of the GELU MLP.
        dropout: residual and MLP dropout.

    Shapes: ``x (B, N, E)``, ``memory (B, M, E)`` -> ``(B, N, E)``.
    """

    def __init__(
        self, d_model: int, attention: nn.Module, dim_feedforward: int, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.attention = attention
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.ff = _FeedForward(d_model, dim_feedforward, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        *,
        memory: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        query_padding_mask: Tensor | None = None,
    ) -> Tensor:
        h = self.norm1(x)
        kv = h if memory is None else memory
        a = call_attention(
            self.attention, h, kv, key_padding_mask=key_padding_mask, query_padding_mask=query_padding_mask,
            attn_mask=attn_mask, is_causal=is_causal,
        )
        x = x + self.drop(a)
        return x + self.drop(self.ff(self.norm2(x)))


class DecoderBlock(nn.Module):
    """Pre-LN decoder block: causal self-attention, cross-attention to ``memory``, MLP.

    ``padding_mask (B, N)`` marks padded target positions (keys and queries of the
    self-attention, queries of the cross-attention) and ``memory_padding_mask (B, M)`` the
    padded memory positions (keys of the cross-attention); both are passed as O(N) masks with
    ``is_causal`` kept as a flag (:func:`call_attention`). ``self_mask``/``cross_mask`` are
    extra masks (e.g. the ``Nq × Nk`` masks of :func:`self_attention_mask`); with a
    ``self_mask`` that already holds causality, pass ``is_causal=False``.

    Args:
        d_model: E.
        self_attention, cross_attention: registry modules (``nn.MultiheadAttention`` convention).
        dim_feedforward, dropout: as :class:`EncoderBlock`.
    """

    def __init__(
        self,
        d_model: int,
        self_attention: nn.Module,
        cross_attention: nn.Module,
        dim_feedforward: int,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.self_attention, self.cross_attention = self_attention, cross_attention
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(d_model) for _ in range(3))
        self.ff = _FeedForward(d_model, dim_feedforward, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        padding_mask: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        self_mask: Tensor | None = None,
        cross_mask: Tensor | None = None,
        is_causal: bool = True,
    ) -> Tensor:
        h = self.norm1(x)
        a = call_attention(
            self.self_attention, h, h, key_padding_mask=padding_mask, query_padding_mask=padding_mask,
            attn_mask=self_mask, is_causal=is_causal,
        )
        x = x + self.drop(a)
        h = self.norm2(x)
        c = call_attention(
            self.cross_attention, h, memory, key_padding_mask=memory_padding_mask,
            query_padding_mask=padding_mask, attn_mask=cross_mask,
        )
        x = x + self.drop(c)
        return x + self.drop(self.ff(self.norm3(x)))


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal positions (Vaswani et al.): ``x + PE[:N]``; ``(B, N, E) -> (B, N, E)``."""

    pe: Tensor

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)[:, : d_model // 2]
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        n = x.shape[1]
        if offset + n > self.pe.shape[0]:
            raise ValueError(f"sequence length {offset + n} exceeds max_len={self.pe.shape[0]}")
        return x + self.pe[offset : offset + n].to(x.dtype)


class LearnedPositions(nn.Module):
    """Learned absolute positions: ``x + P[:N]``; ``(B, N, E) -> (B, N, E)``."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        n = x.shape[1]
        if offset + n > self.weight.shape[0]:
            raise ValueError(f"sequence length {offset + n} exceeds max_len={self.weight.shape[0]}")
        return x + self.weight[offset : offset + n].to(x.dtype)


def make_positions(kind: str | None, d_model: int, max_len: int) -> nn.Module:
    """``"sinusoidal"``, ``"learned"`` or ``None`` (identity)."""
    if kind == "sinusoidal":
        return SinusoidalPositions(d_model, max_len)
    if kind == "learned":
        return LearnedPositions(d_model, max_len)
    if kind is None:
        return nn.Identity()
    raise ValueError(f"positions must be 'sinusoidal', 'learned' or None, got {kind!r}")


def _no_required_args(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def auxiliary_loss(model: nn.Module) -> Tensor:
    """Sum of ``kl()`` over every submodule that has one (the IKA variants' ELBO KL terms).

    A submodule counts when it has a ``kl`` method callable without arguments (static helpers
    such as ``ImplicitSpectralDensity.kl(mu, log_sigma)`` are not auxiliary losses).

    Each ``kl()`` refers to the module's last forward pass; a module never run yet is skipped.
    Returns a 0-d tensor (zero when no module has a KL) on the model's device.
    """
    total: Tensor | None = None
    for m in model.modules():
        kl = getattr(m, "kl", None)
        if not callable(kl) or not _no_required_args(kl):
            continue
        try:
            v = kl()
        except RuntimeError:
            continue
        total = v if total is None else total + v
    if total is None:
        p = next(model.parameters(), None)
        return torch.zeros((), device=None if p is None else p.device)
    return total

"""Shared multi-head plumbing for every attention module (internal).

:class:`MultiheadBase` owns the input/output projections, head splitting and the mask
conventions of ``torch.nn.MultiheadAttention(batch_first=True)``; a mechanism subclasses it
and implements :meth:`MultiheadBase.attend` on ``(B, H, N, d)`` tensors.

Padding costs O(N): ``key_padding_mask (B, Nk)`` becomes an additive ``(B, 1, 1, Nk)`` mask and
``query_padding_mask (B, Nq)`` (an attnopt addition) zeroes the padded queries' rows, so that a
padded batch never materializes an ``Nq × Nk`` mask — except in mechanisms that normalize over
queries (:attr:`MultiheadBase.couples_queries`: DNAS, HNAS, Sinkhorn), whose functional ops take
query padding only as part of a full mask.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from attnopt._validation import check_finite, host_readable

__all__ = ["MultiheadBase", "merge_masks", "query_padding"]


def merge_masks(
    attn_mask: Tensor | None, key_padding_mask: Tensor | None, batch: int, nq: int, nk: int
) -> Tensor | None:
    """Combine ``nn.MultiheadAttention``-style masks into one SDPA-style mask.

    Args:
        attn_mask: (Nq, Nk) or (B*H, Nq, Nk)/(B, H, Nq, Nk) — boolean ``True`` = *not allowed*
            (``nn.MultiheadAttention`` convention) or additive float.
        key_padding_mask: (B, Nk) — boolean ``True`` = padding, or additive float.
    Returns:
        ``None`` or an additive float mask broadcastable to (B, H, Nq, Nk) (``-inf`` = drop).
    Raises:
        ValueError: shapes that do not fit.
    """
    out: Tensor | None = None
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (nq, nk):
                raise ValueError(f"attn_mask must be ({nq}, {nk}), got {tuple(attn_mask.shape)}")
            m = attn_mask.view(1, 1, nq, nk)
        elif attn_mask.dim() == 3:
            if attn_mask.shape[1:] != (nq, nk) or attn_mask.shape[0] % batch:
                raise ValueError(f"attn_mask must be (B*H, {nq}, {nk}), got {tuple(attn_mask.shape)}")
            m = attn_mask.view(batch, -1, nq, nk)
        elif attn_mask.dim() == 4:
            m = attn_mask
        else:
            raise ValueError(f"attn_mask must have 2, 3 or 4 dims, got {attn_mask.dim()}")
        out = _to_additive(m, "attn_mask")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, nk):
            raise ValueError(
                f"key_padding_mask must be (B, Nk) = ({batch}, {nk}), got {tuple(key_padding_mask.shape)}"
            )
        kp = _to_additive(key_padding_mask.view(batch, 1, 1, nk), "key_padding_mask")
        out = kp if out is None else out + kp
    return out


def query_padding(query_padding_mask: Tensor | None, batch: int, nq: int) -> Tensor | None:
    """Validate ``query_padding_mask`` and return it as a boolean ``(B, Nq)`` (``True`` = padding).

    Accepts a boolean mask (``True`` = padding) or an additive float one (``-inf`` = padding), as
    ``key_padding_mask``; ``None`` when not given.

    Raises:
        TypeError: neither boolean nor floating point.
        ValueError: not ``(B, Nq)``.
    """
    if query_padding_mask is None:
        return None
    if not isinstance(query_padding_mask, Tensor):
        raise TypeError(f"query_padding_mask must be a tensor, got {type(query_padding_mask).__name__}")
    if query_padding_mask.shape != (batch, nq):
        raise ValueError(
            f"query_padding_mask must be (B, Nq) = ({batch}, {nq}), got {tuple(query_padding_mask.shape)}"
        )
    if query_padding_mask.dtype == torch.bool:
        return query_padding_mask
    if not query_padding_mask.is_floating_point():
        raise TypeError(
            f"query_padding_mask must be boolean or floating point, got {query_padding_mask.dtype}"
        )
    return torch.isneginf(query_padding_mask)


def _to_additive(mask: Tensor, name: str) -> Tensor:
    if mask.dtype == torch.bool:
        # zeros_like: batched like the mask under torch.func.vmap (per-example calls)
        return torch.zeros_like(mask, dtype=torch.get_default_dtype()).masked_fill_(mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"{name} must be boolean or floating point, got {mask.dtype}")
    return mask


class MultiheadBase(nn.Module):
    """Projections and head handling shared by the attention modules.

    Subclasses whose normalization runs over queries (a padded query would change the other
    rows) set :attr:`couples_queries`; ``query_padding_mask`` is then folded into the mask that
    :meth:`attend` receives, otherwise it only zeroes the padded rows of the output.

    Args:
        embed_dim: model dimension E (``= num_heads * head_dim``).
        num_heads: H.
        bias: bias in the input/output projections.
        kdim, vdim: feature sizes of key/value inputs (default ``embed_dim``).
        dropout: dropout on the attention weights during training.
    Raises:
        ValueError: ``embed_dim`` not divisible by ``num_heads`` or non-positive sizes.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be > 0, got {embed_dim}, {num_heads}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(kdim or embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    #: True for mechanisms that normalize over queries (DNAS, HNAS, Sinkhorn).
    couples_queries: bool = False

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, N, E) -> (B, H, N, E/H)."""
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def merge_heads(self, x: Tensor) -> Tensor:
        """(B, H, N, d) -> (B, N, H*d)."""
        b, h, n, d = x.shape
        return x.transpose(1, 2).reshape(b, n, h * d)

    def input_bias(self, query: Tensor, key: Tensor) -> Tensor | None:  # noqa: ARG002
        """Optional additive score bias computed from the raw inputs (e.g. a preference ``log u``).

        ``query (B, Nq, E)``, ``key (B, Nk, kdim)`` -> ``None`` or a tensor broadcastable to
        ``(B, H, Nq, Nk)``; it is added to the mask handed to :meth:`attend`. Default: ``None``.
        """
        return None

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The mechanism on ``(B, H, N, d)`` tensors; ``mask`` is additive (``-inf`` = drop).

        Returns ``(out (B,H,Nq,d), weights (B,H,Nq,Nk) or None)``.
        """
        raise NotImplementedError

    def check_features(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """Raise ``TypeError``/``ValueError`` naming the input whose type, rank or feature size
        (``embed_dim`` / ``kdim`` / ``vdim``) is wrong, before any projection runs."""
        for name, x, size in (("query", query, self.embed_dim), ("key", key, self.kdim),
                              ("value", value, self.vdim)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 3:
                raise ValueError(
                    f"{name} must be (B, N, features) (batch_first) or, unbatched, (N, features), "
                    f"got {tuple(x.shape)}"
                )
            if x.shape[-1] != size:
                attr = {"query": "embed_dim", "key": "kdim", "value": "vdim"}[name]
                raise ValueError(
                    f"{name} has {x.shape[-1]} features, expected {attr}={size}: shape {tuple(x.shape)}"
                )

    @property
    def dropout_p(self) -> float:
        """The dropout probability of this call: ``dropout`` in training mode, 0 in ``eval()``."""
        return self.dropout if self.training else 0.0

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        query_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend ``query (B, Nq, E)`` to ``key (B, Nk, kdim)``/``value (B, Nk, vdim)``.

        The arguments, their order and their defaults are ``nn.MultiheadAttention``'s
        (``batch_first=True``), with one documented difference: ``need_weights`` defaults to
        ``False``. The mechanisms' fast paths never form the ``Nq × Nk`` weights (O(N) memory for
        DNAS, the kernels' linear mode, the streaming paths); returning them by default would make
        every call quadratic. Ask with ``need_weights=True``.

        ``key``/``value`` default to ``query`` (self-attention). Masks follow
        ``nn.MultiheadAttention``: boolean ``True`` = not allowed / padding; float = additive.
        ``key_padding_mask (B, Nk)`` stays a ``(B, 1, 1, Nk)`` mask (O(N)); with ``is_causal``
        it gives causal attention over the real keys without an ``Nq × Nk`` mask in the
        mechanisms that support that combination.

        Unbatched input as in ``nn.MultiheadAttention``: ``query (Nq, E)``, ``key (Nk, kdim)``,
        ``value (Nk, vdim)``, ``key_padding_mask (Nk,)``, ``attn_mask (Nq, Nk)`` or
        ``(H, Nq, Nk)``, giving ``(Nq, E)`` and weights ``(Nq, Nk)`` / ``(H, Nq, Nk)``.

        ``query_padding_mask (B, Nq)`` (not in ``nn.MultiheadAttention``; boolean ``True`` =
        padding, or additive): a padded query takes no part in the attention — its row is the
        result of a row with no admissible key (zeros before ``out_proj``, zero weights) and,
        in mechanisms that normalize over queries, it is left out of those normalizations. The
        result equals passing the ``Nq × Nk`` mask ``key padding ∪ query padding``.

        Dropout (``dropout`` of the constructor, training mode only) acts on the attention
        weights before the sum over values. The returned weights are the mechanism's, before
        dropout (``nn.MultiheadAttention`` returns them after its dropout): what analysis reads.

        Args:
            need_weights: also return the attention weights (default ``False``, see above).
            average_attn_weights: return the weights averaged over heads, ``(B, Nq, Nk)``
                (``nn.MultiheadAttention``'s default), or per head, ``(B, H, Nq, Nk)``
                (``False``).
        Returns:
            ``(output (B, Nq, E), weights or None)``.
        Raises:
            TypeError: ``query``/``key``/``value`` is not a tensor; a mask of the wrong dtype.
            ValueError: an input that is not 3-D (or 2-D for all three: unbatched), whose feature
                size differs from ``embed_dim``/``kdim``/``vdim`` (named), or mismatched
                batch/lengths/mask shapes.
        """
        key = query if key is None else key
        value = key if value is None else value
        unbatched = isinstance(query, Tensor) and query.dim() == 2
        if unbatched:
            query, key, value = _batch_of_one(query=query, key=key, value=value)
            key_padding_mask = _padding_of_one(key_padding_mask, "key_padding_mask")
            query_padding_mask = _padding_of_one(query_padding_mask, "query_padding_mask")
        out, weights = self._forward_batched(
            query, key, value, key_padding_mask, attn_mask, need_weights, is_causal, query_padding_mask
        )
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return out, weights

    def _forward_batched(
        self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
        attn_mask: Tensor | None, need_weights: bool, is_causal: bool, query_padding_mask: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`forward` on batched (B, N, ·) inputs, per-head weights (B, H, Nq, Nk)."""
        self.check_features(query, key, value)
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(
                f"query/key/value batch or length mismatch: {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}"
            )
        check_finite(query=query, key=key, value=value)  # the shared non-finite policy, by module argument
        qpad = query_padding(query_padding_mask, query.shape[0], query.shape[1])
        q = self.split_heads(self.q_proj(query))
        k = self.split_heads(self.k_proj(key))
        v = self.split_heads(self.v_proj(value))
        mask = merge_masks(attn_mask, key_padding_mask, query.shape[0], q.shape[-2], k.shape[-2])
        bias = self.input_bias(query, key)
        if bias is not None:
            mask = bias if mask is None else bias + mask
        rows = None if qpad is None else qpad.view(qpad.shape[0], 1, qpad.shape[1], 1)
        # normalizations skip padded query rows; off the CPU / compiling the mask is added
        # unconditionally (zeros where nothing is padded): no host read of the padding
        if rows is not None and self.couples_queries and (not host_readable(rows) or bool(rows.any())):
            qadd = torch.zeros(rows.shape, dtype=q.dtype, device=q.device).masked_fill_(rows, float("-inf"))
            mask = qadd if mask is None else mask + qadd
        if self.couples_queries:
            rows = None  # padded rows come out as zeros already
        if mask is not None:
            mask = mask.to(q.dtype)
        out, weights = self.attend(q, k, v, mask, is_causal, need_weights)
        if rows is not None:
            out = out.masked_fill(rows, 0.0)
            if weights is not None:
                weights = weights.masked_fill(rows, 0.0)
        return self.out_proj(self.merge_heads(out)), weights


def _batch_of_one(**inputs: Tensor) -> tuple[Tensor, ...]:
    """Unbatched ``(N, features)`` inputs as a batch of one; every one must be 2-D then."""
    out = []
    for name, x in inputs.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(
                f"{name} must be (N, features) when query is unbatched (2-D), got {tuple(x.shape)}"
            )
        out.append(x.unsqueeze(0))
    return tuple(out)


def _padding_of_one(mask: Tensor | None, name: str) -> Tensor | None:
    """An unbatched padding mask ``(N,)`` as ``(1, N)``."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() != 1:
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be (N,) for unbatched inputs, got {shape}")
    return mask.unsqueeze(0)

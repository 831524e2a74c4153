r"""Generalized attention with a preference through FlexAttention (fenchel-dual-attention eq. 16–18).

``out_i = Σ_j softmax_j(scale <q_i, k_j> + log u_ij + m_ij) v_j`` as
:func:`torch.nn.attention.flex_attention.flex_attention` with a ``score_mod`` that adds the bias
and a ``block_mask`` for ``is_causal`` (whole blocks above the diagonal are skipped):

* a relative-position bias (T5's buckets, ALiBi: the tensor carries its per-offset values,
  :mod:`attnopt.functional.generalized._toeplitz`) is read as ``offsets[h, j − i + Nq − 1]`` — O(N) per head,
  and the gradient reaches the offsets, hence T5's bucket table / ALiBi's slopes;
* any other bias (a learned key preference ``(B, H, 1, Nk)``, key padding, a full preference) is
  read through a stride-0 view ``bias[b, h, i, j]`` of its own shape — nothing is expanded;
* a mask next to a relative-position bias is a second captured tensor.

On CUDA FlexAttention is compiled once per process (``torch.compile(flex_attention)``), forward
and backward (its Triton kernels); elsewhere it runs eagerly, which PyTorch supports for the
forward only (CPU: tested in CI; gradients need a GPU). Rows with no admissible key give 0.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from attnopt._validation import additive_mask, broadcast_shapes
from attnopt.functional.generalized._toeplitz import toeplitz_offsets
from attnopt.functional.triton._shapes import _to4

__all__ = ["flex_generalized_attention"]

_COMPILED: list[Callable[..., Any]] = []


def _flex() -> Callable[..., Any]:
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED[0]


def _index4(x: Tensor, batch: tuple[int, ...], nq: int, nk: int) -> Tensor:
    """``x`` broadcast to ``(*batch, Nq, Nk)`` and viewed 4-D (stride 0 where it broadcasts)."""
    return _to4(x.expand(*batch, nq, nk), batch)


def _causal(_b: Tensor, _h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return kv_idx <= q_idx


_BLOCK_MASKS: dict[tuple[int, int, torch.device], Any] = {}


def _causal_block_mask(nq: int, nk: int, device: torch.device) -> Any:
    """SDPA's top-left causal mask as a Flex block mask, built once per (Nq, Nk, device): building
    one evaluates the mask over the whole grid, so it is kept (a few per process)."""
    key = (nq, nk, device)
    hit = _BLOCK_MASKS.get(key)
    if hit is None:
        if len(_BLOCK_MASKS) >= 8:
            _BLOCK_MASKS.clear()
        hit = _BLOCK_MASKS[key] = create_block_mask(_causal, None, None, nq, nk, device=device)
    return hit


def flex_generalized_attention(
    q: Tensor, k: Tensor, v: Tensor, *, preference: Tensor | None, log_preference: Tensor | None,
    attn_mask: Tensor | None, scale: float, is_causal: bool,
) -> Tensor:
    """The attention above on validated, non-empty inputs (arguments as ``generalized_attention``).

    Returns:
        (…, Nq, dv) in ``q``'s dtype; rows with no admissible key are zeros.
    Raises:
        ValueError: as ``generalized_attention`` (a negative or non-finite preference, ...).
    """
    from attnopt.functional.generalized.bias import score_bias

    nq, nk = q.shape[-2], k.shape[-2]
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q4, k4, v4 = _to4(q, batch), _to4(k.to(q.dtype), batch), _to4(v.to(q.dtype), batch)
    offsets = None if log_preference is None or preference is not None else toeplitz_offsets(log_preference)
    if offsets is not None and offsets.shape[0] != q4.shape[1]:
        offsets = None
    bias = None
    if offsets is None:
        bias = score_bias(q, k, preference, log_preference, attn_mask, False,
                          dtype=torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else None)
    score_mod = None
    # the bias in float32 beside half-precision inputs: Flex adds it to float32 scores
    bdt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    if offsets is not None:
        off = offsets.to(bdt)
        mask = additive_mask(attn_mask, (*batch, nq, nk), bdt)
        m4 = None if mask is None else _index4(mask, tuple(batch), nq, nk)

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            out = score + off[h, kv_idx - q_idx + nq - 1]
            if m4 is not None:
                out = out + m4[b, h, q_idx, kv_idx]
            return out
    elif bias is not None:
        b4 = _index4(bias.to(bdt), tuple(batch), nq, nk)

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + b4[b, h, q_idx, kv_idx]
    block_mask = _causal_block_mask(nq, nk, q.device) if is_causal else None
    if q.is_cuda:
        out = _flex()(q4, k4, v4, score_mod=score_mod, block_mask=block_mask, scale=scale)
    else:  # eager (forward only in PyTorch): the unfused reference implementation, by design here
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(q4, k4, v4, score_mod=score_mod, block_mask=block_mask, scale=scale)
    return out.reshape(*batch, nq, v.shape[-1])

"""The autoregressive (``causal="prefix"``) DNAS / Sinkhorn / HNAS in Hugging Face decoders (internal).

In a causal self-attention module (``module.is_causal``, not cross-attention) ``attnopt_dnas``,
``attnopt_sinkhorn`` and ``attnopt_hnas`` run :mod:`attnopt.functional.doubly_normalized.prefix` by default:
query ``i`` normalizes the columns over the queries ``≤ i`` only, so no position reads a later
token (the masked plan, ``attnopt_causal="plan"``, does: see
:func:`attnopt.doubly_normalized_attention`).

Decoding with a KV cache. Row ``i`` needs the scores of the *queries* ``0..i``, which a KV cache
does not hold. After each call without gradient (``generate`` and ``torch.no_grad()`` decoding)
the module keeps the queries it has seen, their mask rows (boolean or additive, ``P × P``) and the
first feature of every key, under the attribute :data:`STATE` (a plain attribute: not in the
state dict). A call with ``P = Nk − Nq > 0`` cached positions continues from that state when it
covers exactly those ``P`` positions and its keys are the cache's first ``P`` keys (an exact
comparison: one host sync per layer and step); it then computes only the new rows (DNAS:
``O(P Nk)`` per step; Sinkhorn-K: the new rows' prefix problems, ``O(K P Nk)`` each). Anything
else — a reordered cache (beam search), a cache not filled by this module's previous call, a
static cache, a step with gradient enabled — raises ``ValueError`` instead of computing rows whose
normalizations would miss the past queries. A call without cached positions starts afresh.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnopt.functional._dropout import dropout_attention
from attnopt.functional.doubly_normalized import prefix

__all__ = ["STATE", "PrefixState", "causal_mode", "prefix_call"]

#: module attribute holding the :class:`PrefixState` of the last call without gradient
STATE = "_attnopt_prefix_state"


@dataclass(frozen=True)
class PrefixState:
    """What decoding needs of the positions already seen: queries, mask rows, key fingerprint."""

    queries: Tensor  # (B, H, P, d)
    mask: Tensor | None  # (…, P, P) boolean (True = take part) or additive; None = all admissible
    key_first: Tensor  # (B, H, P): key[..., 0], to recognise the cache these positions filled


def causal_mode(option: object, causal_self_attention: bool) -> str:
    """``"prefix"`` or ``"plan"`` for one call.

    ``attnopt_causal`` (``option``) selects the variant of a causal self-attention: ``None``
    (default) and ``"prefix"`` give the autoregressive variant, ``"plan"`` the masked plan. Encoder
    self-attention and cross-attention have no causal mask and run the mechanism as it is
    (``"plan"``) whatever the option.

    Raises:
        ValueError: an unknown option.
    """
    prefix.resolve_causal(option, False)  # validates
    return "prefix" if causal_self_attention and option != "plan" else "plan"


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def _stack_masks(past: Tensor | None, new: Tensor | None, p: int, nq: int, nk: int, dtype: torch.dtype,
                 device: torch.device) -> Tensor | None:
    """Rows ``0..P+Nq-1`` of the mask: the past rows (``P × P``, later keys dropped) over the new rows."""
    if past is None and new is None:
        return None
    if past is None:
        past = torch.ones(1, 1, p, p, dtype=torch.bool, device=device)
    if new is None:
        new = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
    if past.dtype != torch.bool or new.dtype != torch.bool:
        past, new = _additive(past, dtype), _additive(new, dtype)
    fill = False if past.dtype == torch.bool else float("-inf")
    past = torch.nn.functional.pad(past, (0, nk - p), value=fill)  # the past rows never saw the new keys
    past, new = past.expand(*torch.broadcast_shapes(past.shape[:-2], new.shape[:-2]), p, nk), new
    new = new.expand(*past.shape[:-2], nq, nk)
    return torch.cat([past, new], dim=-2)


def prefix_call(module: Any, name: str, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, *,
                scaling: float | None, iterations: int, weight: Tensor | None,
                dropout_p: float = 0.0) -> Tensor:
    """The prefix variant for one HF self-attention call, continuing from the cached state if any.

    ``mask``: boolean (True = take part) or additive, broadcastable to ``(B, H, Nq, Nk)``.
    Returns ``(B, H, Nq, dv)``.

    Raises:
        ValueError: cached positions without the matching state (see the module docstring).
    """
    nq, nk = query.shape[-2], key.shape[-2]
    p = nk - nq
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    state = getattr(module, STATE, None)
    if p < 0:
        raise ValueError(f"{name} with causal='prefix' expects a self-attention with Nk >= Nq, got Nq={nq}, "
                         f"Nk={nk}")
    if p == 0:
        q_all, m_all = query, mask
    else:
        seen = key[..., :p, 0]
        ok = (isinstance(state, PrefixState) and state.queries.shape[-2] == p
              and state.queries.shape[:-2] == query.shape[:-2] and state.key_first.shape == seen.shape
              and torch.equal(state.key_first, seen))
        if not ok:
            raise ValueError(
                f"{name} with causal='prefix' (the autoregressive variant, the default in a causal decoder) "
                f"needs the queries of the {p} cached positions, which attnopt keeps from this module's "
                "previous call without gradient; this cache was not filled that way (a reordered cache as in "
                "beam search, a static cache, a cache from another run, or gradient enabled). Run the whole "
                "sequence without a cache (use_cache=False), or pass attnopt_causal='plan' for the masked "
                "plan, which lets every position read later queries (analysis only)")
        assert isinstance(state, PrefixState)
        q_all = torch.cat([state.queries.to(query.dtype), query], dim=-2)
        m_all = _stack_masks(state.mask, mask, p, nq, nk, query.dtype, query.device)
    if dropout_p > 0.0:  # fine-tuning: dropout on the prefix weights, as SDPA on its weights
        w = prefix.prefix_weights(q_all, key, iterations=iterations, attn_mask=m_all, scale=scale,
                                  is_causal=False, weight=weight, first_row=p)
        out = dropout_attention(w, value, dropout_p, query.dtype)
    else:
        out = prefix.prefix_attention(q_all, key, value, iterations=iterations, attn_mask=m_all, scale=scale,
                                      is_causal=False, weight=weight, first_row=p)
    if not torch.is_grad_enabled():
        keep = None if m_all is None else m_all.detach()
        setattr(module, STATE, PrefixState(q_all.detach(), keep, key[..., 0].detach().clone()))
    elif state is not None:
        setattr(module, STATE, None)  # a call with gradient: the kept state no longer follows the cache
    return out

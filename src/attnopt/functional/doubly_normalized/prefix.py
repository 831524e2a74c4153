r"""Autoregressive (``causal="prefix"``) DNAS, Sinkhorn-K and HNAS: the variant for causal decoders.

Why it exists. DNAS normalizes each key's column over the queries, ``c_j = logsumexp_i s_ij``
(doubly-normalized-attention eq. 6–8). A causal mask removes a row's later *keys*, not a
column's later *queries*: with the mask alone (``causal="plan"``) row ``i`` depends on every
query ``i' > i`` through ``c_j``, so a decoder trained with teacher forcing reads the tokens it
is asked to predict, and its cached generation differs from its training forward. The mask
restricts the transport plan; it does not make the mechanism autoregressive.

The prefix variant lets query ``i`` normalize over the queries up to itself only. With
``A`` the admissible pairs (mask and ``is_causal``; under a causal mask ``(i', j) ∈ A`` iff
``j ≤ i'``):

* DNAS (K = 1):

  .. math:: c^{(i)}_j = \log \sum_{i' \le i,\ (i', j) \in A} e^{s_{i'j}}, \qquad
            \pi_{ij} = \mathrm{softmax}_{j:\,(i,j) \in A}\big(s_{ij} - c^{(i)}_j\big)

  (causal mask: ``c_j^{(i)} = logsumexp_{j ≤ i' ≤ i} s_{i'j}``) — one cumulative log-sum-exp
  over the queries of the ``Nq × Nk`` scores, then the row softmax.
* Sinkhorn-K: row ``i`` is row ``i`` of Sinkhorn-K run on the block of the first ``i + 1``
  queries (rows ``0..i`` of the scores, all keys, pairs outside ``A`` at weight 0): K times a
  log-domain column normalization over those ``i + 1`` queries, then a row normalization;
  the last row of the result. K = 1 is the DNAS formula above.
* HNAS: ``π = w π^prefix + (1 − w) softmax_j(s_ij)`` (the row softmax is autoregressive as is).

Row ``i`` therefore depends on queries ``0..i`` and the keys admissible to them only; with a
causal mask, on tokens ``0..i`` only. Every row sums to 1 (a row with no admissible key is zeros);
Lemma 1's column-mass bound holds per prefix, not for the whole plan.

Cost (materialized, plain PyTorch ops, autograd through them). DNAS / HNAS: ``O(Nq Nk d)`` time
and the ``Nq × Nk`` scores in memory, as the materialized path of
:mod:`.materialized`. Sinkhorn-K (K ≥ 2): each row solves its own ``(i + 1) × Nk``
problem, ``O(K Nq² Nk)`` time, computed a chunk of rows at a time (``R × Nq × Nk`` live
elements, ``THRESHOLDS.dn_prefix_chunk_elements``); with gradient each chunk is checkpointed and recomputed in
the backward (one chunk's normalizations live at a time, the forward's time twice): meant for
analysis and moderate sequence lengths.

No streaming (O(N)-memory) path: the normalizer ``c_j^{(i)}`` belongs to a (query, key) pair, not
to a key, so the flash passes of :mod:`.flash_cpu` / :mod:`.streaming` (a per-key bias
``−c_j``) do not apply. A forward in O(N) memory is a scan over query blocks carrying the running
column log-sum-exp (``Nk`` numbers); its backward needs the reverse scan of the gradient through
that running state, which is not written. The fast fused / native / streaming paths never run
this variant: the router sends it here.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnopt._func import under_transform
from attnopt._validation import additive_mask, causal_additive_mask, check_attention_inputs
from attnopt.functional._softmax import safe_logsumexp, safe_softmax
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["Causal", "CAUSAL_OPTIONS", "resolve_causal", "prefix_weights", "prefix_attention"]

#: ``"prefix"``: autoregressive (normalizations over queries ≤ i); ``"plan"``: the mask only
#: restricts the transport plan, normalizations over queries run over every query.
Causal = Literal["prefix", "plan"]
CAUSAL_OPTIONS: tuple[str, ...] = ("prefix", "plan")

_HALF = (torch.float16, torch.bfloat16)


def resolve_causal(causal: object, is_causal: bool) -> bool:
    """Whether the prefix variant runs: ``causal`` if given, else ``is_causal`` (no leak by default).

    Raises:
        ValueError: ``causal`` is not ``None``, ``"prefix"`` or ``"plan"``.
    """
    if causal is None:
        return bool(is_causal)
    if not isinstance(causal, str) or causal not in CAUSAL_OPTIONS:
        raise ValueError(f"causal must be None, 'prefix' (autoregressive) or 'plan' (mask restricts the "
                         f"plan only; leaks later queries), got {causal!r}")
    return causal == "prefix"


def _scores(q: Tensor, k: Tensor, attn_mask: Tensor | None, scale: float, is_causal: bool) -> Tensor:
    """``s = scale q kᵀ + mask`` in the compute dtype (float32 for half precision), ``-inf`` = dropped."""
    nq, nk, _ = check_attention_inputs(q, k)
    compute = torch.float32 if q.dtype in _HALF else q.dtype
    s = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * scale
    batch = tuple(s.shape[:-2])
    m = additive_mask(attn_mask, (*batch, nq, nk), compute)
    if m is not None:
        s = s + m
    if is_causal:
        s = s + causal_additive_mask(nq, nk, compute, q.device)
    return s


def _cumulative_lse(s: Tensor) -> Tensor:
    """``c[i, j] = log Σ_{i' ≤ i} e^{s[i', j]}`` along the query dim (-2), with finite gradients.

    ``torch.logcumsumexp`` gives NaN gradients where a prefix is all ``-inf``; dropped entries
    are replaced by a finite floor whose exponential vanishes next to any admissible score
    (the sum is then exact), and where a column has no admissible query yet the result is
    that floor — only read at dropped pairs, whose weight is 0 anyway.
    """
    floor = torch.finfo(s.dtype).min / 4
    return torch.logcumsumexp(torch.where(torch.isfinite(s), s, floor), dim=-2)


def _normalize(x: Tensor, dim: int) -> Tensor:
    lse = safe_logsumexp(x, dim=dim, keepdim=True)  # -inf for an empty slice: left as is
    return x - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _chunk_rows(block: Tensor, start: int, iterations: int) -> Tensor:
    """Rows ``start..stop-1`` (``stop`` = the block's query count) of the per-prefix Sinkhorn-K."""
    stop = block.shape[-2]
    rows = torch.arange(start, stop, device=block.device)
    keep = torch.arange(stop, device=block.device) <= rows.unsqueeze(-1)  # (R, stop): i' in row i's prefix
    x = torch.where(keep.unsqueeze(-1), block.unsqueeze(-3), float("-inf"))  # (…, R, stop, Nk)
    for _ in range(iterations):
        x = _normalize(_normalize(x, -2), -1)
    return torch.exp(x[..., torch.arange(stop - start, device=block.device), rows, :])


def _sinkhorn_rows(s: Tensor, iterations: int, first_row: int) -> Tensor:
    """Rows ``first_row..Nq-1`` of the per-prefix Sinkhorn-K weights (see the module docstring).

    With gradient and more than one chunk, each chunk is checkpointed (recomputed in the
    backward): the backward then holds one chunk's ``K`` normalizations at a time instead of all.
    """
    nq, nk = s.shape[-2], s.shape[-1]
    lead = 1
    for n in s.shape[:-2]:
        lead *= n
    chunk = max(1, THRESHOLDS.dn_prefix_chunk_elements // max(1, lead * nq * nk))
    # one chunk holds at most K · dn_prefix_chunk_elements saved entries: recompute only with several
    recompute = (nq - first_row > chunk and s.requires_grad and torch.is_grad_enabled()
                 and not under_transform())
    out = []
    for start in range(first_row, nq, chunk):
        block = s[..., : min(nq, start + chunk), :]
        if recompute:
            rows = checkpoint(_chunk_rows, block, start, iterations, use_reentrant=False)
        else:
            rows = _chunk_rows(block, start, iterations)
        out.append(rows)
    if not out:
        return s[..., first_row:, :] * 0
    return torch.cat(out, dim=-2)


def prefix_weights(
    q: Tensor, k: Tensor, *, iterations: int, attn_mask: Tensor | None, scale: float, is_causal: bool,
    weight: Tensor | None = None, first_row: int = 0,
) -> Tensor:
    """Rows ``first_row..Nq-1`` of the prefix weights, in the compute dtype (inputs validated).

    ``weight`` (shaped to broadcast against ``(…, H, Nq, Nk)``) mixes HNAS; ``None`` gives the
    doubly-normalized (K ≥ 1) weights. ``first_row`` serves a decoder with cached past queries:
    ``q`` holds past and new queries, only the new rows are computed (Sinkhorn-K: only their
    prefix problems).
    """
    s = _scores(q, k, attn_mask, scale, is_causal)
    if iterations == 0:  # LNAS: no normalization over queries, nothing to restrict
        dn = safe_softmax(s[..., first_row:, :], dim=-1)
    elif iterations == 1:
        c = _cumulative_lse(s)
        dn = safe_softmax(s[..., first_row:, :] - c[..., first_row:, :], dim=-1)
    else:
        dn = _sinkhorn_rows(s, iterations, first_row)
    if weight is None:
        return dn
    ln = safe_softmax(s[..., first_row:, :], dim=-1)
    return torch.lerp(ln, dn, weight.to(dn.dtype))


def prefix_attention(
    q: Tensor, k: Tensor, v: Tensor, *, iterations: int, attn_mask: Tensor | None, scale: float,
    is_causal: bool, weight: Tensor | None = None, first_row: int = 0,
) -> Tensor:
    """``prefix_weights(...) @ v`` in ``q``'s dtype: ``(…, Nq − first_row, dv)``."""
    w = prefix_weights(q, k, iterations=iterations, attn_mask=attn_mask, scale=scale, is_causal=is_causal,
                       weight=weight, first_row=first_row)
    return torch.matmul(w, v.to(w.dtype)).to(q.dtype)

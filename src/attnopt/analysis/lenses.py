r"""Per-head statistics of attention weights: the lenses the papers look through.

* **Column mass** (doubly-normalized-attention Fig. 1, Lemma 1): ``m_j = Σ_i π_ij`` over the
  covered queries; keys with ``m_j < 1/N_k`` are "explained away" (DNAS never has any).
* **Similarity vs magnitude** (implicit-kernel-attention Prop. 1): the score splits as
  ``s·qᵀk = −s‖q−k‖²/2 + s‖q‖²/2 + s‖k‖²/2``; the query term cancels in the row
  normalization, so within a row the logits vary through the RBF similarity and the key
  magnitude. ``magnitude_share`` = mean over rows of ``Var_j(s‖k_j‖²/2) / (Var_j(sim) +
  Var_j(mag))`` — 0: attention is pure similarity, 1: pure key norm.
* **Entropy** ``H_i = −Σ_j π_ij log π_ij`` and **effective support** ``exp(H_i)`` (the
  perplexity: how many keys a query effectively attends to).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnopt.analysis.column_mass import column_mass
from attnopt.analysis.decompose import decompose

__all__ = ["HeadLenses", "attention_entropy", "effective_support", "similarity_magnitude", "head_lenses"]


def attention_entropy(weights: Tensor) -> Tensor:
    r"""Row entropy :math:`-\sum_j \pi_{ij}\log\pi_{ij}` (nats) of (..., Nq, Nk) weights; (..., Nq).

    Zero weights contribute 0 (``0 log 0 = 0``); an all-zero row has entropy 0.
    """
    w = weights.float() if weights.dtype in (torch.float16, torch.bfloat16) else weights
    logw = torch.where(w > 0, w.clamp_min(torch.finfo(w.dtype).tiny).log(), torch.zeros_like(w))
    return -(w * logw).sum(-1)


def effective_support(weights: Tensor) -> Tensor:
    """``exp(entropy)``: the number of keys a query effectively attends to; (..., Nq)."""
    return attention_entropy(weights).exp()


def similarity_magnitude(q: Tensor, k: Tensor, *, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """``(log similarity (..., Nq, Nk), log key magnitude (..., 1, Nk))`` of Prop. 1.

    The query magnitude is dropped: it is constant along a row and cancels in softmax.
    """
    log_sim, _ = decompose(q, k, scale=scale, log=True)
    s = scale if scale is not None else q.shape[-1] ** -0.5
    kk = k.to(log_sim.dtype)
    log_mag_key = 0.5 * s * kk.pow(2).sum(-1).unsqueeze(-2)
    return log_sim, log_mag_key


@dataclass(frozen=True)
class HeadLenses:
    """Per-head statistics over a batch (every field is a (H,) tensor).

    Attributes:
        column_mass_min, column_mass_mean: min / mean over (sentence, admissible key) of
            the column mass ``Σ_i π_ij`` summed over covered queries (raw sums, as in Fig. 1).
        explained_away: fraction of admissible keys whose column mass is below ``1/N_k``
            (``N_k`` = admissible keys of the sentence), the DNAS floor of Lemma 1.
        entropy: mean row entropy (nats).
        effective_support: mean ``exp(entropy)``.
        magnitude_share: mean share of the within-row logit variance due to the key norm.
        similarity_std, magnitude_std: mean within-row standard deviations of the two terms.
    """

    column_mass_min: Tensor
    column_mass_mean: Tensor
    explained_away: Tensor
    entropy: Tensor
    effective_support: Tensor
    magnitude_share: Tensor
    similarity_std: Tensor
    magnitude_std: Tensor


def _masked_var(x: Tensor, keep: Tensor) -> Tensor:
    n = keep.sum(-1).clamp_min(1)
    mean = torch.where(keep, x, torch.zeros_like(x)).sum(-1) / n
    dev = torch.where(keep, x - mean.unsqueeze(-1), torch.zeros_like(x))
    return dev.pow(2).sum(-1) / n


def head_lenses(
    weights: Tensor,
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    query_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
) -> HeadLenses:
    """Column mass, entropy, effective support and similarity/magnitude statistics per head.

    Args:
        weights: (B, H, Nq, Nk) attention weights.
        q, k: (B, H, Nq, d'), (B, H, Nk, d') the projected queries and keys.
        scale: the model's score scale.
        query_mask: (B, Nq) True for queries to include (default all).
        key_mask: (B, Nk) True for admissible keys (default: keys that receive weight
            in some covered row).
    Returns:
        :class:`HeadLenses`.
    Raises:
        ValueError: shapes that do not match.
    """
    bsz, heads, nq, nk = weights.shape
    if q.shape[:3] != (bsz, heads, nq) or k.shape[:3] != (bsz, heads, nk):
        raise ValueError(
            f"q {tuple(q.shape)} / k {tuple(k.shape)} do not match weights {tuple(weights.shape)}"
        )
    w = weights.float() if weights.dtype in (torch.float16, torch.bfloat16) else weights
    qm = torch.ones(bsz, nq, dtype=torch.bool, device=w.device) if query_mask is None else query_mask.bool()
    w = w * qm[:, None, :, None].to(w.dtype)
    km = (w > 0).any(2).any(1) if key_mask is None else key_mask.bool()      # (B, Nk)
    rows = qm[:, None, :].expand(bsz, heads, nq)                              # (B, H, Nq)
    n_rows = rows.sum((0, 2)).clamp_min(1).to(w.dtype)

    mass = column_mass(w)                                                     # (B, H, Nk)
    keys = km[:, None, :].expand_as(mass)
    inf = torch.tensor(float("inf"), dtype=w.dtype, device=w.device)
    mass_min = torch.where(keys, mass, inf).amin((0, 2))
    n_keys = keys.sum((0, 2)).clamp_min(1).to(w.dtype)
    mass_mean = torch.where(keys, mass, torch.zeros_like(mass)).sum((0, 2)) / n_keys
    nk_valid = km.sum(-1).clamp_min(1).to(w.dtype)[:, None, None]            # (B, 1, 1)
    below = keys & (mass < 1.0 / nk_valid)
    explained = below.sum((0, 2)).to(w.dtype) / n_keys

    ent = attention_entropy(w)
    entropy = torch.where(rows, ent, torch.zeros_like(ent)).sum((0, 2)) / n_rows
    support = torch.where(rows, ent.exp(), torch.zeros_like(ent)).sum((0, 2)) / n_rows

    log_sim, log_mag = similarity_magnitude(q, k, scale=scale)
    keep = km[:, None, None, :].expand_as(log_sim)
    var_sim = _masked_var(log_sim, keep)
    var_mag = _masked_var(log_mag.expand_as(log_sim), keep)
    share = var_mag / (var_sim + var_mag).clamp_min(torch.finfo(var_sim.dtype).tiny)

    def row_mean(x: Tensor) -> Tensor:
        return torch.where(rows, x.to(w.dtype), torch.zeros_like(w[..., 0])).sum((0, 2)) / n_rows

    return HeadLenses(
        column_mass_min=mass_min,
        column_mass_mean=mass_mean,
        explained_away=explained,
        entropy=entropy,
        effective_support=support,
        magnitude_share=row_mean(share),
        similarity_std=row_mean(var_sim.sqrt()),
        magnitude_std=row_mean(var_mag.sqrt()),
    )

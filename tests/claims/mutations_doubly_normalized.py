"""Negative controls for doubly-normalized-attention's claims (see ``tests/claims/_mutation.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.claims._mutation import Mutation


def _dnas_wrong_order(q, k, *, iterations=1, attn_mask=None, scale=None):  # noqa: ANN001, ANN202
    """Rows first, then columns: column masses are fine (≥ 1/Nk) but rows no longer sum to one."""
    from attnopt.functional.doubly_normalized import doubly_normalized_weights

    if iterations != 1:
        return doubly_normalized_weights(q, k, iterations=iterations, attn_mask=attn_mask, scale=scale)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    row = torch.softmax(s, dim=-1)
    return (row / row.sum(-2, keepdim=True).clamp_min(1e-300)).nan_to_num()


def _column_softmax_only(q, k, *, iterations=1, attn_mask=None, scale=None):  # noqa: ANN001, ANN202
    """Normalize over queries only (ξ of eq. 6, not renormalized over keys)."""
    from attnopt.functional.doubly_normalized import doubly_normalized_weights

    if iterations != 1:
        return doubly_normalized_weights(q, k, iterations=iterations, attn_mask=attn_mask, scale=scale)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(s, dim=-2).nan_to_num()


def _lemma1_wrong_order(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims import doubly_normalized

    mp.setattr(doubly_normalized, "doubly_normalized_weights", _dnas_wrong_order)


def _lemma1_column_only(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims import doubly_normalized

    mp.setattr(doubly_normalized, "doubly_normalized_weights", _column_softmax_only)


def _dnas_one_step_too_many(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims import doubly_normalized
    from attnopt.functional.doubly_normalized import doubly_normalized_attention

    def wrong(q, k, v, *, iterations=1, **kw):  # noqa: ANN001, ANN202
        return doubly_normalized_attention(q, k, v, iterations=2 if iterations == 1 else iterations, **kw)

    mp.setattr(doubly_normalized, "doubly_normalized_attention", wrong)


def _sinkhorn_off_by_one(mp: pytest.MonkeyPatch) -> None:
    from attnopt.claims import doubly_normalized
    from attnopt.functional.doubly_normalized import doubly_normalized_weights

    mp.setattr(
        doubly_normalized,
        "doubly_normalized_weights",
        lambda q, k, *, iterations=1, **kw: doubly_normalized_weights(q, k, iterations=iterations + 1, **kw),
    )


def _closed_forms_swapped(mp: pytest.MonkeyPatch) -> None:
    from attnopt.analysis import mode_collapse_distance
    from attnopt.claims import doubly_normalized

    swap = {"lnas": "dnas", "dnas": "lnas"}
    mp.setattr(
        doubly_normalized,
        "mode_collapse_distance",
        lambda r, a, scheme: mode_collapse_distance(r, a, swap[scheme]),
    )


def _dnas_iterates_as_lnas(mp: pytest.MonkeyPatch) -> None:
    from attnopt.analysis import iterate_attention
    from attnopt.claims import doubly_normalized

    mp.setattr(
        doubly_normalized,
        "iterate_attention",
        lambda x, scheme, steps, **kw: iterate_attention(x, "lnas", steps, **kw),
    )


MUTATIONS = [
    Mutation("doubly_normalized:eq4_eq8", "DNAS runs two Sinkhorn steps", _dnas_one_step_too_many),
    Mutation("doubly_normalized:eq10_sinkhorn", "Sinkhorn iteration count off by one", _sinkhorn_off_by_one),
    Mutation("doubly_normalized:lemma1", "DNAS normalizes rows first, then columns", _lemma1_wrong_order),
    Mutation("doubly_normalized:lemma1", "DNAS = column softmax only", _lemma1_column_only),
    Mutation("doubly_normalized:eq11_12_fig2", "closed forms (11) and (12) swapped", _closed_forms_swapped),
    Mutation("doubly_normalized:fig5_6", "DNAS iterations run LNAS", _dnas_iterates_as_lnas),
]

"""Negative controls for ``fenchel_dual:ot_reduction`` (the limits of eq. (22) in γ)."""
from __future__ import annotations

import pytest
import torch

from attnopt.claims.fenchel_dual import ot as ot_claims
from attnopt.functional.ot import ot_attention
from tests.claims._mutation import Mutation


def _drop_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eq. (22) without the transport cost M: the γ → 0 limit is then a plain argmax, not OT's."""

    def wrong(*args, cost, **kwargs):  # type: ignore[no-untyped-def]
        return ot_attention(*args, cost=torch.zeros_like(cost), **kwargs)

    monkeypatch.setattr(ot_claims, "ot_attention", wrong)


def _temperature_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """γ applied twice (scores divided by γ²): neither limit is the one measured."""

    def wrong(*args, gamma, **kwargs):  # type: ignore[no-untyped-def]
        return ot_attention(*args, gamma=gamma * gamma, **kwargs)

    monkeypatch.setattr(ot_claims, "ot_attention", wrong)


MUTATIONS = [
    Mutation(claim="fenchel_dual:ot_reduction", what="eq. (22) without the cost M", patch=_drop_cost),
    Mutation(claim="fenchel_dual:ot_reduction", what="gamma applied twice", patch=_temperature_twice),
]

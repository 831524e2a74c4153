"""Negative controls: a deliberately wrong implementation must move a claim's verdict.

Each ``tests/claims/mutations_*.py`` module lists ``MUTATIONS``; the generic test applies
each mutation with pytest's ``monkeypatch``, runs its claim in quick mode and asserts the
verdict is one of ``expect`` — a claim whose verdict no mutation can move checks nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

__all__ = ["Mutation"]


@dataclass(frozen=True)
class Mutation:
    """One deliberately wrong variant of what a claim checks.

    Attributes:
        claim: the claim id, ``"paper:key"``.
        what: what is wrong, in a few words (shown in the test id).
        patch: applies the mutation through ``monkeypatch`` (undone after the test).
        expect: the verdicts the mutated claim may give.
    """

    claim: str
    what: str
    patch: Callable[[pytest.MonkeyPatch], None]
    expect: tuple[str, ...] = ("not reproduced", "partially reproduced")

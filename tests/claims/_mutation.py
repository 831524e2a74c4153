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
        slow: the control trains long enough to be kept out of the default run (``pytest -m
            slow``); every claim keeps at least one control that is not slow, where one is cheap.
    """

    claim: str
    what: str
    patch: Callable[[pytest.MonkeyPatch], None]
    expect: tuple[str, ...] = ("not reproduced", "partially reproduced")
    slow: bool = False


def gateless(mp: pytest.MonkeyPatch) -> None:
    """Switch off the trained claims' sanity gates (and skip computing their baselines).

    A negative control trains a few seconds: no model beats a scikit-learn baseline then, so
    with the gate on every control would read "inconclusive" whatever it broke. The gate has
    its own tests (``test_sanity_baselines.py``, ``test_verdict_rule.py``); the controls test
    that the claim's *effect* measurement sees the broken implementation.
    """
    import math

    from attnopt.claims import _sanity, doubly_normalized_training
    from attnopt.claims.fenchel_dual import ot_vit
    from attnopt.claims.implicit_kernel import training

    mp.setattr(_sanity, "baseline", lambda *a, **k: math.nan)  # noqa: ARG005
    for mod in (doubly_normalized_training, training):
        mp.setattr(mod, "gate_of", lambda *a, **k: None)  # noqa: ARG005
    mp.setattr(ot_vit, "_gate", lambda *a, **k: None)  # noqa: ARG005

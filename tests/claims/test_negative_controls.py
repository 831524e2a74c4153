"""Negative controls: a deliberately wrong implementation must move every claim's verdict.

The mutations live in ``tests/claims/mutations_*.py`` (each module exposes ``MUTATIONS``, a
list of :class:`tests.claims._mutation.Mutation`); this one generic test applies each with
``monkeypatch``, runs its claim in quick mode through the real runner and asserts the verdict
is one of ``expect``. A second test asserts that every registered claim has at least one
mutation: a claim whose verdict nothing can move checks nothing. The default run keeps one
control per claim; a claim's further controls, and the costly ones (OT-ViT Tables 1-2,
doubly-normalized Tables 1-3: 11-23 s of CPU each), run with
``pytest -m slow tests/claims/test_negative_controls.py``.

The unmutated verdict of each claim (the baseline the mutation moves away from) is asserted by
the per-paper claim tests (``test_*_claims.py``, ``test_ot_claims.py``, …); the few that had no
such check get it in :func:`test_unmutated_baseline` below.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from attnopt.claims import ClaimContext, all_claims
from attnopt.claims._runner import run_claims
from tests.claims._mutation import Mutation

#: Claims whose control comes from another branch's mutation module; an entry here is only
#: honoured while no mutation for the claim is collected (delete it once that module is merged).
PENDING: dict[str, str] = {}


def _collect() -> list[Mutation]:
    found: list[Mutation] = []
    for path in sorted(Path(__file__).parent.glob("mutations_*.py")):
        module = importlib.import_module(f"tests.claims.{path.stem}")
        table = getattr(module, "MUTATIONS", None)
        assert isinstance(table, list) and table, f"{path.name} must define a non-empty MUTATIONS list"
        for m in table:
            assert isinstance(m, Mutation), f"{path.name}: {m!r} is not a Mutation"
            found.append(m)
    return found


MUTATIONS = _collect()


#: The default run keeps one control per claim (the first one a mutation module lists that is not
#: costly); a claim's further controls run with ``-m slow`` (the default ``pytest -q`` stays within
#: its ~5-minute budget; each claim's verdict is still shown to move).
_FIRST: dict[str, Mutation] = {}
for _m in MUTATIONS:
    if not _m.slow:
        _FIRST.setdefault(_m.claim, _m)


def _param(m: Mutation):  # noqa: ANN202
    slow = m.slow or _FIRST.get(m.claim) is not m
    return pytest.param(m, id=f"{m.claim}[{m.what}]", marks=(pytest.mark.slow,) if slow else ())


@pytest.fixture
def cheap_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build figures as usual but do not encode PNGs: the verdict is what is under test."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def close(self: ClaimContext, fig, name: str) -> Path:  # noqa: ANN001
        plt.close(fig)
        return self.out_dir / f"{name}.png"

    monkeypatch.setattr(ClaimContext, "save_figure", close)


def _run(claim_id: str, out: Path):  # noqa: ANN202
    [run] = run_claims(quick=True, out_dir=out, only=claim_id)
    if run.verdict == "skipped":
        pytest.skip(run.skip_reason or "optional extra missing")
    assert run.error is None, run.error
    assert run.result is not None
    return run.result


@pytest.mark.parametrize("mutation", [_param(m) for m in MUTATIONS])
def test_mutation_moves_the_verdict(mutation: Mutation, monkeypatch, tmp_path, cheap_figures):
    assert "reproduced" not in mutation.expect, "a negative control must expect the claim to fail"
    mutation.patch(monkeypatch)
    res = _run(mutation.claim, tmp_path)
    assert res.verdict in mutation.expect, (
        f"{mutation.claim} stays {res.verdict!r} under the mutation '{mutation.what}': {res.summary}"
    )


def test_every_claim_has_a_negative_control():
    covered = {m.claim for m in MUTATIONS}
    registered = {c.id for c in all_claims()}
    unknown = covered - registered
    assert not unknown, f"mutations name unregistered claims: {sorted(unknown)}"
    missing = sorted(registered - covered - set(PENDING))
    assert not missing, (
        f"claims without a negative control (add one to tests/claims/mutations_*.py): {missing}"
    )


#: Unmutated verdicts not asserted by a per-paper claim test (the baseline each control departs from).
BASELINES = {
    "doubly_normalized:eq10_sinkhorn": "reproduced",
    "doubly_normalized:lemma1": "reproduced",
    "doubly_normalized:fig5_6": "reproduced",
    "one_sided_eot:thm52_thm73_cor75": "reproduced",  # per-paper test is slow-marked; quick mode is ~1 s
    "one_sided_eot:thm63_eq149": "reproduced",
    "one_sided_eot:thm73_pinv": "reproduced",
}


@pytest.mark.parametrize("claim_id", sorted(BASELINES))
def test_unmutated_baseline(claim_id: str, tmp_path, cheap_figures):
    res = _run(claim_id, tmp_path)
    assert res.verdict == BASELINES[claim_id], res.summary
    assert all(BASELINES[claim_id] not in m.expect for m in MUTATIONS if m.claim == claim_id)

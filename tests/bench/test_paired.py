"""``attnopt bench --against PATH``: paired A/B timing of two source trees (:mod:`attnopt.bench.paired`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import attnopt
from attnopt.bench.paired import paired_rows, run_paired
from attnopt.cli import main

THIS_TREE = Path(attnopt.__file__).resolve().parent.parent.parent


def test_paired_rows_are_medians_of_per_round_ratios() -> None:
    this = {"a": [2.0, 3.0, 1.0, 4.0, 2.0], "b": [1.0, 1.0, 1.0, 1.0, 1.0]}
    other = {"a": [1.0, 1.0, 1.0, 2.0, 1.0], "b": [2.0, 2.0, 2.0, 2.0, 2.0]}
    rows = {r.row: r for r in paired_rows("small_n", "N=64 fwd", this, other)}
    assert rows["a"].ratio == 2.0  # ratios 2, 3, 1, 2, 2 (not min 1.0 / min 1.0)
    assert rows["a"].this_ms == 1000.0 and rows["a"].other_ms == 1000.0
    assert rows["b"].ratio == 0.5 and rows["b"].ratio_low == rows["b"].ratio_high == 0.5
    assert rows["a"].rounds == 5


def test_bad_arguments_name_themselves(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no attnopt source tree"):
        run_paired(tmp_path)
    with pytest.raises(ValueError, match="paired suites"):
        run_paired(THIS_TREE, suites=("ot",))
    with pytest.raises(ValueError, match="rounds"):
        run_paired(THIS_TREE, rounds=0)
    assert main(["bench", "--against", str(tmp_path)]) == 2


@pytest.mark.slow
def test_against_this_tree_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both workers import the same code: every row is timed in both, and the file has them all
    (the ratios of identical code are ~1, but a loaded test machine makes no tight claim)."""
    out = tmp_path / "pair.json"
    code = main(["bench", "--against", str(THIS_TREE), "--only", "small_n", "--sizes", "16", "--rounds", "3",
                 "--rows", "dnas K=1", "--out", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"], r["row"]) for r in rows} == {
        (c, r) for c in ("N=16 fwd", "N=16 fwd+bwd") for r in ("sdpa", "dnas K=1")}
    assert all(r["rounds"] == 3 and r["ratio"] > 0 for r in rows)
    assert "dnas K=1" in capsys.readouterr().out

"""The trained claims' run plans at quick and standard scale (planned, nothing trained).

Pins what the issue asks of the plans: every scale plans runs for every trained claim; Table 2
keeps all nine arms at standard; every translation arm runs at p = 2 at every scale (no p
chosen on data); Fig. 1 has its own LNAS/DNAS runs at the LR where LNAS explains keys away;
standard trains longer and with at least as many seeds as quick.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from attnopt.claims import ClaimContext
from attnopt.claims._training_common import planned_configs

pytest.importorskip("lightning")


def _ctx(scale: str, tmp: Path) -> ClaimContext:
    return ClaimContext(quick=scale == "quick", out_dir=tmp, seed=0, prefix="t", scale=scale)


def _plans() -> list[tuple[str, object, str]]:
    from attnopt.claims import doubly_normalized_training as dn
    from attnopt.claims.fenchel_dual import ot_vit
    from attnopt.claims.implicit_kernel import training as ika

    out = [(t, ika._run_args, "ika") for t in ika.QUICK]
    out += [(t, dn._run_args, "dn") for t in dn.QUICK]
    out.append(("ot-vit", ot_vit._run_args, "ot"))
    return out


@pytest.mark.parametrize("scale", ["quick", "standard", "full"])
def test_every_run_set_plans_runs(scale: str, tmp_path: Path):
    for task, run_args, _ in _plans():
        configs = planned_configs(_ctx(scale, tmp_path), task, run_args)
        assert configs, f"{task} plans no runs at {scale}"


def _epoch_runs(configs: list[dict]) -> tuple[int, int]:
    seeds = {(c["seed"], c.get("fold", 0)) for c in configs}
    return sum(int(c["epochs"]) for c in configs), len(seeds)


def test_standard_trains_longer_with_at_least_as_many_seeds(tmp_path: Path):
    for task, run_args, _ in _plans():
        q = _epoch_runs(planned_configs(_ctx("quick", tmp_path), task, run_args))
        s = _epoch_runs(planned_configs(_ctx("standard", tmp_path), task, run_args))
        assert s[0] > q[0] and s[1] >= q[1], (task, q, s)


def test_table2_keeps_nine_arms_at_standard_and_translation_is_p2_everywhere(tmp_path: Path):
    from attnopt.claims.implicit_kernel import training as ika

    std = planned_configs(_ctx("standard", tmp_path), "sentence-classification", ika._run_args)
    assert len({c["arm"] for c in std}) == 9
    for scale in ("quick", "standard", "full"):
        for c in planned_configs(_ctx(scale, tmp_path), "translation", ika._run_args):
            assert float(c["sizes"]["p"]) == 2.0, (scale, c["arm"], c["sizes"])


def test_fig1_has_its_own_lnas_dnas_runs_at_its_lr(tmp_path: Path):
    from attnopt.claims import doubly_normalized_training as dn

    for scale in ("quick", "standard", "full"):
        configs = planned_configs(_ctx(scale, tmp_path), dn._FIG1, dn._run_args)
        assert {c["arm"] for c in configs} == {"lnas", "dnas"}
        assert {c["lr"] for c in configs} == {dn.FIG1_LR}
        assert all(c["task"] == "multiview-fusion" for c in configs)
        assert all("multiview-fusion-fig1" in str(c["out_dir"]) for c in configs)

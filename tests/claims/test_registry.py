"""The claims registry, runner and report: registration, filtering, errors reported, files written."""
import pytest
import torch

from attnopt.claims import ClaimContext, ClaimResult, _registry, all_claims, claim, verdict
from attnopt.claims._runner import run_claims, write_claims_report


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(_registry, "_REGISTRY", {})
    monkeypatch.setattr(_registry, "_import_claim_modules", lambda: None)


def test_verdict_helper():
    assert verdict(True) == "reproduced"
    assert verdict(False) == "not reproduced"
    assert verdict(False, partial=True) == "partially reproduced"
    with pytest.raises(ValueError, match="verdict"):
        ClaimResult(verdict="maybe", summary="x")


def test_run_and_report(scratch_registry, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    @claim(paper="toy", key="ok", title="a measured identity", reference="eq. (1)")
    def ok(ctx: ClaimContext) -> ClaimResult:
        x = float(torch.ones((), dtype=torch.float64).add(1.0))
        fig, ax = plt.subplots()
        ax.plot([0, 1], [0, x])
        ctx.save_figure(fig, "line")
        return ClaimResult(verdict=verdict(x == 2.0), summary="2 == 2", figures={"x": x})

    @claim(paper="toy", key="boom", title="a broken claim", reference="eq. (2)")
    def boom(ctx: ClaimContext) -> ClaimResult:
        raise RuntimeError("claim crashed")

    @claim(paper="other", key="x", title="other paper", reference="Thm 1")
    def other(ctx: ClaimContext) -> ClaimResult:
        return ClaimResult(verdict="not reproduced", summary="measured 3, expected 4", figures={"m": 3})

    assert [c.id for c in all_claims("toy")] == ["toy:ok", "toy:boom"]
    assert [c.id for c in all_claims("other:x")] == ["other:x"]
    with pytest.raises(ValueError, match="matches no claim"):
        all_claims("nope")
    runs = run_claims(quick=True, out_dir=tmp_path)
    assert [r.verdict for r in runs] == ["reproduced", "error", "not reproduced"]
    assert "claim crashed" in runs[1].error
    md, html = write_claims_report(runs, tmp_path, quick=True)
    text = md.read_text()
    assert "a measured identity" in text and "claim crashed" in text and "measured 3, expected 4" in text
    summary_rows = [line for line in text.splitlines() if line.startswith(("| toy", "| other"))]
    assert summary_rows and all(line.rstrip(" |").endswith(("ms", " s")) for line in summary_rows)
    assert "e-0" not in " ".join(line.rsplit("|", 2)[-2] for line in summary_rows)
    assert "| time |" in text and " ms |" in html.read_text().replace("</td>", " |")
    assert (tmp_path / "figures" / "toy_ok_line.png").exists()
    assert "figures/toy_ok_line.png" in html.read_text()


def test_every_registered_claim_has_metadata():
    claims = all_claims()
    assert claims, "no claims registered"
    ids = [c.id for c in claims]
    assert len(ids) == len(set(ids))
    for c in claims:
        assert c.title and c.reference and c.func.__doc__


def test_attach_figures_links_existing_files_in_sorted_order(tmp_path):
    from attnopt.claims import ClaimContext

    folder = tmp_path / "train" / "task" / "figures"
    folder.mkdir(parents=True)
    for name in ("b_fig.png", "a_fig.png", "notes.txt"):
        (folder / name).write_text("x")
    ctx = ClaimContext(quick=True, out_dir=tmp_path)
    found = ctx.attach_figures(folder, "*_fig.png", "missing.png")
    assert found == [folder / "a_fig.png", folder / "b_fig.png"] and ctx.images == found

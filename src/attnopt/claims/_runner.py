"""Run registered claims and write the reproduction report (``attnopt reproduce``)."""
from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from attnopt._extras import MissingExtraError, as_missing_extra, install_command, missing_modules
from attnopt.claims._registry import Claim, ClaimContext, ClaimResult, Verdict, all_claims
from attnopt.report import Section, format_duration, format_value, write_report

#: The one command that installs everything ``attnopt reproduce`` needs.
REPRODUCE_INSTALL = install_command("reproduce")

__all__ = ["ClaimRun", "RunVerdict", "run_claims", "write_claims_report"]

#: a claim run's outcome: the claim's verdict, or why there is none
RunVerdict = Verdict | Literal["skipped", "error"]


@dataclass
class ClaimRun:
    """One executed claim: its result, the error it raised, or why it was skipped; wall time.

    A claim whose optional packages are missing is ``skipped`` (``skip_reason`` holds the
    missing packages and the install command), never an error.
    """

    claim: Claim
    result: ClaimResult | None
    error: str | None
    seconds: float
    images: list[Path]
    skip_reason: str | None = None

    @property
    def verdict(self) -> RunVerdict:
        if self.skip_reason is not None:
            return "skipped"
        return self.result.verdict if self.result is not None else "error"


def missing_requirements(c: Claim) -> MissingExtraError | None:
    """The first extra of ``c.requires`` with a module that cannot be imported here, or ``None``."""
    for extra in c.requires:
        missing = missing_modules(extra)
        if missing:
            return MissingExtraError(extra, missing, f"claim {c.id}", install=REPRODUCE_INSTALL)
    return None


def run_claims(
    *,
    quick: bool,
    out_dir: Path,
    only: str | None = None,
    seed: int = 0,
    on_done: Callable[[ClaimRun], None] | None = None,
    scale: str | None = None,
    resume: bool = False,
) -> list[ClaimRun]:
    """Run every selected claim; a claim that raises is recorded as ``error``, not hidden.

    ``scale`` (``quick``/``standard``/``full``) overrides ``quick`` when given.
    """
    runs: list[ClaimRun] = []
    for c in all_claims(only):
        ctx = ClaimContext(quick=quick, out_dir=out_dir, seed=seed, prefix=f"{c.paper}_{c.key}", scale=scale,
                           resume=resume)
        t0 = time.perf_counter()
        result: ClaimResult | None = None
        error: str | None = None
        missing = missing_requirements(c)
        skip = str(missing) if missing is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=UserWarning)
            try:
                if skip is None:
                    result = c.func(ctx)
                    if not isinstance(result, ClaimResult):
                        raise TypeError(f"claim {c.id} returned {type(result).__name__}, not ClaimResult")
            except ImportError as exc:  # an optional package the claim did not declare
                converted = as_missing_extra(exc, f"claim {c.id}", install=REPRODUCE_INSTALL)
                if converted is None:
                    error = traceback.format_exc()
                else:
                    skip = str(converted)
            except Exception:  # noqa: BLE001 - a failing claim is reported, never swallowed
                error = traceback.format_exc()
        images = [] if skip is not None else list(ctx.images)
        run = ClaimRun(c, None if skip else result, error, time.perf_counter() - t0, images, skip)
        runs.append(run)
        if on_done is not None:
            on_done(run)
    return runs


def figures_text(run: ClaimRun, limit: int = 4) -> str:
    """The first ``limit`` measured figures as ``name=value`` text."""
    if run.skip_reason is not None:
        return "(skipped: " + run.skip_reason.split(": ", 1)[0].removeprefix(f"claim {run.claim.id} ") + ")"
    if run.result is None:
        return "(raised an error)"
    items = list(run.result.figures.items())[:limit]
    return ", ".join(f"{k}={format_value(v)}" for k, v in items)


def write_claims_report(
    runs: list[ClaimRun],
    out_dir: Path,
    *,
    quick: bool,
    scale: str | None = None,
    wall_s: float | None = None,
) -> tuple[Path, Path]:
    """Write ``report.md`` / ``report.html`` (a summary table, then one section per claim) and
    ``report.json`` beside them (:mod:`attnopt.claims._report_json`).

    ``scale`` (default: ``quick`` or ``full`` from ``quick``) names the run's scale.
    """
    from attnopt.claims._report_json import write_report_json

    scale = scale or ("quick" if quick else "full")
    write_report_json(runs, out_dir, scale=scale, wall_s=wall_s)
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    mode = {"quick": "quick (reduced scale)", "standard": "standard (trained to convergence)", "full": "full"}
    intro = (
        f"Mode: {mode[scale]}. "
        + ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
        + ". Every figure below was computed in this run."
    )
    summary = Section(
        "Summary",
        headers=("paper", "claim", "reference", "verdict", "measured", "time"),
        rows=[
            (r.claim.paper, r.claim.title, r.claim.reference, r.verdict, figures_text(r),
             format_duration(r.seconds))
            for r in runs
        ],
    )
    sections = [summary]
    for r in runs:
        if r.skip_reason is not None:
            text = f"Verdict: skipped — {r.skip_reason}"
            sections.append(Section(f"{r.claim.paper} — {r.claim.title}", text=text))
            continue
        if r.result is None:
            text = f"Verdict: error\n\n```\n{r.error}\n```"
            sections.append(Section(f"{r.claim.paper} — {r.claim.title}", text=text))
            continue
        res = r.result
        text = f"Verdict: {res.verdict}\n\n{res.summary}"
        if res.details:
            text += "\n\n" + res.details
        sections.append(
            Section(
                f"{r.claim.paper} — {r.claim.title} ({r.claim.reference})",
                text=text,
                headers=("figure", "value") if res.figures else (),
                rows=[(k, v) for k, v in res.figures.items()],
                images=r.images,
            )
        )
    sections.append(_papers_section({r.claim.paper for r in runs}))
    return write_report(out_dir, "report", "attnopt — reproduction report", sections, intro)


def _papers_section(names: set[str]) -> Section:
    """The papers whose claims ran, by title (the short names above are their claims modules)."""
    from attnopt._papers import PAPERS, citations_section

    known = {p.claims for p in PAPERS}
    headers, rows = citations_section(sorted(n for n in names if n in known))
    text = "The papers whose claims this report checks; the *paper* column above names each by its " \
           "claims module (`fenchel_dual` = `fenchel-dual-attention`, ...)."
    return Section("Papers", text=text, headers=headers, rows=rows)

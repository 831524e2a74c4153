"""Run benchmark suites and print ratios against each group's baseline."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from attnopt._extras import as_missing_extra
from attnopt.bench._harness import BenchContext, Measurement, all_suites
from attnopt.report import markdown_table

__all__ = ["run_bench", "ratio_rows"]

HEADERS = ("suite", "case", "impl", "ms", "time ratio", "peak MB", "mem ratio", "note")


def ratio_rows(measurements: list[Measurement]) -> list[tuple]:
    """Rows of :data:`HEADERS`: ratios are ours / baseline within the same suite and case."""
    base: dict[tuple[str, str], Measurement] = {}
    for m in measurements:
        if m.baseline:
            base[(m.suite, m.case)] = m
    rows = []
    for m in measurements:
        b = base.get((m.suite, m.case))
        t_ratio = m.seconds / b.seconds if b is not None and b.seconds > 0 else float("nan")
        if b is not None and m.peak_mb is not None and b.peak_mb:
            m_ratio: float | str = m.peak_mb / b.peak_mb
        else:
            m_ratio = "-"
        rows.append(
            (
                m.suite,
                m.case,
                m.impl + (" (baseline)" if m.baseline else ""),
                round(m.seconds * 1e3, 2),
                round(t_ratio, 3),
                "-" if m.peak_mb is None else round(m.peak_mb, 1),
                m_ratio if isinstance(m_ratio, str) else round(m_ratio, 3),
                m.note,
            )
        )
    return rows


def run_bench(
    ctx: BenchContext,
    *,
    only: str | None = None,
    out: Path | None = None,
    echo: Callable[[str], None] = print,
) -> list[Measurement]:
    """Run the selected suites, print one table per suite and optionally save Markdown/JSON.

    A suite whose peer (POT, scipy, the ``entmax`` package, ...) is not installed is skipped
    with one line naming the extra to install; the other suites still run.
    """
    results: list[Measurement] = []
    for name, suite in all_suites(only).items():
        echo(f"\n== {name} ==")
        try:
            ms = list(suite(ctx))
        except ImportError as exc:
            missing = as_missing_extra(exc, f"bench suite {name!r}")
            if missing is None:
                raise
            echo(f"skipped: {missing}")
            continue
        results.extend(ms)
        echo(markdown_table(HEADERS, ratio_rows(ms)))
        sys.stdout.flush()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".json":
            out.write_text(json.dumps([m.__dict__ for m in results], indent=1, default=str))
        else:
            out.write_text("# attnopt bench\n\n" + markdown_table(HEADERS, ratio_rows(results)) + "\n")
    return results

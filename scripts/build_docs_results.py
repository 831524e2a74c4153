#!/usr/bin/env python
"""Regenerate the result pages of the documentation from one fresh run.

    python scripts/build_docs_results.py            # reproduce --quick, bench --quick, analyze
    python scripts/build_docs_results.py --skip bench

Runs, with this checkout's sources first on the path,

* ``attnopt reproduce --quick``  -> ``docs/results/report.md`` + ``docs/results/figures/``
* ``attnopt bench --quick``      -> ``docs/results/bench.md``
* ``attnopt analyze`` (bundled MiniLM, small corpus) -> ``docs/results/analysis.md`` +
  ``docs/results/analysis-figures/``

and stamps each page with the attnopt version, git commit, date, command and machine (CPU,
cores, torch, Python, load average), so a reader knows what produced the numbers. The
pages are committed; rerun this script to refresh them. Exits non-zero if a command fails.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
JOBS = ("reproduce", "bench", "analyze")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_stamp(command: str, note: str = "") -> str:
    """A Markdown admonition saying which version, commit and machine produced a page."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    import attnopt

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
        commit += " (+ uncommitted changes in src/)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    lines = [
        '!!! info "Generated page"',
        f"    Produced by `python scripts/build_docs_results.py` running `{command}` on "
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        "",
        f"    * attnopt {attnopt.__version__}, commit `{commit}`; torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"    * machine: {_cpu_name()}, {os.cpu_count()} logical cores, {platform.system()} "
        f"{platform.release()}; load average (1/5/15 min) at the start: {load}",
    ]
    if note:
        lines.append(f"    * {note}")
    return "\n".join(lines) + "\n"


def _run(args: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    print("+", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "attnopt.cli", *args], cwd=ROOT, env=env, check=True)


def _demote_title(md: str, title: str) -> tuple[str, str]:
    """Replace the first ``# `` heading by ``title``, drop the report's own provenance line
    (the page's stamp says more); return (heading line, rest)."""
    lines = md.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    while lines and not lines[0].strip():
        lines = lines[1:]
    if lines and lines[0].startswith("*Generated "):
        lines = lines[1:]
    return f"# {title}\n", "\n".join(lines).lstrip("\n") + "\n"


def shrink_png(path: Path, max_width: int = 1100) -> None:
    """Re-save a figure small for the repository: at most ``max_width`` px, 256-colour palette."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if im.width > max_width:
            im = im.resize((max_width, round(im.height * max_width / im.width)), Image.LANCZOS)
        im.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def _copy_figures(src: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    if src.is_dir():
        shutil.copytree(src, dest)
        for png in dest.glob("*.png"):
            shrink_png(png)


def build_report(note: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = machine_stamp("attnopt reproduce --quick", note)
        _run(["reproduce", "--quick", "--out", tmp])
        md = (Path(tmp) / "report.md").read_text(encoding="utf-8")
        head, body = _demote_title(md, "Reproduction report")
        _copy_figures(Path(tmp) / "figures", RESULTS / "figures")
        # the training claims' figures: train/<task>/figures/*.png, linked as such from the report
        if (RESULTS / "train").exists():
            shutil.rmtree(RESULTS / "train")
        for figs in sorted((Path(tmp) / "train").glob("*/figures")):
            _copy_figures(figs, RESULTS / "train" / figs.parent.name / "figures")
    (RESULTS / "report.md").write_text(head + "\n" + stamp + "\n" + body, encoding="utf-8")


def build_bench(note: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = machine_stamp("attnopt bench --quick", note)
        out = Path(tmp) / "bench.md"
        _run(["bench", "--quick", "--out", str(out)])
        head, body = _demote_title(out.read_text(encoding="utf-8"), "Benchmarks")
    from attnopt._papers import citations_markdown

    papers = ("\n\n## Papers\n\nThe mechanisms benchmarked here come from these papers.\n\n"
              + citations_markdown() + "\n")
    text = head + "\n" + stamp + "\n" + body.rstrip("\n") + papers
    (RESULTS / "bench.md").write_text(text, encoding="utf-8")


def build_analysis(note: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["analyze", "--sentences", "32", "--max-tokens", "24", "--no-progress", "--out", tmp]
        stamp = machine_stamp("attnopt " + " ".join(a for a in cmd if a != tmp).replace(" --out", ""), note)
        _run(cmd)
        md = (Path(tmp) / "analysis.md").read_text(encoding="utf-8")
        md = md.replace("](figures/", "](analysis-figures/")
        head, body = _demote_title(md, "Analysis of the bundled MiniLM")
        _copy_figures(Path(tmp) / "figures", RESULTS / "analysis-figures")
    (RESULTS / "analysis.md").write_text(head + "\n" + stamp + "\n" + body, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip", default="", help="comma-separated jobs to skip: " + ", ".join(JOBS))
    parser.add_argument("--note", default="", help="a line added to the stamp (e.g. 'machine shared')")
    args = parser.parse_args(argv)
    skip = {s for s in re.split(r"[,\s]+", args.skip) if s}
    if skip - set(JOBS):
        parser.error(f"--skip: unknown job(s) {sorted(skip - set(JOBS))}; choose from {JOBS}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for job, fn in (("reproduce", build_report), ("bench", build_bench), ("analyze", build_analysis)):
        if job not in skip:
            fn(args.note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

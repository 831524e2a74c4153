"""A small Markdown + HTML report writer shared by ``attnopt reproduce`` and ``analyze``.

A report is a title, an optional intro and a list of :class:`Section` s; each section has
Markdown text, an optional table and optional images. The same structure is written as
``<name>.md`` and as a self-contained ``<name>.html`` (images linked relatively).
"""
from __future__ import annotations

import datetime as dt
import html
import os
import platform
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Section", "markdown_table", "format_value", "format_duration", "provenance", "write_report"]


def format_value(x: Any) -> str:
    """Compact text for a measured number (4 significant digits), or ``str(x)``."""
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x == 0.0:
            return "0"
        if abs(x) >= 1e4 or abs(x) < 1e-3:
            return f"{x:.3e}"
        return f"{x:.4g}"
    return str(x)


def format_duration(seconds: float) -> str:
    """A wall time for people: ``0.10 ms``, ``12 ms``, ``3.4 s``, ``2 min 05 s``."""
    if not seconds >= 0:
        return str(seconds)
    if seconds < 0.01:
        return f"{seconds * 1e3:.2f} ms"
    if seconds < 1.0:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 60.0:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest:02d} s"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; cells go through :func:`format_value`.

    A ``|`` inside a header or a cell (``max |Δ|``) is escaped as ``\\|``, so it stays text.
    """
    def cell(x: Any) -> str:
        return format_value(x).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Section:
    """One part of a report: a heading, Markdown text, an optional table and images."""

    title: str
    text: str = ""
    headers: Sequence[str] = ()
    rows: Sequence[Sequence[Any]] = ()
    images: Sequence[Path] = field(default_factory=list)
    level: int = 2


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An HTML table; a ``verdict`` column's cells get the verdict's colour class."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    verdict_col = [h.lower() == "verdict" for h in headers]

    def td(x: Any, is_verdict: bool) -> str:
        text = format_value(x)
        cls = _verdict_class(text.strip().lower()) if is_verdict else ""
        return f'<td class="{cls}">' if cls else "<td>"

    body = "".join(
        "<tr>" + "".join(f"{td(x, v)}{html.escape(format_value(x))}</td>" for x, v in zip(row, verdict_col))
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _git_commit() -> str | None:
    """The short commit of the checkout attnopt is imported from (``+ changes`` if dirty), or None."""
    src = Path(__file__).resolve().parent
    try:
        run = [subprocess.run(["git", *a], cwd=src, capture_output=True, text=True, timeout=10)
               for a in (["rev-parse", "--short", "HEAD"], ["status", "--porcelain", "--", "."])]
    except (OSError, subprocess.SubprocessError):
        return None
    if run[0].returncode != 0 or not run[0].stdout.strip():
        return None
    return run[0].stdout.strip() + (" + uncommitted changes" if run[1].stdout.strip() else "")


def provenance() -> str:
    """One line saying when, with which versions and on which machine a report was made."""
    import torch

    from attnopt import __version__

    commit = _git_commit()
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Generated {when} by attnopt {__version__}"
        + (f" (commit {commit})" if commit else "")
        + f" with torch {torch.__version__}, Python {platform.python_version()}, on {_cpu_name()}, "
        f"{os.cpu_count()} logical cores, {platform.system()} {platform.release()}."
    )


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}td,th{border:1px solid #ccc;
padding:3px 8px;text-align:left}th{background:#f3f3f3}pre{background:#f7f7f7;padding:.6em;
overflow-x:auto}img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.reproduced{color:#137333;font-weight:600}.not{color:#b3261e;font-weight:600}
.partially{color:#a36200;font-weight:600}.inconclusive{color:#555;font-weight:600}.provenance{color:#555;font-size:.9em}"""


def _verdict_class(text: str) -> str:
    if text.startswith("reproduced"):
        return "reproduced"
    if text.startswith("partially"):
        return "partially"
    if text.startswith("inconclusive"):
        return "inconclusive"
    if text.startswith("not") or text.startswith("error"):
        return "not"
    return ""


def _markdown_renderer() -> Callable[[str], str] | None:
    """markdown-it-py's CommonMark renderer with tables and raw HTML off, or None if absent."""
    try:
        from markdown_it import MarkdownIt
    except ImportError:  # the `plots` extra is not installed: fall back to escaped text
        return None
    return MarkdownIt("commonmark", {"html": False}).enable("table").render


_VERDICT_PARAGRAPH = re.compile(r"<p>Verdict:\s*([^<]*)")


def _markdown_to_html(text: str) -> str:
    """Render a section's Markdown (emphasis, lists, tables, code) as HTML.

    Raw HTML in the text is escaped, never passed through. A paragraph starting with
    ``Verdict:`` gets the verdict's colour class. Without markdown-it-py (``plots`` extra)
    each paragraph is shown escaped, tables as preformatted text.
    """
    render = _markdown_renderer()
    if render is None:
        parts = []
        for para in text.split("\n\n"):
            tag = "pre" if para.lstrip().startswith("|") else "p"
            parts.append(f"<{tag}>{html.escape(para)}</{tag}>")
        out = "\n".join(parts)
    else:
        out = render(text)

    def add_class(m: re.Match[str]) -> str:
        cls = _verdict_class(html.unescape(m.group(1)).strip().lower())
        return f'<p class="{cls}">Verdict: {m.group(1)}' if cls else m.group(0)

    return _VERDICT_PARAGRAPH.sub(add_class, out)


def write_report(
    out_dir: Path, name: str, title: str, sections: Sequence[Section], intro: str = "",
    *, stamp: bool = True,
) -> tuple[Path, Path]:
    """Write ``out_dir/<name>.md`` and ``out_dir/<name>.html``; return both paths.

    ``stamp``: start with the :func:`provenance` line (date, versions, commit, machine).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    md: list[str] = [f"# {title}", ""]
    body: list[str] = [f"<h1>{html.escape(title)}</h1>"]
    if stamp:
        line = provenance()
        md += [f"*{line}*", ""]
        body.append(f'<p class="provenance">{html.escape(line)}</p>')
    if intro:
        md += [intro, ""]
        body.append(f"<pre>{html.escape(intro)}</pre>" if "\n" in intro else f"<p>{html.escape(intro)}</p>")
    for sec in sections:
        md += ["#" * sec.level + " " + sec.title, ""]
        body.append(f"<h{sec.level}>{html.escape(sec.title)}</h{sec.level}>")
        if sec.text:
            md += [sec.text, ""]
            body.append(_markdown_to_html(sec.text))
        if sec.headers:
            md += [markdown_table(sec.headers, sec.rows), ""]
            body.append(_html_table(sec.headers, sec.rows))
        for img in sec.images:
            rel = os.path.relpath(img, out_dir)
            md += [f"![{Path(rel).stem}]({rel})", ""]
            body.append(f'<img src="{html.escape(rel)}" alt="{html.escape(Path(rel).stem)}">')
    md_path = out_dir / f"{name}.md"
    html_path = out_dir / f"{name}.html"
    md_path.write_text("\n".join(md))
    html_path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>"
        f"{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(body)
        + "</body></html>"
    )
    return md_path, html_path

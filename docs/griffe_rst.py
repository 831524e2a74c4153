"""Griffe extension: render the reStructuredText bits of attnopt's docstrings as Markdown.

The docstrings are Google style with a few Sphinx idioms; in the API pages

* ``.. math:: X`` (with indented continuation lines) becomes a display block ``\\[ X \\]``
  and ``:math:`X``` inline ``\\( X \\)`` — typeset by MathJax through ``pymdownx.arithmatex``;
* ``:func:`x```, ``:class:`x``` (and ``mod``/``meth``/``attr``/``data``) become code ``x``;
* a paragraph ending in ``::`` (an RST literal block) ends in ``:``;
* a simple RST table (``=====  =====`` borders) becomes a Markdown table.

Only the rendered copy changes; the source docstrings are untouched.
"""
from __future__ import annotations

import re

from griffe import Extension

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):`~?([^`]+)`")
_INLINE_MATH = re.compile(r":math:`([^`]+)`")
_DIRECTIVE = re.compile(r"^(\s*)\.\. math::\s*(.*)$")


_BORDER = re.compile(r"^\s*=+(\s+=+)+\s*$")


def _simple_tables(lines: list[str]) -> list[str]:
    """Replace RST simple tables (border, header, border, rows, border) by Markdown tables."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not _BORDER.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        border = lines[i]
        spans = [(m.start(), m.end()) for m in re.finditer(r"=+", border)]
        ends = [a for a, _ in spans[1:]] + [None]
        rows: list[list[str]] = []
        separators = 0
        i += 1
        while i < len(lines) and separators < 2:
            line = lines[i]
            i += 1
            if _BORDER.match(line):
                separators += 1
                if separators == 1:
                    rows.append(["---"] * len(spans))
                continue
            cells = [line[a:e].strip() if e is not None else line[a:].strip()
                     for (a, _), e in zip(spans, ends)]
            if rows and not cells[0] and rows[-1][0] != "---":
                rows[-1] = [(p + " " + c).strip() for p, c in zip(rows[-1], cells)]
            elif any(cells):
                rows.append(cells)
        indent = border[: len(border) - len(border.lstrip())]
        if out and out[-1].strip():
            out.append("")
        out += [indent + "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        out.append("")
    return out


def rst_to_markdown(text: str) -> str:
    """Rewrite the RST idioms of one docstring (see the module docstring)."""
    lines = _simple_tables(text.split("\n"))
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if not m:
            line = lines[i]
            if line.rstrip().endswith("::") and not line.strip().startswith(".."):
                line = line.rstrip()[:-1]
            out.append(line)
            i += 1
            continue
        indent, body = m.group(1), [m.group(2).strip()]
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > len(indent):
            body.append(lines[i].strip())
            i += 1
        if out and out[-1].strip():
            out.append("")
        out += [indent + "\\[", *(indent + b for b in body if b), indent + "\\]", ""]
    text = "\n".join(out)
    text = _INLINE_MATH.sub(lambda mm: "\\(" + mm.group(1) + "\\)", text)
    return _ROLE.sub(lambda mm: "``" + mm.group(1).lstrip(".") + "``", text)


class RstToMarkdown(Extension):
    """Apply :func:`rst_to_markdown` to every docstring griffe loads."""

    def on_instance(self, *, obj, **kwargs) -> None:  # type: ignore[no-untyped-def]  # noqa: ARG002
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)

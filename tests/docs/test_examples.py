"""Every ```python block of the documentation runs, so the examples cannot rot.

Blocks of one page run in order in one namespace (a page reads as one script); a block
that must not run is fenced ``pycon`` or ``text``. Working directory: a tmp dir.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order."""
    return FENCE.findall(text)


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if python_blocks(p.read_text(encoding="utf-8")))


def test_fence_parser_finds_blocks_and_skips_others():
    text = "a\n```python\nx = 1\n```\n```pycon\n>>> 2\n```\n```python title=\"t\"\ny = 2\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\n"]


def test_there_are_examples():
    assert len(_pages()) >= 6


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(python_blocks(page.read_text(encoding="utf-8"))):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own examples

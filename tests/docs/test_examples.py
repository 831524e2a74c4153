"""Every ```python block of the documentation runs, so the examples cannot rot.

Blocks of one page run in order in one namespace (a page reads as one script); a block
that must not run is fenced ``pycon`` or ``text``; a block fenced ```` ```python slow ````
(loads a pretrained model, say) runs only with ``pytest -m slow``. Working directory: a tmp
dir.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def python_blocks(text: str, *, slow: bool = False) -> list[str]:
    """The bodies of the ```python fenced blocks of a Markdown text, in order.

    Blocks whose info string has the word ``slow`` are included only when ``slow`` is True.
    """
    return [body for info, body in FENCE.findall(text) if slow or "slow" not in info.split()]


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8")


def _pages(slow: bool = False) -> list[Path]:
    pages = sorted(DOCS.rglob("*.md"))
    if slow:
        return [p for p in pages if len(python_blocks(_read(p), slow=True)) > len(python_blocks(_read(p)))]
    return [p for p in pages if python_blocks(_read(p))]


def _run_page(page: Path, slow: bool) -> None:
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(python_blocks(_read(page), slow=slow)):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own examples


def test_fence_parser_finds_blocks_and_skips_others():
    text = "a\n```python\nx = 1\n```\n```pycon\n>>> 2\n```\n```python title=\"t\"\ny = 2\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\n"]
    assert python_blocks("```python slow\nz = 3\n```\n") == []
    assert python_blocks("```python slow\nz = 3\n```\n", slow=True) == ["z = 3\n"]


def test_there_are_examples():
    assert len(_pages()) >= 6


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run_page(page, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages(slow=True), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run_with_slow_blocks(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run_page(page, slow=True)

"""Papers are cited by title wherever they are named, and the docs stand alone.

The citations come from one table (:mod:`attnopt._papers`): the README and the docs landing page
hold it verbatim; a page (README, every docs page, the generated results pages) that names a paper
by its short name also gives its title; the reproduction report ends with the papers it checked;
nothing points outside the repository (``../shared/...``). The support statement (devices and
dtypes) is the same in the README and on the landing page.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnopt._papers import PAPERS, citations_markdown, paper
from attnopt.claims._runner import _papers_section

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _statement(text: str, heading: str, last: str) -> str:
    start = text.index(heading)
    return text[start: text.index(last, start) + len(last)]


def test_readme_and_landing_page_hold_the_citation_table_and_the_support_statement():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for text in (readme, index):
        assert citations_markdown() in text
    where = "## Where it runs: devices and dtypes"
    support = _statement(readme, where, "runs on CPU only.")
    assert support == _statement(index, where, "runs on CPU only.")
    for word in ("float32", "float64", "float16", "bfloat16", "GPU", "not tested on a real GPU", "Triton"):
        assert word in support


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_paper_named_on_a_page_is_cited_by_title(page: Path):
    text = page.read_text(encoding="utf-8")
    for p in PAPERS:
        if re.search(rf"\b{re.escape(p.slug)}\b", text):
            assert p.title in text, f"{page.name} names {p.slug} without its title"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_stand_alone(page: Path):
    assert "shared/" not in page.read_text(encoding="utf-8"), f"{page.name} points outside the repository"


def test_no_pointer_outside_the_repository_in_the_package():
    files = (ROOT / "src" / "attnopt").rglob("*.py")
    hits = [p for p in files if "../shared/" in p.read_text(encoding="utf-8")]
    assert hits == []


def test_paper_lookup_and_the_report_section():
    assert paper("fenchel_dual") is paper("fenchel-dual-attention")
    with pytest.raises(KeyError, match="sdpa-one-sided-eot"):
        paper("attention-is-all-you-need")
    sec = _papers_section({"one_sided_eot", "doubly_normalized", "no_such_module"})
    titles = ["Doubly-normalized Attention",
              "Scaled-Dot-Product Attention as One-Sided Entropic Optimal Transport"]
    assert [row[1] for row in sec.rows] == titles
    assert sec.headers[1] == "title"

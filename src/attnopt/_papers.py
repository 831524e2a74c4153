"""The four papers attnopt implements, as citations: one table for the README, the docs and the reports.

Each entry gives what the paper text itself states — its title, authors (the three papers under
double-blind review name none), venue or status, and version — and the two short names the code
uses: ``slug`` (the registry's and the docs' ``paper``, e.g. ``"fenchel-dual-attention"``) and
``claims`` (the claims module, e.g. ``"fenchel_dual"``). No arXiv identifier is given because
none of the paper texts states its own.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["PAPERS", "Paper", "citations_markdown", "citations_section", "paper"]


@dataclass(frozen=True)
class Paper:
    """One paper: its citation and the names the code uses for it."""

    slug: str
    claims: str
    title: str
    authors: str
    venue: str

    def citation(self) -> str:
        """``Title. Authors. Venue.`` on one line."""
        return f"{self.title}. {self.authors}. {self.venue}."


PAPERS: tuple[Paper, ...] = (
    Paper(
        "fenchel-dual-attention", "fenchel_dual",
        "Deciphering Attention Mechanisms: Optimization and Fenchel Dual Solutions",
        "Anonymous authors",
        "Under review at TMLR (an earlier version: \"Attention as Inference via Fenchel Duality\", "
        "under double-blind review)",
    ),
    Paper(
        "doubly-normalized-attention", "doubly_normalized",
        "Doubly-normalized Attention",
        "Anonymous authors",
        "Under review as a conference paper at ICLR 2020",
    ),
    Paper(
        "implicit-kernel-attention", "implicit_kernel",
        "Implicit Kernel Attention",
        "Kyungwoo Song, Yohan Jung, Dongjun Kim, Il-Chul Moon (University of Seoul; KAIST)",
        "AAAI 2021",
    ),
    Paper(
        "sdpa-one-sided-eot", "one_sided_eot",
        "Scaled-Dot-Product Attention as One-Sided Entropic Optimal Transport",
        "Author not named in the paper text (a Stanford University address)",
        "Preprint, version of December 29, 2025",
    ),
)


def paper(name: str) -> Paper:
    """The :class:`Paper` whose ``slug`` or ``claims`` name is ``name`` (``-``/``_`` alike).

    Raises:
        KeyError: no such paper (the message lists the slugs).
    """
    key = name.replace("_", "-")
    for p in PAPERS:
        if key in (p.slug, p.claims.replace("_", "-")):
            return p
    raise KeyError(f"unknown paper {name!r}; papers: {', '.join(p.slug for p in PAPERS)}")


def citations_markdown(names: Iterable[str] | None = None) -> str:
    """A Markdown table ``short name | title | authors | venue`` of ``names`` (default: all four),
    in the order of :data:`PAPERS`."""
    wanted = None if names is None else {paper(n).slug for n in names}
    rows = ["| short name | title | authors | venue / status |", "|---|---|---|---|"]
    for p in PAPERS:
        if wanted is None or p.slug in wanted:
            rows.append(f"| `{p.slug}` | *{p.title}* | {p.authors} | {p.venue} |")
    return "\n".join(rows)


def citations_section(names: Iterable[str] | None = None) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``(headers, rows)`` of the citations of ``names`` (default: all four), for a report table."""
    wanted = None if names is None else {paper(n).slug for n in names}
    rows = [(p.slug, p.title, p.authors, p.venue) for p in PAPERS if wanted is None or p.slug in wanted]
    return ("short name", "title", "authors", "venue / status"), rows

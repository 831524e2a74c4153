"""The documentation site builds with ``mkdocs build --strict`` and works offline.

One build per session (module fixture, ~10 s on 2 cores); the checks read the built HTML:
the generated API reference covers every public module, math is marked up for the MathJax
copied from an installed package, no page loads a script, style or image from the network,
and every image and local link resolves.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings_handlers.python")
pytest.importorskip("mathjax")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import hooks  # noqa: E402  (docs/hooks.py)

SRC_ATTR = re.compile(r"""<(script|img|link)\b[^>]*?\b(src|href)=["']([^"']+)["']""", re.I)
HREF = re.compile(r"""<a\b[^>]*?\bhref=["']([^"'#]+)(?:#[^"']*)?["']""", re.I)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _pages(site: Path) -> list[Path]:
    return [p for p in site.rglob("*.html") if p.name != "404.html"]


def test_public_modules_skip_private_paths():
    mods = hooks.public_modules()
    assert "attnopt" in mods and "attnopt.functional.generalized" in mods and "attnopt.nn" in mods
    assert not [m for m in mods if any(part.startswith("_") for part in m.split("."))]


def test_internal_modules_stay_out_of_the_api_reference(site):
    mods = hooks.public_modules()
    for internal in ("attnopt.cli", "attnopt.cli_train", "attnopt.cli_analyze", "attnopt.claims",
                     "attnopt.claims.fenchel_dual.mem", "attnopt.report", "attnopt.experiments.ot_vit",
                     "attnopt.bench.regularized"):
        assert internal not in mods, internal
    assert "attnopt.experiments" in mods and "attnopt.integrations.hf" in mods
    text = "\n".join(p.read_text(encoding="utf-8") for p in (site / "api").glob("*.html"))
    assert 'id="attnopt.claims' not in text and 'id="attnopt.cli' not in text
    assert not list((site / "api").glob("attnopt.c*.html"))


def test_search_works_from_file_urls(site):
    """Material's offline plugin: the index is a script (no fetch, which file:// forbids)."""
    index = site / "search" / "search_index.js"
    assert index.is_file() and index.read_text(encoding="utf-8").startswith("var __index =")
    assert "attnopt.generalized_attention" in index.read_text(encoding="utf-8")
    # the worker shim that makes search run from file:// is the vendored copy, not a CDN's
    report = (site / "results" / "report.html").read_text(encoding="utf-8")
    assert '<script src="../javascripts/iframe-worker-shim.js"></script>' in report
    assert (site / "javascripts" / "iframe-worker-shim.js").is_file()


def test_wide_tables_wrap_instead_of_scrolling(site):
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert "overflow-wrap: anywhere" in css and "white-space: normal" in css
    assert "stylesheets/extra.css" in (site / "results" / "report.html").read_text(encoding="utf-8")


def test_api_reference_covers_every_public_module(site):
    text = "\n".join(p.read_text(encoding="utf-8") for p in (site / "api").glob("*.html"))
    missing = [m for m in hooks.public_modules() if f'id="{m}"' not in text]
    assert not missing, f"modules without an API section: {missing}"
    # a docstring's `.. math::` became a MathJax display block
    functional = (site / "api" / "attnopt.functional.html").read_text(encoding="utf-8")
    assert '<div class="arithmatex">\\[' in functional


def test_math_renderer_is_local_and_pages_load_nothing_from_the_network(site):
    js = site / "javascripts" / "mathjax" / "tex-svg.js"
    assert js.is_file() and js.stat().st_size > 1_000_000
    mech = (site / "mechanisms" / "regularized.html").read_text(encoding="utf-8")
    assert 'class="arithmatex"' in mech and "javascripts/mathjax/tex-svg.js" in mech
    remote = []
    for page in _pages(site):
        for tag, _, url in SRC_ATTR.findall(page.read_text(encoding="utf-8")):
            if re.match(r"(https?:)?//", url) and not (tag.lower() == "link" and "canonical" in url):
                remote.append((page.name, url))
    assert not remote, f"resources loaded from the network: {remote[:5]}"


def test_images_and_local_links_resolve(site):
    broken = []
    for page in _pages(site):
        html = page.read_text(encoding="utf-8")
        urls = [u for _, _, u in SRC_ATTR.findall(html)] + HREF.findall(html)
        for url in urls:
            if re.match(r"([a-z]+:|//|#)", url):
                continue
            if not (page.parent / url).resolve().exists():
                broken.append((str(page.relative_to(site)), url))
    assert not broken, f"broken local references: {broken[:10]}"
    assert (site / "results" / "analysis-figures" / "lenses.png").is_file()


def test_rst_idioms_become_markdown():
    import griffe_rst  # docs/griffe_rst.py

    doc = (
        "Text :func:`attnopt.sparsemax` and :math:`x^2`::\n\n"
        "    .. math:: a = b\n"
        "              + c\n\n"
        "=====  =====\nname   what\n=====  =====\nx      one\n       more\n=====  =====\n"
    )
    md = griffe_rst.rst_to_markdown(doc)
    assert "``attnopt.sparsemax``" in md and "\\(x^2\\)" in md and ":func:" not in md
    assert "    \\[\n    a = b\n    + c\n    \\]" in md
    assert "| name | what |\n| --- | --- |\n| x | one more |" in md
    assert "::" not in md

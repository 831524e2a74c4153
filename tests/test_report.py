"""The Markdown/HTML report writer."""
from attnopt.report import Section, format_duration, format_value, markdown_table, write_report


def test_format_value():
    assert format_value(3) == "3"
    assert format_value(0.0) == "0"
    assert format_value(1.23456e-7) == "1.235e-07"
    assert format_value(0.5) == "0.5"
    assert format_value("x") == "x"


def test_format_duration_is_human():
    assert format_duration(9.639e-05) == "0.10 ms"
    assert format_duration(0.0123) == "12 ms"
    assert format_duration(3.44) == "3.4 s"
    assert format_duration(125.2) == "2 min 05 s"


def test_markdown_table_escapes_pipes():
    t = markdown_table(("a", "b"), [(1, "x|y")])
    assert t.splitlines()[0] == "| a | b |"
    assert "x\\|y" in t


def test_a_pipe_in_a_header_stays_in_its_column(tmp_path):
    t = markdown_table(("mask", "max |P − SDPA|", "E|i−j|"), [("none", 1e-9, "a|b")])
    assert t.splitlines()[0] == "| mask | max \\|P − SDPA\\| | E\\|i−j\\| |"
    _, html = write_report(tmp_path, "r", "T", [Section("S", text=t)])
    h = html.read_text()
    assert h.count("<th>") == 3 and "<th>max |P − SDPA|</th>" in h and "<td>a|b</td>" in h


def test_committed_results_pages_have_no_raw_pipe_in_a_cell():
    """Every row of every table on the docs pages has as many cells as its separator row."""
    import re
    from pathlib import Path

    pages = sorted((Path(__file__).resolve().parents[1] / "docs").rglob("*.md"))
    assert pages
    bad = []
    for page in pages:
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if i and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+\s*", line):
                ncol = line.count("|") - 1
                k = i - 1
                while k < len(lines) and lines[k].startswith("|"):
                    if len(re.findall(r"(?<!\\)\|", lines[k])) - 1 != ncol:
                        bad.append(f"{page.name}:{k + 1}")
                    k += 1
    assert not bad, bad


def test_write_report(tmp_path):
    img = tmp_path / "figures" / "f.png"
    img.parent.mkdir()
    img.write_bytes(b"\x89PNG")
    md, html = write_report(
        tmp_path, "r", "Title <1>", [Section("S", text="Verdict: reproduced\n\nbody", headers=("k",),
                                             rows=[(1.5,)], images=[img])], intro="hello",
    )
    assert "# Title <1>" in md.read_text() and "![f](figures/f.png)" in md.read_text()
    h = html.read_text()
    assert "Title &lt;1&gt;" in h and 'class="reproduced"' in h and 'src="figures/f.png"' in h


def test_html_renders_markdown_emphasis_and_tables(tmp_path):
    text = ("Verdict: not reproduced at this scale\n\nThe **best** arm:\n\n"
            "| arm | acc |\n|---|---|\n| a | 0.5 |")
    _, html = write_report(tmp_path, "r", "T", [Section("S", text=text)])
    h = html.read_text()
    assert "<strong>best</strong>" in h and "**" not in h
    assert "<table>" in h and "<td>0.5</td>" in h
    assert 'class="not"' in h


def test_html_escapes_raw_html_in_text(tmp_path):
    _, html = write_report(tmp_path, "r", "T", [Section("S", text="a <script>x</script> b")])
    assert "<script>" not in html.read_text()


def test_html_falls_back_without_markdown_it(tmp_path, monkeypatch):
    import attnopt.report as report

    monkeypatch.setattr(report, "_markdown_renderer", lambda: None)
    _, html = write_report(tmp_path, "r", "T", [Section("S", text="Verdict: reproduced\n\n| a |\n|---|")])
    h = html.read_text()
    assert 'class="reproduced"' in h and "<pre>| a |" in h


def test_report_has_provenance_and_coloured_summary_verdicts(tmp_path):
    import torch

    from attnopt import __version__

    rows = [("a", "reproduced"), ("b", "partially reproduced"), ("c", "not reproduced"), ("d", "skipped")]
    md, html = write_report(tmp_path, "r", "T", [Section("Summary", headers=("claim", "verdict"), rows=rows)])
    first = md.read_text().splitlines()[2]
    assert first.startswith("*Generated ") and " UTC by attnopt " + __version__ in first
    assert f"torch {torch.__version__}" in first and "logical cores" in first
    h = html.read_text()
    assert 'class="provenance"' in h
    assert '<td class="reproduced">reproduced</td>' in h and '<td class="partially">partially' in h
    assert '<td class="not">not reproduced</td>' in h and "<td>skipped</td>" in h and "<td>a</td>" in h
    md2, _ = write_report(tmp_path, "s", "T", [], stamp=False)
    assert "Generated" not in md2.read_text()

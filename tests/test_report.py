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

"""The ``attnopt`` command line: reproduce writes its report; bad selections exit with 2."""
from attnopt.cli import main


def test_reproduce_subset_writes_report(tmp_path, capsys):
    rc = main(["reproduce", "--quick", "--only", "fenchel_dual:eq16", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "fenchel_dual:eq16" in out and "reproduced" in out
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.html").exists()


def test_reproduce_scale_flag_writes_json_and_rejects_contradictions(tmp_path, capsys):
    import json

    rc = main(["reproduce", "--scale", "standard", "--only", "fenchel_dual:eq16", "--out", str(tmp_path)])
    assert rc == 0 and "attnopt reproduce (standard)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["scale"] == "standard" and doc["claims"][0]["id"] == "fenchel_dual:eq16"
    assert "Mode: standard" in (tmp_path / "report.md").read_text()
    assert main(["reproduce", "--quick", "--scale", "full", "--only", "fenchel_dual:eq16",
                 "--out", str(tmp_path)]) == 2


def test_reproduce_unknown_paper_exits_2(tmp_path, capsys):
    assert main(["reproduce", "--only", "nope", "--out", str(tmp_path)]) == 2
    assert "matches no claim" in capsys.readouterr().err


def test_bench_unknown_suite_exits_2(capsys):
    assert main(["bench", "--only", "nope", "--quick", "--no-memory"]) == 2
    assert "unknown bench suite" in capsys.readouterr().err

"""The ``attnopt`` command line: reproduce writes its report; bad selections exit with 2."""
from attnopt.cli import main


def test_reproduce_subset_writes_report(tmp_path, capsys):
    rc = main(["reproduce", "--quick", "--only", "fenchel_dual:eq16", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "fenchel_dual:eq16" in out and "reproduced" in out
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.html").exists()
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    # the report cites the paper it checked by title, in both formats, and only that one
    title = "Deciphering Attention Mechanisms: Optimization and Fenchel Dual Solutions"
    assert "## Papers" in md and title in md and title in page
    assert "Doubly-normalized Attention" not in md


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


def test_bench_help_lists_every_suite():
    import subprocess
    import sys
    from pathlib import Path

    from attnopt.bench._harness import all_suites

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "attnopt", "bench", "--help"], capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(root / "src")})
    assert res.returncode == 0, res.stderr
    listed = res.stdout.split("suites (--only NAME[,NAME]):", 1)[1].split()
    for name in all_suites():
        assert name in listed, name


def test_bench_threads_1_runs_no_two_thread_row(capsys):
    from attnopt.bench._harness import BenchContext

    assert BenchContext(threads=1).thread_counts((1, 2)) == [1]
    assert BenchContext(threads=4).thread_counts((1, 2)) == [1, 2]
    assert BenchContext().thread_counts((1, 2)) == [1, 2]
    args = ["bench", "--only", "regularized", "--quick", "--no-memory", "--repeat", "1", "--threads", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 thread" in out and "2 threads" not in out

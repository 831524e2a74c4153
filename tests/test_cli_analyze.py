"""``attnopt analyze`` on a tiny random BERT (with the bundled MiniLM tokenizer) writes every file."""
import csv
import json
import shutil

import pytest

from attnopt.cli import main
from tests.reference.hf_tiny import tiny_bert

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from attnopt.analysis.pretrained import bundled_model_path

    folder = tmp_path_factory.mktemp("tiny_bert")
    tiny_bert(vocab_size=30522).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(bundled_model_path() / name, folder / name)
    return folder


def test_analyze_writes_every_promised_file(model_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(
        "The cat sat on the mat.\n\nA much longer sentence with many more words in it.\nShort one.\n"
    )
    out = tmp_path / "out"
    rc = main(["analyze", str(model_dir), "--text", str(text), "--max-tokens", "12", "--out", str(out),
               "--no-progress", "--attention", "attnopt_dnas", "--solver", "shared"])
    assert rc == 0
    for name in ("analysis.md", "analysis.html", "analysis.json", "analysis.csv",
                 "figures/deviation_by_layer.png", "figures/deviation_by_head_self.png",
                 "figures/lenses.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["n_sentences"] == 3 and len(doc["sites"]) == 2
    assert doc["reconstruction_failures"] == []
    shift = doc["embedding_shift"]
    assert shift["attention"] == "attnopt_dnas" and len(shift["cosine"]) == 3
    assert set(doc["timings_s"]) >= {"load", "forward", "solves", "lenses", "report", "attention_swap"}
    site = doc["sites"][0]
    assert site["reconstruction_ok"] is True and site["reconstruction_error"] < 1e-5
    n_queries = len(site["deviations"][0])
    with (out / "analysis.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 * 4 * n_queries  # one row per layer, head and (non-padding) query
    assert {r["token"] for r in rows} >= {"[CLS]", "[SEP]", "cat"}
    printed = capsys.readouterr().out
    assert "mean deviation per layer" in printed and "wall time:" in printed and "CPU time:" in printed
    md = (out / "analysis.md").read_text()
    assert "Reconstruction check" in md and "deviation_by_layer.png" in md


def test_analyze_bad_arguments(tmp_path, capsys):
    assert main(["analyze", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["analyze", "--sentences", "0", "--out", str(tmp_path / "o")]) == 2


def _one_line_exit_2(args, capsys):
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and err.strip().count("\n") == 0 and "Traceback" not in err
    return err


def test_unknown_attention_is_refused_before_any_work(model_dir, tmp_path, capsys):
    out = tmp_path / "o"
    err = _one_line_exit_2(["analyze", str(model_dir), "--attention", "attnopt_foo", "--out", str(out),
                            "--no-progress"], capsys)
    assert "'attnopt_foo'" in err and "attnopt_dnas" in err and "attnopt_entmax" in err and "sdpa" in err
    assert not out.exists()  # nothing was measured or written


def test_a_hub_name_explains_that_nothing_is_downloaded(tmp_path, capsys):
    err = _one_line_exit_2(["analyze", "gpt2", "--out", str(tmp_path / "o")], capsys)
    assert "'gpt2' is not a folder" in err and "downloads nothing" in err


def test_unsupported_architecture_is_one_line(tmp_path, capsys):
    from transformers import GPT2Config, GPT2Model

    folder = tmp_path / "gpt2"
    GPT2Model(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0,
                         eos_token_id=0)).save_pretrained(folder)
    capsys.readouterr()
    err = _one_line_exit_2(["analyze", str(folder), "--out", str(tmp_path / "o")], capsys)
    assert "supports BERT-family encoders and T5" in err and "GPT2Model" in err


def test_tokenizer_without_pad_token_is_one_line(model_dir, tmp_path, capsys):
    folder = tmp_path / "nopad"
    shutil.copytree(model_dir, folder)
    capsys.readouterr()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        doc = json.loads((folder / name).read_text())
        doc["pad_token"] = None  # explicit: BertTokenizer's default would be [PAD]
        (folder / name).write_text(json.dumps(doc))
    doc = json.loads((folder / "tokenizer.json").read_text())
    doc["padding"] = None
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    err = _one_line_exit_2(["analyze", str(folder), "--out", str(tmp_path / "o")], capsys)
    assert "no pad token" in err

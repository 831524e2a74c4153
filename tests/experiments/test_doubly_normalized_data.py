"""Data builders of the doubly-normalized paper's tasks: docstring corpus, word-pieces, digit views."""
from __future__ import annotations

import pytest
import torch

from attnopt.experiments._data.cache import cached
from attnopt.experiments._data.digits_views import digits_views
from attnopt.experiments._data.docstrings import (
    DocRecord,
    docstring_records,
    first_sentence_split,
    load_records,
    split_by_module,
    split_by_record,
)

MODULES = ("json", "textwrap", "heapq", "bisect", "fractions", "statistics", "calendar", "queue")


@pytest.fixture(scope="module")
def records() -> list[DocRecord]:
    return docstring_records(MODULES)


def test_first_sentence_split() -> None:
    assert first_sentence_split("Return x. The rest is here.\n\nMore.") == (
        "Return x.", "The rest is here. More.")
    assert first_sentence_split("Summary line without period\n\nBody text.") == (
        "Summary line without period", "Body text.")
    assert first_sentence_split("Use e.g. this. Then that.") == ("Use e.g. this.", "Then that.")
    assert first_sentence_split("  ") == ("", "")


def test_records_fields_dedup_and_determinism(records: list[DocRecord]) -> None:
    assert len(records) > 100
    assert {r.module for r in records} <= set(MODULES) and len({r.module for r in records}) >= 6
    assert {r.kind for r in records} == {"module", "class", "function"}
    docs = [r.docstring for r in records]
    assert len(set(docs)) == len(docs)
    for r in records:
        assert r.docstring.startswith(r.first_sentence)
        assert len(r.first_sentence.split()) >= 3
        assert ">>>" not in r.docstring
    assert docstring_records(MODULES) == records
    dumps = next(r for r in records if (r.module, r.qualname) == ("json", "dumps"))
    assert dumps.kind == "function" and dumps.first_sentence.startswith("Serialize ``obj``")


def test_split_by_module_no_leakage(records: list[DocRecord]) -> None:
    parts = split_by_module(records, val=0.1, test=0.25)
    mods = {k: {r.module for r in v} for k, v in parts.items()}
    assert not mods["train"] & mods["test"] and not mods["train"] & mods["val"]
    assert not mods["val"] & mods["test"]
    assert sum(len(v) for v in parts.values()) == len(records)
    assert all(parts[k] for k in ("train", "val", "test"))
    assert len(parts["test"]) >= 0.25 * len(records)
    assert split_by_module(records, val=0.1, test=0.25) == parts
    with pytest.raises(ValueError, match="test"):
        split_by_module(records, test=0.0)


def test_split_by_record_sizes(records: list[DocRecord]) -> None:
    parts = split_by_record(records, val=0.1, test=0.2, seed=3)
    n = len(records)
    assert len(parts["test"]) == round(0.2 * n) and len(parts["val"]) == round(0.1 * n)
    ids = [id(r) for v in parts.values() for r in v]
    assert len(set(ids)) == n
    assert split_by_record(records, seed=4) != split_by_record(records, seed=3)


def test_load_records_cache_rebuilds_when_corrupt(tmp_path, records: list[DocRecord]) -> None:
    first = load_records(tmp_path, MODULES)
    assert first == records
    (path,) = tmp_path.glob("docstrings-*.json")
    path.write_text(path.read_text()[:-50])  # truncated write
    assert load_records(tmp_path, MODULES) == records
    text = path.read_text().replace("Serialize", "Serialise", 1)  # checksum mismatch
    path.write_text(text)
    again = load_records(tmp_path, MODULES)
    assert again == records and "Serialise" not in path.read_text()


def test_cached_tensor_rebuilds_when_corrupt(tmp_path) -> None:
    calls = []

    def build():
        calls.append(1)
        return {"x": torch.arange(5)}

    p = tmp_path / "d.pt"
    assert torch.equal(cached(p, build)["x"], torch.arange(5))
    assert torch.equal(cached(p, build)["x"], torch.arange(5)) and len(calls) == 1
    p.write_bytes(p.read_bytes()[:10])
    assert torch.equal(cached(p, build)["x"], torch.arange(5)) and len(calls) == 2


def test_cached_loads_a_file_once_per_process_and_reloads_when_it_changes(tmp_path) -> None:
    p = tmp_path / "d.pt"
    first = cached(p, lambda: {"x": [1, 2, 3]})
    assert cached(p, lambda: {"x": [9]}) is first  # loaded once: the same object, build not called
    p.unlink()
    changed = cached(p, lambda: {"x": [4]})  # a rebuilt file is read anew
    assert changed == {"x": [4]} and cached(p, lambda: {"x": [9]}) == {"x": [4]}


def test_wordpiece_round_trip(records: list[DocRecord]) -> None:
    pytest.importorskip("transformers")
    from attnopt.experiments._data.wordpiece import CompactVocab, minilm_tokenizer, wordpiece_ids

    texts = [r.first_sentence for r in records[:40]]
    ids = wordpiece_ids(texts, 64)
    tok = minilm_tokenizer()
    assert all(s[0] == tok.cls_token_id and s[-1] == tok.sep_token_id for s in ids)
    assert max(map(len, ids)) <= 64
    vocab = CompactVocab.from_ids(ids)
    assert vocab.orig_ids[:5] == (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id,
                                  tok.mask_token_id)
    assert vocab.size == len(set(vocab.orig_ids)) < tok.vocab_size
    for text, seq in zip(texts, ids):
        compact = vocab.encode(seq)
        assert vocab.UNK not in compact
        decoded = vocab.decode(compact)
        # decode -> encode gives the same word-pieces (the tokenizer lower-cases: uncased)
        assert wordpiece_ids([decoded], 64)[0] == seq
        assert decoded.replace(" ", "") == tok.decode(seq[1:-1]).replace(" ", "")
        assert text.lower().replace(" ", "")[:5] == decoded.replace(" ", "")[:5]
    assert vocab.encode([tok.vocab_size - 1])[0] in (vocab.UNK, vocab.size - 1)
    with pytest.raises(ValueError, match="max_len"):
        wordpiece_ids(["x"], 2)


def test_digits_views_shapes_and_complementarity() -> None:
    v = digits_views()
    assert v["patch"].shape == (1797, 16, 6) and v["blur"].shape == (1797, 9, 18)
    assert v["edges"].shape == (1797, 16, 10) and v["label"].shape == (1797,)
    assert all(torch.isfinite(v[k]).all() for k in ("patch", "blur", "edges"))
    assert v["patch"][..., :4].min() >= 0 and v["patch"][..., :4].max() <= 1
    again = digits_views()
    assert all(torch.equal(v[k], again[k]) for k in v)
    clean = digits_views(occlusion=0)
    # each view is occluded independently: pixels lost in one view are present in another
    lost = (clean["patch"][..., :4] - v["patch"][..., :4]).abs().sum((1, 2))
    assert (lost > 0).float().mean() > 0.5
    assert not torch.equal(v["blur"], clean["blur"])
    with pytest.raises(ValueError, match="occlusion"):
        digits_views(occlusion=9)

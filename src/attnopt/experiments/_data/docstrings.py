"""A real-text corpus that installs offline: docstrings of a fixed list of standard-library modules.

Shared by the text tasks (headline generation, MLM pretraining + fine-tuning, sentence
classification). :func:`docstring_records` walks :data:`CORPUS_MODULES` in a fixed order —
each module, its public classes and functions (defined in that module), and the methods
defined in those classes — and returns one :class:`DocRecord` per distinct docstring:

* ``module`` — the module the object belongs to (e.g. ``"json"``, ``"email.message"``),
* ``qualname`` — ``""`` for the module itself, else ``"dumps"`` / ``"JSONDecoder.decode"``,
* ``kind`` — ``"module"``, ``"class"`` or ``"function"`` (functions and methods),
* ``docstring`` — the cleaned docstring (whitespace normalized, doctest/code lines dropped),
* ``first_sentence`` — its first sentence (the "headline"),
* ``body`` — the rest of the docstring (the "article"); empty when there is none.

Only the object's own ``__doc__`` is used (never an inherited one), and a docstring seen
before is skipped, so the corpus is deduplicated. The result is deterministic for a given
Python version (it is cached under the run's output directory keyed by that version, see
:func:`load_records`); site-packages are never read, so the corpus does not depend on what
happens to be installed. :func:`split_by_module` gives a fixed train/val/test split in which
the test modules are unseen in training.

Label leak: a task whose label is the module (module classification) must not see text that
names its own module, or it is solved by copying the name ("Module difflib -- helpers ...",
"RawTurtle", "IMAP4 client"). :func:`names_module` is the rule (see there) and
:func:`without_own_module_name` drops such records; the text tasks apply it to their
module-labelled examples.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import random
import re
import sys
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "CORPUS_MODULES",
    "DocRecord",
    "docstring_records",
    "first_sentence_split",
    "load_records",
    "module_name_pattern",
    "names_module",
    "split_by_module",
    "split_by_record",
    "without_own_module_name",
]

CORPUS_MODULES: tuple[str, ...] = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bdb", "binascii", "bisect", "builtins",
    "bz2", "calendar", "cmath", "cmd", "code", "codecs", "collections", "collections.abc",
    "concurrent.futures", "configparser", "contextlib", "copy", "csv", "ctypes", "dataclasses",
    "datetime", "decimal", "difflib", "dis", "doctest", "email.message", "email.utils", "enum",
    "filecmp", "fnmatch", "fractions", "ftplib", "functools", "gc", "getopt", "gettext", "glob",
    "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.client", "http.cookies",
    "http.server", "imaplib", "importlib", "inspect", "io", "ipaddress", "itertools", "json",
    "keyword", "linecache", "locale", "logging", "logging.handlers", "lzma", "mailbox", "math",
    "mimetypes", "multiprocessing", "netrc", "numbers", "operator", "optparse", "os", "os.path",
    "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint",
    "profile", "pstats", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3", "ssl",
    "stat", "statistics", "string", "struct", "subprocess", "symtable", "sys", "sysconfig", "tarfile",
    "tempfile", "textwrap", "threading", "time", "timeit", "token", "tokenize", "trace", "traceback",
    "tracemalloc", "turtle", "types", "typing", "unittest", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "webbrowser", "xml.dom.minidom",
    "xml.etree.ElementTree", "zipfile", "zlib", "zoneinfo",
)
"""The modules walked, in order (a fixed list: the corpus does not depend on site-packages)."""

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'`])")
_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|\$ )")
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->\s*.*)?$")


@dataclass(frozen=True)
class DocRecord:
    """One docstring of the corpus (see the module docstring for the fields)."""

    module: str
    qualname: str
    kind: str
    docstring: str
    first_sentence: str
    body: str


def first_sentence_split(text: str) -> tuple[str, str]:
    """Split whitespace-normalized ``text`` into ``(first sentence, rest)``.

    The first sentence ends at the first ``.``, ``!`` or ``?`` followed by white space and an
    upper-case letter, a quote or a parenthesis, or at the first blank line (a one-line
    summary without a period) — whichever comes first.
    """
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    if not paragraphs:
        return "", ""
    first_para = " ".join(paragraphs[0].split())
    rest_paras = [" ".join(p.split()) for p in paragraphs[1:]]
    parts = _SENTENCE_END.split(first_para, maxsplit=1)
    head = parts[0]
    rest = ([parts[1]] if len(parts) > 1 else []) + rest_paras
    return head, " ".join(rest)


def _clean(doc: str) -> str:
    """Drop leading signature lines and doctest/shell lines; keep paragraphs; normalize spaces."""
    lines = [ln for ln in inspect.cleandoc(doc).splitlines() if not _CODE_LINE.match(ln)]
    while lines and (_SIGNATURE.match(lines[0].strip()) or not lines[0].strip()):
        lines = lines[1:]  # C functions start with their signature ("dumps(obj, ...) -> str")
    paragraphs = re.split(r"\n\s*\n", "\n".join(lines))
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def _members(module: object, name: str) -> Iterable[tuple[str, str, object]]:
    """``(qualname, kind, object)`` of the module, its public classes/functions and their methods."""
    yield "", "module", module
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        obj = vars(module)[attr]
        if getattr(obj, "__module__", None) != name:
            continue
        if inspect.isclass(obj):
            yield attr, "class", obj
            for meth in sorted(vars(obj)):
                if meth.startswith("_"):
                    continue
                fn = vars(obj)[meth]
                if isinstance(fn, (staticmethod, classmethod)):
                    fn = fn.__func__
                if inspect.isroutine(fn) or isinstance(fn, property):
                    yield f"{attr}.{meth}", "function", fn
        elif inspect.isroutine(obj):
            yield attr, "function", obj


def docstring_records(
    modules: Sequence[str] = CORPUS_MODULES,
    *,
    min_words: int = 3,
) -> list[DocRecord]:
    """Every distinct docstring of ``modules`` (in a fixed order), as :class:`DocRecord` s.

    Args:
        modules: importable module names; one that does not import is skipped.
        min_words: drop docstrings whose first sentence has fewer words.
    Returns:
        the records, deduplicated on the cleaned docstring, in walk order.
    Raises:
        ValueError: ``min_words < 1``.
    """
    if min_words < 1:
        raise ValueError(f"min_words must be >= 1, got {min_words}")
    seen: set[str] = set()
    out: list[DocRecord] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover - trimmed Python installs
            continue
        with warnings.catch_warnings():  # e.g. typing.io's deprecation on attribute access
            warnings.simplefilter("ignore", DeprecationWarning)
            members = [(q, k, o, getattr(o, "__doc__", None)) for q, k, o in _members(module, name)]
        for qualname, kind, _obj, doc_attr in members:
            raw = doc_attr if isinstance(doc_attr, str) else None
            if not raw:
                continue
            doc = _clean(raw)
            if not doc or doc in seen:
                continue
            head, rest = first_sentence_split(doc)
            if len(head.split()) < min_words:
                continue
            seen.add(doc)
            out.append(DocRecord(name, qualname, kind, doc, head, rest))
    return out


_MEMO: dict[tuple[str, ...], list[DocRecord]] = {}  # one walk per process (records are frozen)


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load_records(cache_dir: str | os.PathLike[str] | None = None,
                 modules: Sequence[str] = CORPUS_MODULES) -> list[DocRecord]:
    """:func:`docstring_records`, cached as ``cache_dir/docstrings-py<X.Y>-<key>.json``.

    The cache holds a SHA-256 of its records; a file that does not parse or whose checksum
    does not match is rebuilt (written atomically). ``cache_dir=None``: no file cache. The
    walk itself is done once per process.
    """
    if cache_dir is None:
        key_mem = tuple(modules)
        if key_mem not in _MEMO:
            _MEMO[key_mem] = docstring_records(modules)
        return list(_MEMO[key_mem])
    key = _digest(list(modules))[:12]
    path = Path(cache_dir) / f"docstrings-py{sys.version_info[0]}.{sys.version_info[1]}-{key}.json"
    try:
        payload = json.loads(path.read_text())
        rows = payload["records"]
        if payload["sha256"] == _digest(rows):
            return [DocRecord(**r) for r in rows]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    records = load_records(None, modules)
    rows = [asdict(r) for r in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump({"sha256": _digest(rows), "records": rows}, fh)
    os.replace(tmp, path)
    return records


@functools.cache
def module_name_pattern(module: str) -> re.Pattern[str]:
    """The compiled rule of :func:`names_module` for ``module`` (case-insensitive).

    Raises:
        ValueError: empty ``module``.
    """
    parts = [p for p in module.lower().split(".") if p]
    if not parts:
        raise ValueError(f"module must be a non-empty module name, got {module!r}")
    alts = []
    for p in parts:
        if len(p) >= 4:
            alts.append(re.escape(p))  # anywhere: "rawturtle", "statisticserror", "threading.settrace"
        else:
            alts.append(rf"(?<![a-z0-9]){re.escape(p)}(?![a-z0-9])")  # "re", "os": whole words only
        if p.endswith("lib") and len(p) >= 6:  # imaplib -> IMAP, IMAP4, imap4_ssl; difflib -> diff(s)
            alts.append(rf"(?<![a-z]){re.escape(p[:-3])}(?:\d+|s)?(?![a-z])")
    return re.compile("|".join(alts), re.IGNORECASE)


def names_module(text: str, module: str) -> bool:
    """Does ``text`` name ``module`` (the label-leak rule of the module-classification tasks)?

    Case-insensitive. It names the module when it contains any dotted part of the name — as a
    substring for parts of 4+ characters (so identifiers built on it count: ``RawTurtle``,
    ``StatisticsError``, ``logging.handlers``), as a whole word for shorter parts (``re``,
    ``os``, so ``return`` does not) — or, for a part ``<stem>lib`` (``imaplib``, ``difflib``),
    the stem as a word with optional digits or plural ``s`` (``IMAP4``, ``imap4_ssl``,
    ``diffs``; not ``different``).
    """
    return module_name_pattern(module).search(text) is not None


def without_own_module_name(records: Sequence[DocRecord]) -> list[DocRecord]:
    """The records whose docstring does not name their own module (:func:`names_module`)."""
    return [r for r in records if not names_module(r.docstring, r.module)]


def _fractions(val: float, test: float) -> None:
    if not (0.0 <= val < 1.0 and 0.0 < test < 1.0 and val + test < 1.0):
        raise ValueError(f"need 0 <= val, 0 < test, val + test < 1; got val={val}, test={test}")


def split_by_module(records: Sequence[DocRecord], *, val: float = 0.1, test: float = 0.2,
                    seed: int = 0) -> dict[str, list[DocRecord]]:
    """Fixed split of whole modules: ``{"train", "val", "test"}``; no module is in two parts.

    Modules are shuffled with ``random.Random(seed)`` and assigned greedily so that each part
    gets about its fraction of the *records*.

    Raises:
        ValueError: bad fractions, or fewer than 3 modules.
    """
    _fractions(val, test)
    modules = sorted({r.module for r in records})
    if len(modules) < 3:
        raise ValueError(f"need records of at least 3 modules to split by module, got {len(modules)}")
    random.Random(seed).shuffle(modules)
    counts = {m: 0 for m in modules}
    for r in records:
        counts[r.module] += 1
    total = len(records)
    part_of: dict[str, str] = {}
    filled = {"test": 0, "val": 0}
    for m in modules:
        if filled["test"] < test * total:
            part_of[m] = "test"
            filled["test"] += counts[m]
        elif filled["val"] < val * total:
            part_of[m] = "val"
            filled["val"] += counts[m]
        else:
            part_of[m] = "train"
    out: dict[str, list[DocRecord]] = {"train": [], "val": [], "test": []}
    for r in records:
        out[part_of[r.module]].append(r)
    return out


def split_by_record(records: Sequence[DocRecord], *, val: float = 0.1, test: float = 0.2,
                    seed: int = 0) -> dict[str, list[DocRecord]]:
    """Fixed split of records (a seeded permutation): ``{"train", "val", "test"}`` in walk order.

    Raises:
        ValueError: bad fractions.
    """
    _fractions(val, test)
    idx = list(range(len(records)))
    random.Random(seed).shuffle(idx)
    n_test, n_val = round(test * len(idx)), round(val * len(idx))
    parts = {"test": set(idx[:n_test]), "val": set(idx[n_test:n_test + n_val])}
    out: dict[str, list[DocRecord]] = {"train": [], "val": [], "test": []}
    for i, r in enumerate(records):
        out["test" if i in parts["test"] else "val" if i in parts["val"] else "train"].append(r)
    return out

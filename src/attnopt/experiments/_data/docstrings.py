r"""A corpus of standard-library docstrings (offline, deterministic text for the training tasks).

Records come from a fixed list of pure-Python standard-library modules (:data:`STDLIB_MODULES`),
never from whatever else happens to be installed: each module's docstring, the docstrings of
the public classes and functions it defines, and of those classes' public methods. Every
record holds ``module``, ``qualname``, ``kind`` (``"module"``, ``"class"`` or ``"function"``),
``body`` (the cleaned docstring) and ``first_sentence``. Records are sorted by
``(module, qualname)``; the corpus depends only on the running Python's standard library.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["DocRecord", "STDLIB_MODULES", "docstring_records", "sentences", "first_sentence"]

STDLIB_MODULES: tuple[str, ...] = (
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "codecs",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "ftplib",
    "functools",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "http.client",
    "http.cookiejar",
    "imaplib",
    "inspect",
    "ipaddress",
    "json",
    "logging",
    "mailbox",
    "netrc",
    "numbers",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "pydoc",
    "queue",
    "random",
    "shlex",
    "shutil",
    "smtplib",
    "socketserver",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "tokenize",
    "traceback",
    "typing",
    "unittest.case",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "xml.dom.minidom",
    "zipfile",
)

_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`'\"])")


@dataclass(frozen=True)
class DocRecord:
    """One docstring: where it is defined and its text."""

    module: str
    qualname: str
    kind: str
    body: str
    first_sentence: str


def sentences(body: str) -> list[str]:
    """Prose sentences of a docstring: paragraphs joined, split after ``.!?`` before a capital.

    Lines of doctest (``>>>``) and indented blocks are dropped.
    """
    prose: list[str] = []
    for para in re.split(r"\n\s*\n", body):
        lines = para.splitlines()
        if not lines or lines[0].startswith((" ", "\t")):
            continue
        if any(ln.lstrip().startswith(">>>") for ln in lines):
            continue
        prose.append(" ".join(ln.strip() for ln in lines))
    out: list[str] = []
    for para in prose:
        out.extend(s.strip() for s in _SENT_SPLIT.split(para) if s.strip())
    return out


def first_sentence(body: str) -> str:
    """The docstring's first sentence ("" when it has no prose)."""
    s = sentences(body)
    return s[0] if s else ""


def _doc(obj: object) -> str:
    with warnings.catch_warnings():  # e.g. typing.io warns that it is deprecated when read
        warnings.simplefilter("ignore", DeprecationWarning)
        doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc else ""


@lru_cache(maxsize=4)
def docstring_records(modules: tuple[str, ...] = STDLIB_MODULES) -> tuple[DocRecord, ...]:
    """Records of every public docstring defined in ``modules`` (sorted; no inherited docs).

    Raises:
        ValueError: a module cannot be imported.
    """
    recs: dict[tuple[str, str], DocRecord] = {}

    def add(mod: str, qual: str, kind: str, body: str) -> None:
        if body:
            recs[(mod, qual)] = DocRecord(mod, qual, kind, body, first_sentence(body))

    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError as err:  # pragma: no cover - stdlib modules always import
            raise ValueError(f"module {name!r} of the corpus cannot be imported: {err}") from err
        add(name, "", "module", _doc(mod))
        with warnings.catch_warnings():  # e.g. typing.io's deprecation when its __module__ is read
            warnings.simplefilter("ignore", DeprecationWarning)
            members = [(a, o, getattr(o, "__module__", None)) for a, o in sorted(vars(mod).items())]
        for attr, obj, owner in members:
            if attr.startswith("_") or owner != mod.__name__:
                continue
            if inspect.isclass(obj):
                add(name, attr, "class", _doc(obj))
                for mname, meth in sorted(vars(obj).items()):
                    if mname.startswith("_"):
                        continue
                    if isinstance(meth, (staticmethod, classmethod)):
                        meth = meth.__func__
                    if inspect.isfunction(meth):
                        add(name, f"{attr}.{mname}", "function", _doc(meth))
            elif inspect.isfunction(obj):
                add(name, attr, "function", _doc(obj))
    return tuple(recs[k] for k in sorted(recs))

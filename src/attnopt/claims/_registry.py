"""The claims registry: each claim of a paper is a function that measures and judges.

A claim module (one per paper, ``attnopt/claims/<paper>.py``) registers functions with
:func:`claim`. Each function receives a :class:`ClaimContext` and returns a
:class:`ClaimResult` whose numbers come from real computations done in that call — never a
constant — and whose verdict states honestly whether the paper's claim reproduced.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "Verdict",
    "ClaimResult",
    "ClaimContext",
    "Claim",
    "claim",
    "all_claims",
    "verdict",
    "Scale",
    "SCALES",
]

Verdict = Literal["reproduced", "partially reproduced", "not reproduced", "inconclusive"]
_VERDICTS = ("reproduced", "partially reproduced", "not reproduced", "inconclusive")
Scale = Literal["quick", "standard", "full"]
#: ``attnopt reproduce --scale``: quick (minutes, may answer "inconclusive"), standard (the trained
#: claims to convergence with enough seeds to decide where this machine allows; theory claims at
#: their quick configuration, which already decides), full (every claim at the paper's scale)
SCALES: tuple[str, ...] = ("quick", "standard", "full")
#: Extras a claim needs by default: nearly every claim draws a figure.
DEFAULT_REQUIRES: tuple[str, ...] = ("plots",)


def verdict(ok: bool, *, partial: bool = False) -> Verdict:
    """``"reproduced"`` if ``ok``, else ``"partially reproduced"`` if ``partial``, else not."""
    if ok:
        return "reproduced"
    return "partially reproduced" if partial else "not reproduced"


@dataclass(frozen=True)
class ClaimResult:
    """What a claim measured and what it concludes.

    Attributes:
        verdict: one of ``"reproduced"``, ``"partially reproduced"``, ``"not reproduced"``,
            ``"inconclusive"`` (trained claims: the run cannot decide, see
            :mod:`attnopt.claims._verdict`).
        summary: one sentence: what was measured against what the paper states.
        figures: the key measured numbers (name -> value), shown in the summary table.
        details: optional Markdown (tables of sweeps, notes on the reduced scale).
        reason: why this verdict, in one clause (trained claims: the effect's CI or the failed
            sanity gate); empty when the summary says it.
        training: trained claims' machine-readable record (report.json's ``training``:
            ``metric``, ``higher_is_better``, ``arms``, ``baseline``, ``effect``; see
            :func:`attnopt.claims._verdict.training_record`); ``None`` for theory claims.
    """

    verdict: Verdict
    summary: str
    figures: Mapping[str, Any] = field(default_factory=dict)
    details: str = ""
    reason: str = ""
    training: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.verdict not in _VERDICTS:
            raise ValueError(f"verdict must be one of {_VERDICTS}, got {self.verdict!r}")


@dataclass
class ClaimContext:
    """Run settings handed to every claim.

    Attributes:
        quick: run the reduced configuration (the whole suite in a few minutes on a CPU).
            With ``scale`` given it is derived: ``scale != "full"`` (the theory claims run
            their quick configuration at standard scale).
        out_dir: report directory; figures go to ``out_dir / "figures"``.
        seed: base seed; use :meth:`generator` for reproducible randomness.
        images: figures saved by this claim (filled by :meth:`save_figure`).
        scale: ``"quick"``, ``"standard"`` or ``"full"`` (:data:`SCALES`); ``None`` (default):
            ``"quick"`` if ``quick`` else ``"full"``. The trained claims read it.
        resume: the trained claims continue an interrupted run from the engine's checkpoints
            under ``out_dir / "train"`` and skip its finished runs (``--resume``).
    """

    quick: bool
    out_dir: Path
    seed: int = 0
    prefix: str = "claim"
    images: list[Path] = field(default_factory=list)
    scale: str | None = None
    resume: bool = False

    def __post_init__(self) -> None:
        if self.scale is None:
            self.scale = "quick" if self.quick else "full"
        elif self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale!r}")
        else:
            self.quick = self.scale != "full"

    def generator(self, offset: int = 0) -> torch.Generator:
        """A CPU ``torch.Generator`` seeded with ``seed + offset``."""
        return torch.Generator().manual_seed(self.seed + offset)

    def attach_figures(self, folder: Path, *patterns: str) -> list[Path]:
        """Show figures another step already wrote (e.g. a training task's) in this claim's section.

        Args:
            folder: where they are (usually under ``out_dir``, so the report links them relatively).
            patterns: glob patterns of file names; the matches are added in sorted order.
        """
        found = [p for pat in patterns for p in sorted(Path(folder).glob(pat)) if p.is_file()]
        self.images.extend(found)
        return found

    def save_figure(self, fig: Any, name: str) -> Path:
        """Save a matplotlib figure as ``figures/<prefix>_<name>.png`` and close it."""
        import matplotlib.pyplot as plt

        fig_dir = self.out_dir / "figures"
        fig_dir.mkdir(parents=True, exist_ok=True)
        path = fig_dir / f"{self.prefix}_{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        self.images.append(path)
        return path


ClaimFn = Callable[[ClaimContext], ClaimResult]


@dataclass(frozen=True)
class Claim:
    """A registered claim.

    Attributes:
        paper: claims module name (``fenchel_dual``); ``key``: short id; ``title``: the claim
            in words; ``reference``: the paper's equation / section.
        requires: extras of ``pyproject.toml`` (see :mod:`attnopt._extras`) whose packages the
            claim imports at run time; without them it is skipped, not failed.
    """

    paper: str
    key: str
    title: str
    reference: str
    func: ClaimFn
    requires: tuple[str, ...] = DEFAULT_REQUIRES

    @property
    def id(self) -> str:
        return f"{self.paper}:{self.key}"


_REGISTRY: dict[str, Claim] = {}


def claim(
    *, paper: str, key: str, title: str, reference: str, requires: tuple[str, ...] = DEFAULT_REQUIRES
) -> Callable[[ClaimFn], ClaimFn]:
    """Register ``func`` as the claim ``paper:key`` (e.g. ``fenchel_dual:thm1``).

    Args:
        requires: the extras it needs at run time (default ``("plots",)``: it draws a figure).
    Raises:
        ValueError: an unknown extra, or the id registered twice.
    """
    from attnopt._extras import EXTRA_MODULES

    unknown = [r for r in requires if r not in EXTRA_MODULES]
    if unknown:
        raise ValueError(f"requires: unknown extras {unknown}; known: {sorted(EXTRA_MODULES)}")

    def register(func: ClaimFn) -> ClaimFn:
        c = Claim(paper=paper, key=key, title=title, reference=reference, func=func,
                  requires=tuple(requires))
        if c.id in _REGISTRY and _REGISTRY[c.id].func.__qualname__ != func.__qualname__:
            raise ValueError(f"claim {c.id} registered twice")
        _REGISTRY[c.id] = c
        return func

    return register


def _import_claim_modules() -> None:
    import attnopt.claims as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"attnopt.claims.{info.name}")


def all_claims(only: str | None = None) -> list[Claim]:
    """Every registered claim, in registration order, optionally filtered.

    Args:
        only: a paper (``fenchel_dual`` or ``fenchel-dual``), or a claim id ``paper:key``;
            comma-separated for several.
    Raises:
        ValueError: ``only`` matches no claim.
    """
    _import_claim_modules()
    claims = list(_REGISTRY.values())
    if only is None:
        return claims
    wanted = [w.strip().replace("-", "_") for w in only.split(",") if w.strip()]
    chosen = [
        c for c in claims if any(w == c.paper or w == c.id.replace("-", "_") for w in wanted)
    ]
    if not chosen:
        papers = sorted({c.paper for c in claims})
        raise ValueError(f"--only {only!r} matches no claim; papers are {papers}")
    return chosen

"""``report.json``: the reproduction report as data, one record per claim (beside report.md/html).

Other runs can be compared without parsing Markdown. The file is ``{"scale", "commit",
"versions", "created", "wall_s", "claims": [...]}``; each claim record is

``{"id", "paper", "title", "reference", "verdict", "reason", "figures", "scale", "seconds",
"training"}`` where ``training`` is ``null`` for a theory claim and otherwise
``{"metric", "higher_is_better", "arms": {arm: {"mean", "ci95", "n"}}, "baseline": {"name",
"value", "passed"} | null, "effect": {"paper", "measured", "ci95", "n"} | null}``
(:func:`attnopt.claims._verdict.training_record`). :data:`SCHEMA` is its JSON Schema.
Non-finite numbers are written as ``null`` (JSON has no NaN).
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "claim_record", "write_report_json", "versions", "commit"]

_NUM = {"type": ["number", "null"]}
_ARM = {
    "type": "object",
    "required": ["mean", "ci95", "n"],
    "properties": {"mean": _NUM, "ci95": _NUM, "n": {"type": "integer", "minimum": 0}},
}
_TRAINING = {
    "type": "object",
    "required": ["metric", "higher_is_better", "arms", "baseline", "effect"],
    "properties": {
        "metric": {"type": "string"},
        "higher_is_better": {"type": "boolean"},
        "arms": {"type": "object", "additionalProperties": _ARM},
        "baseline": {
            "type": ["object", "null"],
            "required": ["name", "value"],
            "properties": {"name": {"type": "string"}, "value": _NUM, "passed": {"type": "boolean"},
                           "margin": _NUM},
        },
        "effect": {
            "type": ["object", "null"],
            "required": ["paper", "measured", "ci95"],
            "properties": {"paper": _NUM, "measured": _NUM, "ci95": _NUM, "n": {"type": "integer"}},
        },
    },
}
_VERDICTS = ["reproduced", "partially reproduced", "not reproduced", "inconclusive", "skipped", "error"]
#: JSON Schema (draft 2020-12) of report.json
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["scale", "commit", "versions", "claims"],
    "properties": {
        "scale": {"enum": ["quick", "standard", "full"]},
        "commit": {"type": ["string", "null"]},
        "versions": {"type": "object", "additionalProperties": {"type": ["string", "null"]}},
        "created": {"type": "string"},
        "wall_s": _NUM,
        "claims": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "verdict", "reason", "figures", "scale", "training"],
                "properties": {
                    "id": {"type": "string", "pattern": "^[a-z0-9_]+:[A-Za-z0-9_]+$"},
                    "paper": {"type": "string"},
                    "title": {"type": "string"},
                    "reference": {"type": "string"},
                    "verdict": {"enum": _VERDICTS},
                    "reason": {"type": "string"},
                    "figures": {"type": "object"},
                    "scale": {"enum": ["quick", "standard", "full"]},
                    "seconds": _NUM,
                    "training": {"oneOf": [{"type": "null"}, _TRAINING]},
                },
            },
        },
    },
}


def _clean(x: Any) -> Any:
    """JSON-safe: non-finite floats -> None, tuples -> lists, numpy scalars -> Python, others str."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    item = getattr(x, "item", None)
    if callable(item):
        return _clean(item())
    return str(x)


def versions() -> dict[str, str | None]:
    """Versions of Python, attnopt and the packages the claims' numbers depend on."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("attnopt", "torch", "numpy", "scipy", "scikit-learn", "lightning", "POT"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def commit() -> str | None:
    """The git commit of the checkout attnopt is imported from (``None`` outside a checkout)."""
    here = Path(__file__).resolve().parent
    try:
        res = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None if res.returncode == 0 else None


def claim_record(run: Any, scale: str) -> dict[str, Any]:
    """The record of one :class:`~attnopt.claims._runner.ClaimRun`."""
    res = run.result
    if run.skip_reason is not None:
        reason = run.skip_reason
    elif res is None:
        lines = (run.error or "").strip().splitlines()
        reason = lines[-1] if lines else "error"
    else:
        reason = res.reason or res.summary
    return _clean({
        "id": run.claim.id,
        "paper": run.claim.paper,
        "title": run.claim.title,
        "reference": run.claim.reference,
        "verdict": run.verdict,
        "reason": reason or "",
        "figures": dict(res.figures) if res is not None else {},
        "scale": scale,
        "seconds": run.seconds,
        "training": None if res is None or res.training is None else dict(res.training),
    })


def write_report_json(runs: Sequence[Any], out_dir: Path, *, scale: str, wall_s: float | None = None) -> Path:
    """Write ``out_dir/report.json`` (:data:`SCHEMA`) and return its path."""
    doc = {
        "scale": scale,
        "commit": commit(),
        "versions": versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": wall_s,
        "machine": f"{platform.machine()} {platform.system()}, {_cpus()} CPUs",
        "claims": [claim_record(r, scale) for r in runs],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    path.write_text(json.dumps(_clean(doc), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def _cpus() -> int | None:
    import os

    return os.cpu_count()

r"""The one verdict rule of every trained claim: a paired effect, its 95 % CI, a sanity gate.

A trained claim compares the paper's arms run by run: for every seed (or cross-validation
fold) that both arms ran, the difference ``d_i`` of their metric, signed so that ``d_i > 0``
is the paper's direction. Its mean and Student-t 95 % CI half-width

.. math:: \bar d \pm t_{0.975,\,n-1}\, s_d / \sqrt n

decide (:func:`judge_effect`):

* **reproduced**: the CI lies above 0 (the effect has the paper's sign beyond its noise);
* **not reproduced**: the CI lies below 0 (the opposite sign beyond its noise), or it lies
  below the paper's own effect (the effect, if any, is smaller than the paper's) — where the
  paper states only a direction, a CI reaching no higher than 0 (e.g. identical runs, 0 ± 0)
  excludes every effect in that direction;
* **inconclusive**: anything else — one run (no CI), a CI that straddles 0 and the paper's
  effect (underpowered: the reason says about how many runs would decide), and always when
  the sanity gate failed (:class:`Gate`: the best arm does not clearly beat a simple
  non-attention baseline, or sits at chance — the models did not learn enough for their
  difference to mean anything).

*Partially reproduced* exists only for claims with several parts (:func:`combine`): some
parts reproduced, not all. A single effect of the wrong sign is never "partially".

Every outcome comes with its reason in words, e.g. ``"undertrained: best arm 0.55 vs
logistic regression 0.97"`` or ``"underpowered: CI ± 3.2 vs the paper's effect 0.56; about
n = 120 runs needed"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from attnopt.claims._registry import Verdict

__all__ = [
    "Effect",
    "Gate",
    "Judgement",
    "paired_diffs",
    "effect_of",
    "runs_needed",
    "sanity_gate",
    "judge_effect",
    "combine",
    "arm_summary",
    "training_record",
]


def _t(n: int) -> float:
    """The two-sided 95 % Student-t quantile with ``n - 1`` degrees of freedom (``n >= 2``)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, n - 1))


@dataclass(frozen=True)
class Effect:
    """A per-run effect, signed so that > 0 is the paper's direction.

    Attributes:
        diffs: the paired per-run differences (or per-run values against a null of 0).
        mean: their mean (``nan`` without runs).
        half: the 95 % CI half-width (``None`` with fewer than two runs: no CI).
        paper: the paper's effect in the same units and sign (``None``: the paper gives only
            the direction).
    """

    diffs: tuple[float, ...]
    mean: float
    half: float | None
    paper: float | None

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def ci(self) -> tuple[float, float] | None:
        """``(low, high)`` of the 95 % CI, or ``None`` without one."""
        return None if self.half is None else (self.mean - self.half, self.mean + self.half)


def effect_of(diffs: Sequence[float], *, paper: float | None = None) -> Effect:
    """The :class:`Effect` of ``diffs`` (non-finite values raise: a NaN metric is a bug, not noise).

    Raises:
        ValueError: a non-finite difference, or a non-positive ``paper`` effect (it is signed
            in the paper's direction, so it is > 0 by definition).
    """
    xs = tuple(float(d) for d in diffs)
    if not all(math.isfinite(x) for x in xs):
        raise ValueError(f"diffs must be finite, got {xs}")
    if paper is not None and not paper > 0:
        raise ValueError(f"paper: the paper's effect, signed in its own direction, must be > 0; got {paper}")
    if not xs:
        return Effect(xs, math.nan, None, paper)
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Effect(xs, mean, None, paper)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return Effect(xs, mean, _t(n) * sd / math.sqrt(n), paper)


def paired_diffs(
    recs: Sequence[Mapping[str, Any]],
    better: str,
    base: str,
    metric: str,
    *,
    higher: bool = True,
) -> list[float]:
    """Per (seed, fold, lr, dataset) run both arms have: ``metric(better) - metric(base)``,
    negated when lower is better (so > 0 is the paper's direction), in run-key order."""

    def key(r: Mapping[str, Any]) -> tuple[Any, ...]:
        cfg = r.get("config") or {}
        return (r.get("seed"), r.get("fold", 0), r.get("dataset"), r.get("lr", cfg.get("lr")))

    def vals(arm: str) -> dict[tuple[Any, ...], float]:
        return {key(r): float(r["metrics"][metric]) for r in recs
                if r["arm"] == arm and metric in r.get("metrics", {})}

    a, b = vals(better), vals(base)
    sign = 1.0 if higher else -1.0
    common = sorted(set(a) & set(b), key=repr)
    return [sign * (a[k] - b[k]) for k in common]


def runs_needed(sd: float, target_half: float, *, cap: int = 100_000) -> int:
    """The smallest n whose 95 % CI half-width ``t_{n-1} sd / sqrt(n)`` is below ``target_half``.

    Returns ``cap`` when even that many runs would not do (or ``target_half <= 0``); 2 when
    ``sd == 0``.
    """
    if sd <= 0:
        return 2
    if not target_half > 0:
        return cap
    n = max(2, math.ceil((1.96 * sd / target_half) ** 2))
    while n < cap and _t(n) * sd / math.sqrt(n) >= target_half:
        n += 1
    return min(n, cap)


@dataclass(frozen=True)
class Gate:
    """The sanity gate: did the trained arms learn more than a simple non-attention baseline?

    Attributes:
        name: the baseline (``"logistic regression"``, ``"TF-IDF + logistic regression"``,
            ``"ridge"``, ``"copy the source"``, ``"majority class"``).
        value: its metric on the same split in the same run.
        best_arm, best: the best trained arm and its mean metric.
        higher: higher metric is better.
        margin: how much the best arm must beat the baseline by (metric units) — "clearly".
        chance: the metric of guessing (``None`` when undefined); an arm within ``margin`` of
            it sits at chance.
        required: whether the arm must beat the baseline. ``False`` for tasks where the
            baseline is a strong reference that attention models are not expected to beat at
            the stand-in's scale (then only chance is checked and the baseline is reported).
        noise: the best arm's seed/fold noise, the 95 % CI half-width of its mean over its
            runs (0: one run or not known). The arm must beat the baseline (and chance) by more
            than ``max(margin, noise)``: a lead within the arm's own run-to-run noise is no lead.
    """

    name: str
    value: float
    best_arm: str
    best: float
    higher: bool = True
    margin: float = 0.0
    chance: float | None = None
    required: bool = True
    noise: float = 0.0

    @property
    def needed(self) -> float:
        """The lead the best arm needs over the baseline and chance: ``max(margin, noise)``."""
        return max(self.margin, self.noise if math.isfinite(self.noise) else 0.0)

    @property
    def at_chance(self) -> bool:
        if self.chance is None:
            return False
        sign = 1.0 if self.higher else -1.0
        return not sign * (self.best - self.chance) > self.needed

    @property
    def beats_baseline(self) -> bool:
        sign = 1.0 if self.higher else -1.0
        return sign * (self.best - self.value) > self.needed

    @property
    def passed(self) -> bool:
        if not math.isfinite(self.best):
            return False
        return not self.at_chance and (self.beats_baseline or not self.required)

    @property
    def reason(self) -> str:
        """Why the gate failed (empty when it passed)."""
        if self.passed:
            return ""
        if not math.isfinite(self.best):
            return "undertrained: no arm has a finite metric"
        lead = f"; a lead of more than {self.needed:.3g} needed ({self._needed_why()})"
        if self.at_chance:
            return (f"undertrained: best arm {self.best_arm} {self.best:.4g} at chance ({self.chance:.4g})"
                    + lead)
        return (f"undertrained: best arm {self.best_arm} {self.best:.4g} vs {self.name} {self.value:.4g}"
                + lead)

    def _needed_why(self) -> str:
        if self.noise > self.margin:
            return f"the best arm's 95 % CI ± {self.noise:.3g} over its runs"
        return f"the stated margin {self.margin:.3g}"


def sanity_gate(
    arm_means: Mapping[str, float],
    *,
    name: str,
    value: float,
    higher: bool = True,
    margin: float = 0.0,
    chance: float | None = None,
    required: bool = True,
    noise: Mapping[str, float] | None = None,
) -> Gate:
    """The :class:`Gate` of the arms' mean metrics against the baseline ``name`` = ``value``;
    ``noise`` (arm -> 95 % CI half-width of its mean over its runs) sets the best arm's
    :attr:`Gate.noise` (missing or non-finite: 0)."""
    finite = {a: m for a, m in arm_means.items() if math.isfinite(m)}
    if not finite:
        return Gate(name, value, "-", math.nan, higher, margin, chance, required)
    pick = max if higher else min
    best_arm = pick(finite, key=lambda a: finite[a])
    h = (noise or {}).get(best_arm, 0.0)
    h = float(h) if h is not None and math.isfinite(h) else 0.0
    return Gate(name, value, best_arm, finite[best_arm], higher, margin, chance, required, h)


@dataclass(frozen=True)
class Judgement:
    """A verdict with its reason (one clause, e.g. ``"CI [0.1, 0.9] above 0"``)."""

    verdict: Verdict
    reason: str


def _f(x: float) -> str:
    return f"{x:.3g}"


def judge_effect(effect: Effect, *, gate: Gate | None = None, unit: str = "") -> Judgement:
    """The verdict of one effect (module docstring): reproduced / not reproduced / inconclusive.

    Args:
        effect: the paired effect (:func:`effect_of`), > 0 in the paper's direction.
        gate: the sanity gate of the runs; a failed gate makes the claim inconclusive whatever
            the effect.
        unit: the unit named in the reason (``"points"``, ``""``).
    """
    u = f" {unit}" if unit else ""
    if gate is not None and not gate.passed:
        return Judgement("inconclusive", gate.reason)
    if effect.n == 0:
        return Judgement("inconclusive", "no paired runs")
    if effect.half is None:
        return Judgement("inconclusive", f"one run (effect {_f(effect.mean)}{u}): no CI")
    lo, hi = effect.mean - effect.half, effect.mean + effect.half
    ci = f"effect {_f(effect.mean)} ± {_f(effect.half)}{u} (n = {effect.n})"
    if lo > 0:
        return Judgement("reproduced", f"{ci}: CI above 0, the paper's direction")
    if hi < 0:
        return Judgement("not reproduced", f"{ci}: the opposite sign beyond the CI")
    if effect.paper is not None and hi < effect.paper:
        return Judgement("not reproduced", f"{ci}: CI excludes the paper's effect {_f(effect.paper)}{u}")
    if effect.paper is None and hi <= 0:  # e.g. identical runs: 0 ± 0 excludes every effect > 0
        return Judgement("not reproduced", f"{ci}: CI excludes every effect in the paper's direction")
    if effect.paper is None:
        return Judgement("inconclusive", f"underpowered: {ci}, the CI includes 0")
    sd = effect.half * math.sqrt(effect.n) / _t(effect.n)
    need = runs_needed(sd, effect.paper / 2)
    return Judgement(
        "inconclusive",
        f"underpowered: CI ± {_f(effect.half)}{u} vs the paper's effect {_f(effect.paper)}{u} "
        f"(n = {effect.n}); about n = {need} runs needed",
    )


def combine(parts: Mapping[str, Judgement]) -> Judgement:
    """The verdict of a claim with several parts.

    Reproduced: every part is. Partially reproduced: some part is (or is itself partially
    reproduced), not all — the claim holds in part. Not reproduced: some part is
    contradicted and none reproduced. Inconclusive: every part inconclusive. The reason lists
    every part.
    """
    if not parts:
        return Judgement("inconclusive", "no parts")
    if len(parts) == 1:
        return next(iter(parts.values()))
    vs = [j.verdict for j in parts.values()]
    reasons = {j.reason for j in parts.values()}
    if len(set(vs)) == 1 and len(reasons) == 1:  # e.g. one failed sanity gate behind every part
        return Judgement(vs[0], reasons.pop())
    reason = "; ".join(f"{k}: {j.verdict} ({j.reason})" for k, j in parts.items())
    if all(v == "reproduced" for v in vs):
        return Judgement("reproduced", reason)
    if "reproduced" in vs or "partially reproduced" in vs:
        return Judgement("partially reproduced", reason)
    if "not reproduced" in vs:
        return Judgement("not reproduced", reason)
    return Judgement("inconclusive", reason)


# ---- the machine-readable record (report.json's "training") ------------------------------------
def arm_summary(values: Sequence[float]) -> dict[str, Any]:
    """``{"mean", "ci95", "n"}`` of one arm's per-run values (``ci95`` is ``None`` for n < 2)."""
    e = effect_of(values)
    return {
        "mean": None if e.n == 0 else e.mean,
        "ci95": e.half,
        "n": e.n,
    }


def training_record(
    *,
    metric: str,
    higher_is_better: bool,
    arms: Mapping[str, Sequence[float]],
    gate: Gate | None,
    effect: Effect | None,
) -> dict[str, Any]:
    """The ``training`` record of report.json: the arms, the baseline and the effect."""
    return {
        "metric": metric,
        "higher_is_better": higher_is_better,
        "arms": {a: arm_summary(v) for a, v in arms.items() if v},
        "baseline": None if gate is None else {"name": gate.name, "value": gate.value,
                                                "passed": gate.passed, "margin": gate.needed},
        "effect": None if effect is None else {
            "paper": effect.paper,
            "measured": None if effect.n == 0 else effect.mean,
            "ci95": effect.half,
            "n": effect.n,
        },
    }

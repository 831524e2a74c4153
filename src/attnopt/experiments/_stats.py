"""Statistics of training results: mean and 95 % confidence interval over seeds."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["mean_ci", "format_ci"]


def mean_ci(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float]:
    r"""Mean and Student-t confidence half-width of ``values``.

    .. math:: \bar x \pm t_{(1+c)/2,\,n-1}\, s / \sqrt n

    ``s`` is the sample standard deviation (``ddof = 1``). With one value the half-width is
    ``0.0`` (no spread can be estimated; never NaN) — report ``n`` beside it.

    Raises:
        ValueError: no values, a non-finite value, or ``confidence`` not in (0, 1).
    """
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_ci needs at least one value")
    if not all(math.isfinite(x) for x in xs):
        raise ValueError(f"mean_ci got a non-finite value: {xs}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    n = len(xs)
    mean = sum(xs) / n
    if n == 1:
        return mean, 0.0
    from scipy import stats

    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    t = float(stats.t.ppf(0.5 + confidence / 2, n - 1))
    return mean, t * sd / math.sqrt(n)


def format_ci(values: Iterable[float], digits: int = 3) -> str:
    """``"mean ± half (n=k)"`` for a Markdown table (``"mean ± — (n=1)"``: one run has no interval)."""
    xs = list(values)
    m, h = mean_ci(xs)
    return f"{m:.{digits}f} ± " + ("—" if len(xs) < 2 else f"{h:.{digits}f}") + f" (n={len(xs)})"

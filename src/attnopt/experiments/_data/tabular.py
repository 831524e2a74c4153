r"""Regression data for implicit-kernel-attention Table 4 (offline): series windows and tabular rows.

Every example is a short set of tokens for a Transformer regressor, ``x (N, input_dim)``:

- ``co2`` — the Mauna Loa CO2 record that ``statsmodels`` ships (the paper's "CO2" column),
  weekly 1958–2001, averaged to months (gaps filled by linear interpolation): 526 values.
  An example is the ``window`` previous months relative to the last one, token
  ``t = [(value_t − value_last)/s, (t − window)/window]``, the target the next month's change
  ``value_next − value_last`` (the trend makes raw levels of a held-out block fall outside the
  training range; the changes are stationary, and predicting the change is predicting the value).
- ``sunspots`` — the yearly sunspot numbers ``statsmodels`` ships (1700–2008), windowed the
  same way (a periodic series, like the paper's "Passenger").
- ``diabetes`` — scikit-learn's bundled diabetes data (442 × 10): one token per feature,
  ``t_j = [x_j, onehot(j)]`` (a feature tokenizer), the target the disease progression.

Cross-validation: ``diabetes`` uses shuffled ``sklearn.model_selection.KFold``; the series
use contiguous blocks (``KFold`` without shuffling over the targets) and drop from training
every window that touches the test block (its inputs or target), so no test value is ever
seen in training. Values and targets are standardized with the training fold's statistics;
RMSE is reported on the standardized target (units: training-fold standard deviations).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["RegressionFold", "REGRESSION_DATASETS", "regression_fold", "load_series"]

REGRESSION_DATASETS = ("co2", "diabetes", "sunspots")


@lru_cache(maxsize=4)
def load_series(name: str) -> np.ndarray:
    """The raw series (float64, 1-D, no NaN): ``"co2"`` monthly or ``"sunspots"`` yearly.

    Raises:
        ValueError: unknown name.
    """
    if name == "co2":
        from statsmodels.datasets import co2

        s = co2.load_pandas().data["co2"].resample("MS").mean().interpolate("linear")
        return s.to_numpy(dtype=np.float64)
    if name == "sunspots":
        from statsmodels.datasets import sunspots

        return sunspots.load_pandas().data["SUNACTIVITY"].to_numpy(dtype=np.float64)
    raise ValueError(f"series must be 'co2' or 'sunspots', got {name!r}")


@dataclass(frozen=True)
class RegressionFold:
    """One cross-validation fold.

    Attributes:
        x_train, x_test: (n, N, input_dim) float32 token sets.
        y_train, y_test: (n,) float32 standardized targets.
        train_index, test_index: example indices (windows for series, rows for tabular).
        test_targets: the raw-unit positions of the test targets (series time index, or row).
        y_scale: the training fold's target standard deviation (to convert RMSE to raw units).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    train_index: np.ndarray
    test_index: np.ndarray
    y_scale: float


def _windows(series: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs (n, window) and next values (n,) of every full window."""
    n = len(series) - window
    idx = np.arange(window)[None, :] + np.arange(n)[:, None]
    return series[idx], series[window:]


def regression_fold(
    name: str, *, fold: int, folds: int = 10, window: int = 12, seed: int = 0
) -> RegressionFold:
    """Fold ``fold`` of ``folds``-fold CV on data set ``name`` (see module docstring).

    Args:
        name: ``"co2"``, ``"sunspots"`` or ``"diabetes"``.
        fold: ``0 <= fold < folds``.
        folds: number of folds (>= 2).
        window: history length of series examples (>= 2); ignored for ``diabetes``.
        seed: shuffling seed of the ``diabetes`` folds; series folds are contiguous.
    Raises:
        ValueError: unknown name, bad fold/folds/window.
    """
    from sklearn.model_selection import KFold

    if name not in REGRESSION_DATASETS:
        raise ValueError(f"dataset must be one of {REGRESSION_DATASETS}, got {name!r}")
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    if not 0 <= fold < folds:
        raise ValueError(f"fold must be in [0, {folds}), got {fold}")
    if name == "diabetes":
        from sklearn.datasets import load_diabetes

        x_raw, y_raw = load_diabetes(return_X_y=True)
        tr, te = list(KFold(folds, shuffle=True, random_state=seed).split(x_raw))[fold]
        mu, sd = x_raw[tr].mean(0), x_raw[tr].std(0) + 1e-12
        xs = (x_raw - mu) / sd
        d = xs.shape[1]
        tokens = np.concatenate([xs[:, :, None], np.broadcast_to(np.eye(d), (len(xs), d, d))], axis=-1)
        y = y_raw
    else:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        series = load_series(name)
        inputs, y = _windows(series, window)
        _, te = list(KFold(folds, shuffle=False).split(inputs))[fold]
        lo, hi = te.min(), te.max() + window  # series positions read by test windows (inputs + target)
        starts = np.arange(len(inputs))
        touches = (starts + window >= lo) & (starts <= hi)
        tr = starts[~touches]
        used = np.unique(np.concatenate([np.arange(s, s + window + 1) for s in tr]))
        sd = np.diff(series[used]).std() + 1e-12
        last = inputs[:, -1:]
        vals = (inputs - last) / sd
        y = y - last[:, 0]
        pos = (np.arange(window) - window) / window
        tokens = np.stack([vals, np.broadcast_to(pos, vals.shape)], axis=-1)
    y_mu, y_sd = y[tr].mean(), y[tr].std() + 1e-12
    ys = (y - y_mu) / y_sd
    return RegressionFold(
        x_train=tokens[tr].astype(np.float32),
        y_train=ys[tr].astype(np.float32),
        x_test=tokens[te].astype(np.float32),
        y_test=ys[te].astype(np.float32),
        train_index=np.asarray(tr),
        test_index=np.asarray(te),
        y_scale=float(y_sd),
    )

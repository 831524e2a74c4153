"""The backend cell (internal): which implementation family :func:`attnopt.backend` forces.

A one-element list at module level (``torch.compile`` guards on it like any global), kept in
this leaf module so that :mod:`attnopt._native` (below every family) can read it without
importing :mod:`attnopt.functional`: under ``"reference"`` no C kernel runs anywhere.
The API is :func:`attnopt.functional.dispatch.backend` / ``current_backend``.
"""
from __future__ import annotations

__all__ = ["BACKEND"]

BACKEND: list[str] = ["auto"]

"""Measuring attention: hooks, dual deviation, decomposition, column mass, policy views."""

from attnopt.analysis.column_mass import column_mass

__all__: list[str] = [
    "column_mass",
]

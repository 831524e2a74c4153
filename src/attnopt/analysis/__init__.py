"""Measuring attention: hooks, dual deviation, decomposition, column mass, policy views."""

from attnopt.analysis.column_mass import column_mass
from attnopt.analysis.decompose import Decomposition, decompose, decompose_gat

__all__: list[str] = [
    "column_mass",
    "Decomposition",
    "decompose",
    "decompose_gat",
]

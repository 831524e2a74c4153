"""Measuring attention: hooks, dual deviation, decomposition, column mass, policy views."""

from attnopt.analysis.column_mass import column_mass
from attnopt.analysis.decompose import Decomposition, decompose, decompose_gat
from attnopt.analysis.mode_collapse import count_clusters, iterate_attention, mode_collapse_distance

__all__: list[str] = [
    "column_mass",
    "count_clusters",
    "iterate_attention",
    "mode_collapse_distance",
    "Decomposition",
    "decompose",
    "decompose_gat",
]

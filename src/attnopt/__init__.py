"""attnopt: attention mechanisms that are solutions of optimization problems.

The functional ops (``attnopt.functional``) are re-exported here; modules live in
``attnopt.nn``, exact solvers in ``attnopt.dual``, measurement tools in ``attnopt.analysis``.
"""
from attnopt.functional import generalized_attention, generalized_weights, ot_attention, ot_weights

__version__ = "0.1.0"

__all__ = [
    "generalized_attention",
    "generalized_weights",
    "ot_attention",
    "ot_weights",
]

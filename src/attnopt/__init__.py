"""attnopt: attention mechanisms that are solutions of optimization problems.

The functional ops (``attnopt.functional``) are re-exported here; modules live in
``attnopt.nn``, exact solvers in ``attnopt.dual``, measurement tools in ``attnopt.analysis``.
"""
from attnopt import analysis, dual, functional, kernels, nn
from attnopt.dual import mem_attention, mem_weights, solve_mem
from attnopt.functional import (
    Shannon,
    SquaredL2,
    Tsallis,
    compiled,
    doubly_normalized_attention,
    doubly_normalized_weights,
    entmax,
    entmax15,
    entmax_bisect,
    generalized_attention,
    generalized_weights,
    hybrid_normalized_attention,
    hybrid_normalized_weights,
    kernel_attention,
    kernel_weights,
    ot_attention,
    ot_weights,
    regularized_attention,
    regularized_attention_weights,
    regularized_weights,
    softmax_weights,
    sparsemax,
)
from attnopt.functional.dispatch import backend

__version__ = "0.1.0"

__all__ = [
    "analysis",
    "backend",
    "dual",
    "functional",
    "kernels",
    "nn",
    "compiled",
    "Shannon",
    "SquaredL2",
    "Tsallis",
    "entmax",
    "entmax15",
    "entmax_bisect",
    "regularized_attention",
    "regularized_attention_weights",
    "regularized_weights",
    "softmax_weights",
    "sparsemax",
    "mem_attention",
    "mem_weights",
    "solve_mem",
    "doubly_normalized_attention",
    "doubly_normalized_weights",
    "hybrid_normalized_attention",
    "hybrid_normalized_weights",
    "generalized_attention",
    "generalized_weights",
    "kernel_attention",
    "kernel_weights",
    "ot_attention",
    "ot_weights",
]

"""Pure tensor functions: one mechanism per module, no ``nn.Module`` here.

Conventions: ``q (B,H,Nq,d)``, ``k (B,H,Nk,d)``, ``v (B,H,Nk,dv)``, weights ``(B,H,Nq,Nk)``;
scores ``<q_i,k_j>*scale`` with ``scale = 1/sqrt(d)`` by default; boolean masks use SDPA's
convention (``True`` = take part), float masks are added to the scores.
"""
from attnopt.functional._compiled import compiled, cpu_compiler, inductor_available
from attnopt.functional.doubly_normalized import (
    doubly_normalized_attention,
    doubly_normalized_weights,
    hybrid_normalized_attention,
    hybrid_normalized_weights,
)
from attnopt.functional.entmax import entmax, entmax15, entmax_bisect, sparsemax
from attnopt.functional.generalized import generalized_attention, generalized_weights
from attnopt.functional.kernel import kernel_attention, kernel_weights
from attnopt.functional.losses import entmax_loss, sparsemax_loss, tsallis_negentropy
from attnopt.functional.ot import ot_attention, ot_weights
from attnopt.functional.regularized import (
    locality_bias,
    regularized_attention,
    regularized_attention_weights,
    regularized_weights,
    softmax_weights,
)
from attnopt.functional.regularizers import Regularizer, Shannon, SquaredL2, Tsallis

__all__ = [
    "compiled",
    "cpu_compiler",
    "inductor_available",
    "entmax",
    "entmax15",
    "entmax_bisect",
    "sparsemax",
    "entmax_loss",
    "sparsemax_loss",
    "tsallis_negentropy",
    "softmax_weights",
    "regularized_weights",
    "regularized_attention",
    "regularized_attention_weights",
    "locality_bias",
    "Regularizer",
    "Shannon",
    "SquaredL2",
    "Tsallis",
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

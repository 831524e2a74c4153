"""Pure tensor functions, one folder per mechanism family, no ``nn.Module`` here.

Each family folder (``doubly_normalized/``, ``regularized/``, ...) holds its public ops and the one
router that picks an implementation in its ``__init__.py``, a plain-PyTorch ``reference.py`` and one
file per fast implementation; every size threshold is in :mod:`._thresholds`.

Conventions: ``q (B,H,Nq,d)``, ``k (B,H,Nk,d)``, ``v (B,H,Nk,dv)``, weights ``(B,H,Nq,Nk)``;
scores ``<q_i,k_j>*scale`` with ``scale = 1/sqrt(d)`` by default; boolean masks use SDPA's
convention (``True`` = take part), float masks are added to the scores.
"""
import sys

from attnopt.functional._compiled import compiled, cpu_compiler, inductor_available
from attnopt.functional.doubly_normalized import (
    doubly_normalized_attention,
    doubly_normalized_weights,
    hybrid_normalized_attention,
    hybrid_normalized_weights,
)
from attnopt.functional.generalized import generalized_attention, generalized_weights
from attnopt.functional.kernel import kernel_attention, kernel_weights
from attnopt.functional.kernel import linear as kernel_linear
from attnopt.functional.ot import ot_attention, ot_weights
from attnopt.functional.regularized import (
    _maps,
    entmax,
    entmax15,
    entmax_bisect,
    locality_bias,
    losses,
    regularized_attention,
    regularized_attention_weights,
    regularized_weights,
    regularizers,
    softmax_weights,
    sparsemax,
)
from attnopt.functional.regularized.losses import entmax_loss, sparsemax_loss, tsallis_negentropy
from attnopt.functional.regularized.regularizers import Regularizer, Shannon, SquaredL2, Tsallis

# the flat modules of earlier versions stay importable under their old names (the same module
# objects): ``attnopt.functional.entmax`` (the attribute stays the function ``entmax``),
# ``attnopt.functional.losses``, ``attnopt.functional.regularizers`` and
# ``attnopt.functional.kernel_linear``
sys.modules[f"{__name__}.entmax"] = _maps
sys.modules[f"{__name__}.kernel_linear"] = kernel_linear
sys.modules[f"{__name__}.losses"] = losses
sys.modules[f"{__name__}.regularizers"] = regularizers

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

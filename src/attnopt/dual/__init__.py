"""Exact solvers: MEM / Fenchel dual (Newton), OT dual, generic regularized maps.

Each solver returns a frozen dataclass with the solution and its convergence diagnostics
(``iterations``, ``converged``, ``grad_norm``); non-convergence also warns.
"""

from attnopt.dual.mem import (
    GaussianMEM,
    MEMSolution,
    approx_lambda,
    gaussian_mem,
    mem_dual_objective,
    mem_primal_objective,
    solve_mem,
)
from attnopt.dual.mem_attention import mem_attention, mem_estimate, mem_weights
from attnopt.dual.ot import OTMEMSolution, solve_ot_mem, true_preference
from attnopt.dual.regularized import RegularizedSolution, solve_regularized

__all__: list[str] = [
    "GaussianMEM",
    "MEMSolution",
    "approx_lambda",
    "gaussian_mem",
    "mem_dual_objective",
    "mem_primal_objective",
    "solve_mem",
    "mem_attention",
    "mem_estimate",
    "mem_weights",
    "OTMEMSolution",
    "solve_ot_mem",
    "true_preference",
    "RegularizedSolution",
    "solve_regularized",
]

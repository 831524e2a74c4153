"""Measuring attention: hooks, dual deviation, decomposition, column mass, policy views."""

from attnopt.analysis.column_mass import column_mass
from attnopt.analysis.decompose import Decomposition, decompose, decompose_gat
from attnopt.analysis.dual_deviation import (
    DualDeviation,
    DualMapping,
    dual_deviation,
    eq19_mapping,
    map_captured,
)
from attnopt.analysis.hooks import AttentionSite, CapturedAttention, capture_attention, find_attention_sites
from attnopt.analysis.lenses import HeadLenses, attention_entropy, effective_support, head_lenses
from attnopt.analysis.mode_collapse import count_clusters, iterate_attention, mode_collapse_distance
from attnopt.analysis.policy import (
    PolicyRecord,
    PolicyView,
    advantages,
    fisher_matrix,
    logsumexp_hessian,
    natural_gradient_form,
    policy_gradient,
    policy_probe,
    policy_view,
)

__all__: list[str] = [
    "PolicyRecord",
    "PolicyView",
    "advantages",
    "fisher_matrix",
    "logsumexp_hessian",
    "natural_gradient_form",
    "policy_gradient",
    "policy_probe",
    "policy_view",
    "column_mass",
    "count_clusters",
    "iterate_attention",
    "mode_collapse_distance",
    "Decomposition",
    "decompose",
    "decompose_gat",
    "AttentionSite",
    "CapturedAttention",
    "capture_attention",
    "find_attention_sites",
    "DualDeviation",
    "DualMapping",
    "dual_deviation",
    "eq19_mapping",
    "map_captured",
    "HeadLenses",
    "attention_entropy",
    "effective_support",
    "head_lenses",
]

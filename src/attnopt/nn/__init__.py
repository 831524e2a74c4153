"""``nn.Module`` s: preference modules and multi-head attention wrappers built on ``functional``.

Multi-head modules follow ``torch.nn.MultiheadAttention(batch_first=True)``:
``forward(query, key=None, value=None, *, key_padding_mask=None, attn_mask=None,
need_weights=False, is_causal=False, query_padding_mask=None) -> (output, weights | None)``
(``query_padding_mask`` is an attnopt addition: padding as O(N) masks, no ``Nq × Nk`` mask).
"""

from attnopt.nn.doubly_normalized import (
    DoublyNormalizedMultiheadAttention,
    HybridNormalizedMultiheadAttention,
)
from attnopt.nn.generalized import GeneralizedMultiheadAttention
from attnopt.nn.implicit_kernel import ImplicitKernelAttention
from attnopt.nn.kernel import KernelMultiheadAttention
from attnopt.nn.losses import EntmaxLoss, SparsemaxLoss
from attnopt.nn.mem import MEMAttention, MEMEstimate
from attnopt.nn.ot import OTAttention
from attnopt.nn.preference import (
    ALiBiPreference,
    KeyPreference,
    PreferenceModule,
    T5RelativePreference,
)
from attnopt.nn.registry import AttentionSpec, attention_names, attention_spec, make_attention
from attnopt.nn.regularized import RegularizedMultiheadAttention

__all__: list[str] = [
    "ALiBiPreference",
    "AttentionSpec",
    "DoublyNormalizedMultiheadAttention",
    "EntmaxLoss",
    "GeneralizedMultiheadAttention",
    "HybridNormalizedMultiheadAttention",
    "ImplicitKernelAttention",
    "KernelMultiheadAttention",
    "KeyPreference",
    "MEMAttention",
    "MEMEstimate",
    "OTAttention",
    "PreferenceModule",
    "RegularizedMultiheadAttention",
    "SparsemaxLoss",
    "T5RelativePreference",
    "attention_names",
    "attention_spec",
    "make_attention",
]

"""``nn.Module`` s: preference modules and multi-head attention wrappers built on ``functional``.

Multi-head modules follow ``torch.nn.MultiheadAttention(batch_first=True)``:
``forward(query, key=None, value=None, key_padding_mask=None, need_weights=False, attn_mask=None,
average_attn_weights=True, is_causal=False, *, query_padding_mask=None) -> (output, weights | None)``
with unbatched ``(N, E)`` inputs too, and the constructor options ``dropout``, ``bias``, ``kdim``,
``vdim``. ``need_weights`` defaults to ``False`` (PyTorch: ``True``) because the mechanisms' fast
paths never form the ``Nq × Nk`` weights; ``query_padding_mask`` is an attnopt addition (padding
as O(N) masks, no ``Nq × Nk`` mask).

The entmax-package-style activations :class:`Sparsemax`, :class:`Entmax15` and
:class:`EntmaxBisect` are here too.
"""

from attnopt.nn.doubly_normalized import (
    DoublyNormalizedMultiheadAttention,
    HybridNormalizedMultiheadAttention,
)
from attnopt.nn.entmax import Entmax15, EntmaxBisect, Sparsemax
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
    "Entmax15",
    "EntmaxBisect",
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
    "Sparsemax",
    "SparsemaxLoss",
    "T5RelativePreference",
    "attention_names",
    "attention_spec",
    "make_attention",
]

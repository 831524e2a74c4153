"""Reference models with the attention chosen by registry name (plain ``nn.Module`` s, no Lightning).

* :class:`TransformerEncoder` — pre-LN encoder over tokens or features, classification /
  regression head;
* :class:`EncoderDecoder` — causal decoder with cross-attention, greedy and beam decoding;
* :class:`ViT` — Vision Transformer, optionally with an OT-based last layer (OT-ViT);
* :func:`auxiliary_loss` — the mechanisms' extra loss terms (IKA variants' KL) of a model.
"""

from attnopt.models._blocks import DecoderBlock, EncoderBlock, auxiliary_loss
from attnopt.models.encoder import TransformerEncoder
from attnopt.models.seq2seq import EncoderDecoder
from attnopt.models.vit import ViT

__all__ = ["DecoderBlock", "EncoderBlock", "EncoderDecoder", "TransformerEncoder", "ViT", "auxiliary_loss"]

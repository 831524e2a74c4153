"""Tiny randomly initialized Hugging Face models for the analysis / integration tests.

No weights are downloaded: every model is built from a small config with a fixed seed.
"""
from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_bert(seed: int = 0, *, vocab_size: int = 99, layers: int = 2, attn: str = "eager",
              init_range: float = 0.02):
    """A 2-layer, 4-head, width-32 BERT in eval mode (``init_range``: weight init std)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=37,
                     vocab_size=vocab_size, max_position_embeddings=64, attn_implementation=attn,
                     initializer_range=init_range)
    return BertModel(cfg).eval()


def tiny_t5(seed: int = 0, *, attn: str = "eager"):
    """A 2-layer, 4-head, width-32 T5 encoder-decoder (relative position bias) in eval mode."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(d_model=32, d_kv=8, num_heads=4, d_ff=37, num_layers=2, vocab_size=99,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   decoder_start_token_id=0, attn_implementation=attn)
    return T5ForConditionalGeneration(cfg).eval()


def padded_batch(seed: int = 0, *, vocab_size: int = 99, n: int = 7):
    """``(input_ids (2, n), attention_mask)`` where the second row has 2 padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (2, n), generator=g)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, n - 2:] = 0
    ids[1, n - 2:] = 0
    return ids, mask

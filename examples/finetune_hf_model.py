"""Swap the attention of a Hugging Face model for an attnopt mechanism and fine-tune it.

``attnopt.integrations.hf.register()`` adds every parameter-free mechanism to transformers'
``AttentionInterface`` (``attnopt_dnas``, ``attnopt_sinkhorn``, ``attnopt_hnas``,
``attnopt_sparsemax``, ``attnopt_entmax``, ``attnopt_softmax`` ...), each with its mask function;
``model.set_attn_implementation(name)`` then swaps the attention of every layer. The model's
own attention dropout is applied to the new weights in ``train()`` mode, so fine-tuning works as
with SDPA.

To stay offline and fast, the model here is a small randomly initialized BERT built from a
config (no download); with a local checkpoint use
``AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="attnopt_dnas")``
after ``register()``::

    python examples/finetune_hf_model.py --attention attnopt_sparsemax --steps 30
"""
from __future__ import annotations

import argparse
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_batch(n: int, generator: torch.Generator, vocab: int = 50, length: int = 10):
    """Token sequences (1 = [PAD]) labelled by whether token 5 occurs."""
    ids = torch.randint(6, vocab, (n, length), generator=generator)
    label = torch.rand(n, generator=generator) < 0.5
    ids[label, torch.randint(0, 5, (n,), generator=generator)[label]] = 5
    lengths = torch.randint(6, length + 1, (n,), generator=generator)
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids[mask == 0] = 1
    return ids, mask, label.long()


def main(argv: list[str] | None = None) -> tuple[float, float]:
    from transformers import BertConfig, BertForSequenceClassification

    from attnopt.integrations import hf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="attnopt_dnas")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)

    report = hf.register()
    if args.attention not in report.registered:
        parser.error(f"--attention must be one of {', '.join(report.registered)}")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, pad_token_id=1,
                        attention_probs_dropout_prob=0.1, num_labels=2)
    model = BertForSequenceClassification(config)
    model.set_attn_implementation(args.attention)  # every layer now runs the attnopt mechanism
    print(f"attention: {model.config._attn_implementation}")

    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()  # attention dropout 0.1 acts on the attnopt weights
    losses = []
    for step in range(args.steps):
        ids, mask, labels = make_batch(32, gen)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"mean loss of the first 5 steps {first:.3f}, of the last 5 {last:.3f}")
    return first, last


if __name__ == "__main__":
    main()

"""Drop an attnopt mechanism into your own model and train it.

A small Transformer classifier whose attention is chosen by registry name (``--attention``:
``softmax``, ``dnas``, ``sparsemax``, ``entmax``, ``ikan``, ... — ``attnopt.nn.attention_names()``).
Each module has the ``nn.MultiheadAttention(batch_first=True)`` call convention and takes its
options (``dropout``, ``bias``, ``kdim``, ``vdim``), so it replaces ``nn.MultiheadAttention``
line for line. The task (is the token 1 present in the sequence?) is generated, so the script
runs offline in a few seconds on a CPU::

    python examples/train_your_model.py --attention dnas --steps 60
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from attnopt.nn import attention_names, make_attention


class Block(nn.Module):
    """Pre-norm Transformer block with any registry attention."""

    def __init__(self, attention: str, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # the one line that differs from a plain Transformer:
        #   nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.attn = make_attention(attention, dim, heads, dropout=dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=padding, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Classifier(nn.Module):
    def __init__(self, attention: str, vocab: int = 16, dim: int = 32, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, 64, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(attention, dim, heads, dropout) for _ in range(2))
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padding = tokens == 0  # True = padding, as nn.MultiheadAttention
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x, padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))  # mean over real tokens


def batch(n: int, generator: torch.Generator, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of tokens 2..15 (padded with 0 to random lengths); label: does token 2 occur?"""
    tokens = torch.randint(3, 16, (n, length), generator=generator)
    label = torch.rand(n, generator=generator) < 0.5
    where = torch.randint(0, 6, (n,), generator=generator)
    tokens[label, where[label]] = 2
    lengths = torch.randint(6, length + 1, (n,), generator=generator)
    tokens[torch.arange(length) >= lengths[:, None]] = 0
    return tokens, label.long()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="dnas", choices=attention_names())
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = Classifier(args.attention)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    test_x, test_y = batch(512, torch.Generator().manual_seed(12345))
    for step in range(args.steps):
        model.train()
        x, y = batch(64, gen)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        accuracy = (model(test_x).argmax(-1) == test_y).float().mean().item()
    print(f"{args.attention}: test accuracy {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()

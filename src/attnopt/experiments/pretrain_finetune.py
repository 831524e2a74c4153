"""Pretraining + fine-tuning, doubly-normalized-attention Sec. 7.3: Table 3 and Fig. 4.

A small BERT-style encoder is pretrained by masked-language modelling with n-gram masking
(n ≤ 3, each span's length drawn uniformly from {1, 2, 3}, as the paper after Joshi et al.
2019; 15 % of the tokens, 80/10/10 mask/random/keep) with LNAS or HNAS attention in every
layer, then fine-tuned (all weights) on two downstream tasks:

* ``cls`` — single-text classification: which module a docstring comes from (the K modules
  with the most docstrings; the stand-in for a GLUE single-sentence task). Docstrings that
  name their own module (``docstrings.names_module``: "turtle", "RawTurtle", "IMAP4", ...)
  are left out of this task — the label could be copied from the text — and the K modules
  are counted among the rest;
* ``pair`` — sentence pair: does this first sentence belong to this body? (positives: the
  docstring's own pair; negatives: the first sentence of another docstring; balanced; the
  entailment-style stand-in for MNLI).

Data (offline): the standard-library docstring corpus of :mod:`attnopt.experiments._data.docstrings`,
MiniLM word-pieces. One fixed split by record (seed 0): pretraining sees only the training
records' text (``max_train`` of them), the downstream sets are built from all training
records and from the test records. Reported per arm:
the MLM loss on the test records (mask drawn with a fixed seed), the two downstream
accuracies, and (Fig. 4) the HNAS weight of every layer after pretraining (``hnas_w/<layer>``).

Runtime (full mode, 2 arms × 5 seeds): ≈ 40 CPU-minutes. Pretraining 0.20 s (LNAS) / 0.23 s
(HNAS) per step × 72 steps × 12 epochs; fine-tuning 0.12 / 0.15 s per step × (27 + 40) steps × 5
epochs. Measured on this 2-core machine while other jobs loaded it (load average 8–14), one
torch thread, median of 8 training steps, evaluation timed on its first batches and scaled; the
full-mode time is extrapolated (steps per epoch × epochs × seeds × arms), not a completed run.
CPU time at one thread is what a quiet machine needs in wall time (``attnopt train ... --threads
1``); under that load the wall time was 5–7× larger. The previous full config (d=128, 128
pieces, 40 + 10 epochs) extrapolated to ≈ 500 CPU-minutes, hence the reduction (d=64 × 4 layers
— depth kept for Fig. 4 —, 64 pieces, 12 + 5 epochs).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import random
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from attnopt.experiments._data.cache import cached
from attnopt.experiments._diagnostics import column_mass_over, hnas_weights
from attnopt.experiments._task import DataBundle, RunConfig, Scale, Task, dataset_len
from attnopt.experiments.headline import pad_batch

if TYPE_CHECKING:
    from attnopt.models import TransformerEncoder

__all__ = ["PretrainFinetuneTask", "TASK", "ngram_mask"]

# Table 3: SQuAD 1.1 F1/EM, SQuAD 2.0 F1/EM, MNLI accuracy (BERT-base scale); "bert-base" is the
# paper's reference row (Devlin et al.), not an arm here
PAPER_TABLE3 = {
    "bert-base": {"squad1_f1": 90.5, "squad1_em": 83.3, "squad2_f1": 80.3, "squad2_em": 77.3, "mnli": 84.1},
    "lnas": {"squad1_f1": 90.5, "squad1_em": 83.6, "squad2_f1": 80.3, "squad2_em": 77.0, "mnli": 84.3},
    "hnas": {"squad1_f1": 90.9, "squad1_em": 84.0, "squad2_f1": 80.5, "squad2_em": 77.4, "mnli": 84.7},
}
PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4


def ngram_mask(ids: Tensor, *, vocab_size: int, generator: torch.Generator, rate: float = 0.15,
               max_n: int = 3) -> tuple[Tensor, Tensor]:
    """n-gram masking for MLM (SpanBERT-style, paper Sec. 7.3).

    Spans of length ``n ~ U{1..max_n}`` start at random real (non-special) positions until
    about ``rate`` of each sequence's real tokens are chosen; chosen tokens become ``[MASK]``
    (80 %), a random token (10 %) or stay (10 %).

    Args:
        ids: (B, N) compact ids (0 = pad, 2 = [CLS], 3 = [SEP] are never chosen).
    Returns:
        ``(inputs (B, N), labels (B, N))`` with ``labels = -100`` where nothing is predicted.
    """
    inputs, labels = ids.clone(), torch.full_like(ids, -100)
    real = ids > MASK
    for b in range(ids.shape[0]):
        pos = real[b].nonzero().flatten()
        if len(pos) == 0:
            continue
        budget = max(1, round(rate * len(pos)))
        chosen: set[int] = set()
        for _ in range(4 * budget):
            if len(chosen) >= budget:
                break
            n = int(torch.randint(1, max_n + 1, (), generator=generator))
            start = int(pos[int(torch.randint(len(pos), (), generator=generator))])
            for j in range(start, min(start + n, ids.shape[1])):
                if real[b, j] and len(chosen) < budget:
                    chosen.add(j)
        idx = torch.tensor(sorted(chosen))
        labels[b, idx] = ids[b, idx]
        u = torch.rand(len(idx), generator=generator)
        rnd = torch.randint(MASK + 1, vocab_size, (len(idx),), generator=generator)
        keep_or_random = torch.where(u < 0.9, rnd, ids[b, idx])
        inputs[b, idx] = torch.where(u < 0.8, torch.full_like(idx, MASK), keep_or_random)
    return inputs, labels


def _collate_mlm(items: list[Tensor], vocab_size: int) -> dict[str, Any]:
    ids, mask = pad_batch(items)
    return {"stage": "pretrain", "ids": ids, "mask": mask, "vocab_size": vocab_size}


def _collate_cls(items: list[tuple[Tensor, int]]) -> dict[str, Any]:
    ids, mask = pad_batch([x for x, _ in items])
    return {"stage": "finetune", "ids": ids, "mask": mask, "label": torch.tensor([y for _, y in items])}


class _List(torch.utils.data.Dataset):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def _build(sizes: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    from attnopt.experiments._data.docstrings import load_records, split_by_record, without_own_module_name
    from attnopt.experiments._data.wordpiece import CompactVocab, wordpiece_ids

    seq_len, k = int(sizes.get("seq_len", 48)), int(sizes.get("n_modules", 8))
    records = load_records(cache_dir)
    parts = split_by_record(records, val=0.1, test=0.2, seed=0)
    limit = sizes.get("max_train")
    train = parts["train"]
    if limit is not None:  # a fixed random subset (the split keeps the corpus' module order)
        keep = sorted(random.Random(0).sample(range(len(train)), min(int(limit), len(train))))
        train = [train[i] for i in keep]
    mlm_train = wordpiece_ids([r.docstring for r in train], seq_len)
    vocab = CompactVocab.from_ids(mlm_train)
    out: dict[str, Any] = {"orig_ids": list(vocab.orig_ids)}
    out["mlm_train"] = [torch.tensor(vocab.encode(s)) for s in mlm_train]
    mlm_test = wordpiece_ids([r.docstring for r in parts["test"]], seq_len)
    out["mlm_test"] = [torch.tensor(vocab.encode(s)) for s in mlm_test]
    unnamed = without_own_module_name(records)  # no label leak: the text must not name its module
    top = [m for m, _ in sorted(Counter(r.module for r in unnamed).items(), key=lambda t: (-t[1], t[0]))[:k]]
    out["modules"] = top
    rng = random.Random(0)
    for part, recs in (("train", parts["train"]), ("test", parts["test"])):
        cls = [r for r in without_own_module_name(recs) if r.module in top]
        ids = wordpiece_ids([r.docstring for r in cls], seq_len)
        out[f"cls_{part}"] = [(torch.tensor(vocab.encode(s)), top.index(r.module)) for s, r in zip(ids, cls)]
        paired = [r for r in recs if len(r.body.split()) >= 4]
        heads = [r.first_sentence for r in paired]
        texts, labels = [], []
        for i, r in enumerate(paired):
            positive = i % 2 == 0
            j = i if positive else (i + rng.randrange(1, len(paired))) % len(paired)
            texts.append((heads[j], r.body))
            labels.append(int(positive))
        tok_ids = _pair_ids(texts, seq_len)
        out[f"pair_{part}"] = [(torch.tensor(vocab.encode(s)), y) for s, y in zip(tok_ids, labels)]
    return out


def _pair_ids(pairs: list[tuple[str, str]], seq_len: int) -> list[list[int]]:
    from attnopt.experiments._data.wordpiece import minilm_tokenizer

    enc = minilm_tokenizer()([a for a, _ in pairs], [b for _, b in pairs], truncation="longest_first",
                             max_length=seq_len)
    return [list(x) for x in enc["input_ids"]]


class _MLM(nn.Module):
    """Encoder + a linear masked-token head."""

    def __init__(self, encoder: TransformerEncoder, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(d_model, vocab_size)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        return self.head(self.encoder.encode(ids, key_padding_mask=mask))


class _Classifier(nn.Module):
    """Encoder + a linear head on the mean of the real positions (learns faster than [CLS] when small)."""

    def __init__(self, encoder: TransformerEncoder, d_model: int, n_out: int) -> None:
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(d_model, n_out)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.encoder.encode(ids, key_padding_mask=mask)
        keep = (~mask).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1).clamp_min(1.0))


class PretrainFinetuneTask(Task):
    """Table 3 / Fig. 4: MLM pretraining (LNAS vs HNAS), then fine-tuning on two downstream tasks."""

    name = "pretrain-finetune"
    paper = "doubly-normalized-attention"
    table = "Table 3, Fig. 4 (HNAS weight per layer)"
    metric = "pair_accuracy"
    metric_unit = "%"
    arms = {"lnas": {"attention": "lnas"}, "hnas": {"attention": "hnas"}}
    default_arms = ("lnas", "hnas")
    lr_grid = (2e-3,)
    datasets = ("docstrings",)
    paper_results = {"docstrings": {a: v["mnli"] for a, v in PAPER_TABLE3.items() if a in ("lnas", "hnas")}}
    quick = Scale(epochs=3, seeds=3, batch_size=32,
                  sizes={"d_model": 32, "num_heads": 2, "layers": 2, "seq_len": 40, "n_modules": 6,
                         "max_train": 1000, "finetune_epochs": 4})
    # full: sized so that both arms x 5 seeds fit an hour on a quiet 2-core CPU (module docstring,
    # "Runtime"); 4 layers are kept for Fig. 4's depth trend
    extra_sizes = {"max_finetune": int, "hnas_lr": float}  # --size knobs no scale sets
    full = Scale(epochs=12, seeds=5, batch_size=32,
                 sizes={"d_model": 64, "num_heads": 4, "layers": 4, "seq_len": 64, "n_modules": 12,
                        "finetune_epochs": 5})

    # ---- data ---------------------------------------------------------------------------
    def _corpus(self, cfg: RunConfig) -> dict[str, Any]:
        keys = ("seq_len", "n_modules", "max_train")
        key = hashlib.sha256(json.dumps(["v3"] + [cfg.sizes.get(k) for k in keys]).encode()).hexdigest()[:12]
        cache_dir = Path(cfg.out_dir) / "data"
        return cached(cache_dir / f"pretrain-{key}.pt", lambda: _build(dict(cfg.sizes), cache_dir))

    def build_data(self, cfg: RunConfig, stage: str = "pretrain") -> DataBundle:
        if (cfg.dataset or self.datasets[0]) not in self.datasets:
            raise ValueError(f"dataset must be one of {self.datasets}, got {cfg.dataset!r}")
        d = self._corpus(cfg)
        info: dict[str, Any] = {"vocab_size": len(d["orig_ids"]), "stage": stage,
                                "modules": tuple(d["modules"])}
        if stage == "pretrain":
            return DataBundle(train=_List(d["mlm_train"]), test=_List(d["mlm_test"]),
                              collate_fn=functools.partial(_collate_mlm, vocab_size=info["vocab_size"]),
                              info=info)
        if stage not in ("cls", "pair"):
            raise ValueError(f"stage must be 'pretrain', 'cls' or 'pair', got {stage!r}")
        info["n_classes"] = len(d["modules"]) if stage == "cls" else 2
        cap = cfg.sizes.get("max_finetune")  # examples per downstream split (tests, negative controls)
        train, test = d[f"{stage}_train"], d[f"{stage}_test"]
        if cap is not None:  # a fixed random subset (the lists are in module order)
            train, test = (
                [xs[i] for i in sorted(random.Random(0).sample(range(len(xs)), min(int(cap), len(xs))))]
                for xs in (train, test)
            )
        return DataBundle(train=_List(train), test=_List(test), collate_fn=_collate_cls, info=info)

    # ---- models -------------------------------------------------------------------------
    def build_model(self, arm: str, cfg: RunConfig, data: DataBundle) -> nn.Module:
        return self._build_mlm(arm, cfg, data)

    def _build_mlm(self, arm: str, cfg: RunConfig, data: DataBundle) -> _MLM:
        """The pretraining model: an encoder of the arm's attention under a masked-token head."""
        from attnopt.models import TransformerEncoder

        if arm not in self.arms:
            raise ValueError(f"arm must be one of {list(self.arms)}, got {arm!r}")
        s = cfg.sizes
        d = int(s.get("d_model", 32))
        encoder = TransformerEncoder(
            d_model=d, num_heads=int(s.get("num_heads", 2)), num_layers=int(s.get("layers", 2)),
            attention=self.arms[arm]["attention"], vocab_size=data.info["vocab_size"],
            max_len=int(s.get("seq_len", 48)) + 1, positions="learned", dropout=0.1)
        return _MLM(encoder, d, data.info["vocab_size"])

    def train_batch_transform(self, batch: dict[str, Any], cfg: RunConfig,  # noqa: ARG002
                              generator: torch.Generator) -> dict[str, Any]:
        if batch["stage"] != "pretrain":
            return batch
        inputs, labels = ngram_mask(batch["ids"], vocab_size=int(batch["vocab_size"]),
                                    generator=generator)
        return {**batch, "inputs": inputs, "labels": labels}

    def configure_optimizers(self, model: nn.Module, cfg: RunConfig, lr: float, epochs: int) -> Any:  # noqa: ARG002
        """AdamW(lr); the HNAS mixing logits at ``sizes["hnas_lr"]`` when set (see
        :mod:`attnopt.experiments._hnas_optim`: at the model's LR the weight cannot move far)."""
        from attnopt.experiments._hnas_optim import hnas_adamw

        h = cfg.sizes.get("hnas_lr")
        return hnas_adamw(model, lr, None if h is None else float(h))

    def training_loss(self, model: nn.Module, batch: dict[str, Any], cfg: RunConfig) -> Tensor:  # noqa: ARG002
        if batch["stage"] == "pretrain":
            if "labels" not in batch:  # the engine did not call train_batch_transform
                batch = self.train_batch_transform(batch, cfg, torch.Generator().manual_seed(0))
            logits = model(batch["inputs"], batch["mask"])
            return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                               ignore_index=-100)
        return nn.functional.cross_entropy(model(batch["ids"], batch["mask"]), batch["label"])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Any, data: DataBundle, cfg: RunConfig) -> dict[str, float]:  # noqa: ARG002
        if data.info["stage"] == "pretrain":
            g = torch.Generator().manual_seed(1234)  # the same masks for every arm and seed
            total, count = 0.0, 0
            for batch in loader:
                inputs, labels = ngram_mask(batch["ids"], vocab_size=data.info["vocab_size"], generator=g)
                logits = model(inputs, batch["mask"])
                n = int((labels != -100).sum())
                total += float(nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                           ignore_index=-100)) * n
                count += n
            return {"mlm_loss": total / max(count, 1), **hnas_weights(model)}
        correct = count = 0
        for batch in loader:
            correct += int((model(batch["ids"], batch["mask"]).argmax(-1) == batch["label"]).sum())
            count += len(batch["label"])
        return {"accuracy": 100.0 * correct / max(count, 1)}

    def epoch_diagnostics(self, model: nn.Module, data: DataBundle, cfg: RunConfig,  # noqa: ARG002
                          epoch: int) -> dict[str, float]:  # noqa: ARG002
        if data.info["stage"] != "pretrain":
            return {}
        first = [data.train[i] for i in range(min(128, dataset_len(data.train)))]
        probe = DataLoader(_List(first), batch_size=64, collate_fn=data.collate_fn)
        stats = column_mass_over(model, probe, lambda m, b: m(b["ids"], b["mask"]))
        return {**stats, **hnas_weights(model)}

    # ---- the two-stage run ----------------------------------------------------------------
    def run(self, cfg: RunConfig, fit: Any) -> dict[str, Any]:
        """Pretrain (``cfg.epochs``), then fine-tune a copy of the encoder on each downstream task.

        Returns the last stage's record with ``metrics`` = the pretraining metrics (MLM loss, HNAS
        weight per layer) + ``cls_accuracy``/``pair_accuracy`` (and their majority-class rates),
        and ``history`` = every stage's epochs, tagged with ``stage``.
        """
        pre = self.build_data(cfg, "pretrain")
        torch.manual_seed(cfg.seed)
        mlm = self._build_mlm(cfg.arm, cfg, pre)
        r_pre = fit(mlm, pre, cfg, stage="pretrain")
        metrics: dict[str, float] = dict(r_pre["metrics"])
        history = [dict(h, stage="pretrain") for h in r_pre.get("history", [])]
        d = int(cfg.sizes.get("d_model", 32))
        ft_cfg = type(cfg)(**{**cfg.__dict__, "epochs": int(cfg.sizes.get("finetune_epochs", 3))})
        for stage in ("cls", "pair"):
            data = self.build_data(cfg, stage)
            torch.manual_seed(cfg.seed)
            model = _Classifier(copy.deepcopy(mlm.encoder), d, data.info["n_classes"])
            r = fit(model, data, ft_cfg, stage=stage)
            metrics[f"{stage}_accuracy"] = float(r["metrics"]["accuracy"])
            history += [dict(h, stage=stage) for h in r.get("history", [])]
            n_test = dataset_len(data.test)
            majority = Counter(int(data.test[i][1]) for i in range(n_test)).most_common(1)[0][1] / n_test
            metrics[f"{stage}_majority"] = 100.0 * majority
        return {**r, "metrics": metrics, "history": history}

    def figures(self, records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
        from attnopt.experiments._dn_figures import column_mass_figure, hnas_layer_figure

        pre = [{**r, "history": [h for h in r.get("history", []) if h.get("stage") == "pretrain"]}
               for r in records]
        layers: dict[str, list[list[float]]] = {}
        for r in records:
            ws = sorted((int(k.split("/")[1]), float(v)) for k, v in r.get("metrics", {}).items()
                        if k.startswith("hnas_w/"))
            if ws:
                layers.setdefault(r["arm"], []).append([w for _, w in ws])
        paths = [column_mass_figure(pre, Path(out_dir), name="pretrain_column_mass"),
                 hnas_layer_figure(layers, Path(out_dir), name="pretrain_fig4_hnas_layers")]
        return [p for p in paths if p is not None]


TASK = PretrainFinetuneTask()

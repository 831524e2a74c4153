"""The doubly-normalized paper's training tasks: a few steps per arm on tiny sizes, diagnostics, decoding."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sklearn")

from attnopt.experiments._task import RunConfig  # noqa: E402


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dn-tasks")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(task, arm: str, out_dir: Path, **sizes) -> RunConfig:
    return RunConfig(task=task.name, arm=arm, seed=0, lr=3e-3, epochs=1, batch_size=16, quick=True,
                     out_dir=out_dir, sizes={**task.quick.sizes, **sizes})


def _steps(task, model, batch, cfg, n: int = 5) -> list[float]:
    """``n`` Adam steps on one batch, dropout off (so that the loss must fall)."""
    torch.manual_seed(0)
    model.eval()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(n):
        batch_t = task.train_batch_transform(batch, cfg, torch.Generator().manual_seed(0))
        loss = task.training_loss(model, batch_t, cfg)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("arm", ["single-view", "concat", "lnas", "dnas", "hnas"])
def test_multiview_one_step_per_arm(arm: str, out_dir: Path) -> None:
    from torch.utils.data import DataLoader

    from attnopt.experiments.multiview_fusion import TASK

    cfg = _cfg(TASK, arm, out_dir)
    data = TASK.build_data(cfg)
    assert len(data.train) + len(data.test) == 1797 and abs(len(data.test) - 540) <= 1
    model = TASK.build_model(arm, cfg, data)
    batch = next(iter(DataLoader(data.train, batch_size=32)))
    losses = _steps(TASK, model, batch, cfg)
    assert losses[-1] < losses[0]
    diag = TASK.epoch_diagnostics(model, data, cfg, 0)
    if arm in ("lnas", "dnas", "hnas"):
        assert diag["min_column_mass"] > 0 and 0 <= diag["frac_explained_away"] <= 1
        if arm == "dnas":
            assert diag["min_column_mass_x_nk"] >= 1 - 1e-5  # Lemma 1 on the trained fusion layer
    else:
        assert "min_column_mass" not in diag
    if arm == "hnas":
        assert 0.0 < diag["hnas_w/0"] < 1.0 and diag["hnas_w/0"] != 0.5  # logged, bounded, trained
    metrics = TASK.evaluate(model.eval(), DataLoader(data.test, batch_size=256), data, cfg)
    assert 0.0 <= metrics["accuracy"] <= 100.0


def test_multiview_npz_reader_names_the_file(tmp_path: Path) -> None:
    from attnopt.experiments.multiview_fusion import TASK

    cfg = RunConfig(task=TASK.name, arm="dnas", seed=0, lr=1e-3, epochs=1, batch_size=8, dataset="npz",
                    data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="multiview_features.npz"):
        TASK.build_data(cfg)


HEADLINE_SIZES = {"src_len": 24, "tgt_len": 10, "max_train": 64, "max_test": 16, "d_model": 16}


def test_headline_data_split_by_module(out_dir: Path) -> None:
    from attnopt.experiments._data.docstrings import load_records, split_by_module
    from attnopt.experiments.headline import TASK

    data = TASK.build_data(_cfg(TASK, "lnas-random", out_dir, **HEADLINE_SIZES))
    assert len(data.train) == 64 and len(data.test) == 16 and len(data.val) > 0
    src, tgt = data.train[0]
    assert src[0] == 2 and len(src) <= 24 and len(tgt) <= 10  # [CLS] ... (compact ids)
    parts = split_by_module(load_records(out_dir / "data"), val=0.1, test=0.2, seed=0)
    assert not {r.module for r in parts["train"]} & {r.module for r in parts["test"]}


@pytest.mark.parametrize("arm", ["lnas-random", "hnas-random"])
def test_headline_one_step_and_decoding(arm: str, out_dir: Path) -> None:
    from torch.utils.data import DataLoader

    from attnopt.experiments.headline import TASK

    cfg = _cfg(TASK, arm, out_dir, **HEADLINE_SIZES)
    data = TASK.build_data(cfg)
    model = TASK.build_model(arm, cfg, data)
    by_len = sorted(range(len(data.train)), key=lambda i: len(data.train[i][0]))
    batch = data.collate_fn([data.train[i] for i in by_len[:4] + by_len[-4:]])
    assert batch["src_mask"].any()  # padded positions present
    losses = _steps(TASK, model, batch, cfg)
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        logits = model(batch["src"], batch["tgt_in"], src_padding_mask=batch["src_mask"],
                       tgt_padding_mask=batch["tgt_in_mask"])
    assert torch.isfinite(logits).all()  # masked positions never give NaN scores
    metrics = TASK.evaluate(model, DataLoader(data.test, batch_size=8, collate_fn=data.collate_fn), data, cfg)
    assert all(0.0 <= metrics[k] <= 100.0 for k in ("rouge1", "rouge2", "rougeL", "copy_rougeL"))
    diag = TASK.epoch_diagnostics(model, data, cfg, 0)
    assert diag["min_column_mass"] > 0
    if arm == "hnas-random":
        ws = [v for k, v in diag.items() if k.startswith("hnas_w/")]
        assert len(ws) == 2 and all(0.0 < w < 1.0 for w in ws)  # encoder self + cross attention


def test_ngram_mask_spans_and_rate() -> None:
    from attnopt.experiments.pretrain_finetune import ngram_mask

    ids = torch.randint(5, 50, (64, 40))
    ids[:, 0], ids[:, -1] = 2, 3
    ids[:8, 30:] = 0
    inputs, labels = ngram_mask(ids, vocab_size=50, generator=torch.Generator().manual_seed(0))
    chosen = labels != -100
    real = ids > 4
    assert not (chosen & ~real).any()  # never [CLS]/[SEP]/padding
    rate = chosen.sum(1).float() / real.sum(1).float()
    assert ((rate > 0.1) & (rate < 0.2)).all()
    assert torch.equal(labels[chosen], ids[chosen])
    assert 0.7 < (inputs[chosen] == 4).float().mean() < 0.9  # 80 % [MASK]
    # spans: contiguous runs of chosen positions longer than 1 exist, none longer than needed
    runs = [len(r) for row in chosen.int().tolist() for r in "".join(map(str, row)).split("0") if r]
    assert max(runs) >= 2 and sum(r >= 2 for r in runs) > len(runs) / 4
    again, _ = ngram_mask(ids, vocab_size=50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(inputs, again)


@pytest.mark.parametrize("arm", ["lnas", "hnas"])
def test_pretrain_finetune_run_per_arm(arm: str, out_dir: Path) -> None:
    from attnopt.experiments.pretrain_finetune import TASK

    sizes = {"seq_len": 24, "max_train": 48, "d_model": 16, "layers": 2, "finetune_epochs": 1, "n_modules": 4,
             "max_finetune": 64}
    cfg = _cfg(TASK, arm, out_dir, **sizes)
    pre = TASK.build_data(cfg, "pretrain")
    assert len(pre.train) == 48
    cls, pair = TASK.build_data(cfg, "cls"), TASK.build_data(cfg, "pair")
    assert cls.info["n_classes"] == 4 and {y for _, y in cls.train} == {0, 1, 2, 3}
    assert {y for _, y in pair.train} == {0, 1}
    model = TASK.build_model(arm, cfg, pre)
    batch = pre.collate_fn([pre.train[i] for i in range(16)])
    losses = _steps(TASK, model, batch, cfg)
    assert losses[-1] < losses[0]
    calls = []

    def fit(model, data, cfg, stage):  # a one-step stand-in for the engine's fit
        calls.append((stage, cfg.epochs))
        b = data.collate_fn([data.train[i] for i in range(8)])
        _steps(TASK, model, b, cfg, n=1)
        from torch.utils.data import DataLoader

        return {"metrics": TASK.evaluate(model.eval(), DataLoader(data.test, batch_size=64,
                                                                  collate_fn=data.collate_fn), data, cfg),
                "history": [{"epoch": 0, **TASK.epoch_diagnostics(model, data, cfg, 0)}]}

    rec = TASK.run(cfg, fit)
    assert [c[0] for c in calls] == ["pretrain", "cls", "pair"] and calls[1][1] == 1
    m = rec["metrics"]
    assert m["mlm_loss"] > 0 and 0 <= m["cls_accuracy"] <= 100 and 0 <= m["pair_accuracy"] <= 100
    ws = [v for k, v in m.items() if k.startswith("hnas_w/")]
    assert len(ws) == (2 if arm == "hnas" else 0) and all(0 < w < 1 for w in ws)
    assert "min_column_mass" in rec["history"][0]


def test_figures_from_records(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from attnopt.experiments.multiview_fusion import TASK as MV
    from attnopt.experiments.pretrain_finetune import TASK as PF

    hist = [{"epoch": e, "min_column_mass_x_nk": 2.0 / (e + 1), "frac_explained_away": 0.1 * e,
             "hnas_w/0": 0.5 + 0.01 * e, "stage": "pretrain"} for e in range(3)]
    recs = [{"arm": a, "seed": s, "history": hist, "metrics": {"hnas_w/0": 0.6, "hnas_w/1": 0.55}}
            for a in ("lnas", "dnas", "hnas") for s in (0, 1)]
    paths = MV.figures(recs, tmp_path)
    assert len(paths) == 2 and all(p.is_file() and p.stat().st_size > 1000 for p in paths)
    assert len(PF.figures(recs, tmp_path)) == 2
    empty = [{"arm": "concat", "seed": 0, "history": [{"epoch": 0}], "metrics": {}}]
    assert MV.figures(empty, tmp_path) == []


# ---- headline: the MiniLM-initialized arms (Table 2's BERT rows) ----------------------------
PRETRAINED_SIZES = {**HEADLINE_SIZES, "pretrained_layers": 1, "pretrained_decoder_layers": 1}


def test_minilm_lnas_swap_reproduces_minilm(out_dir: Path) -> None:
    """The swapped encoder (attnopt_lnas, compact vocabulary) gives MiniLM's own hidden states:
    the pretrained weights are really used; HNAS at u = 0.5 does not."""
    from attnopt.analysis.pretrained import load_model
    from attnopt.experiments._pretrained_seq2seq import minilm_encoder
    from attnopt.experiments.headline import TASK

    data = TASK.build_data(_cfg(TASK, "lnas-pretrained", out_dir, **HEADLINE_SIZES))
    orig = torch.tensor(data.info["orig_ids"])
    by_len = sorted(range(len(data.train)), key=lambda i: len(data.train[i][0]))
    batch = data.collate_fn([data.train[i] for i in by_len[:2] + by_len[-2:]])
    ids, pad = batch["src"], batch["src_mask"]
    assert pad.any()
    reference, _ = load_model()  # the bundled MiniLM, eager softmax attention
    with torch.no_grad():
        ref = reference(input_ids=orig[ids], attention_mask=(~pad).long()).last_hidden_state
        outs = {}
        for attention in ("lnas", "hnas"):
            enc = minilm_encoder(attention, orig_ids=data.info["orig_ids"]).eval()
            outs[attention] = enc(input_ids=ids, attention_mask=(~pad).long()).last_hidden_state
    real = ~pad
    torch.testing.assert_close(outs["lnas"][real], ref[real], atol=2e-5, rtol=1e-4)
    assert (outs["hnas"][real] - ref[real]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="attention"):
        minilm_encoder("dnas")


@pytest.mark.parametrize("arm", ["lnas-pretrained", "hnas-pretrained"])
def test_headline_pretrained_one_step_and_decoding(arm: str, out_dir: Path) -> None:
    from torch.utils.data import DataLoader

    from attnopt.experiments._diagnostics import hnas_weights
    from attnopt.experiments.headline import TASK

    cfg = _cfg(TASK, arm, out_dir, **PRETRAINED_SIZES)
    data = TASK.build_data(cfg)
    model = TASK.build_model(arm, cfg, data)
    assert model.d_model == 384 and len(model.pretrained.encoder.layer) == 1 and len(model.decoder) == 1
    enc_w = [p for n, p in model.named_parameters() if n.endswith("attnopt_hnas_weight.weight_logit")]
    assert len(enc_w) == (1 if arm == "hnas-pretrained" else 0)
    by_len = sorted(range(len(data.train)), key=lambda i: len(data.train[i][0]))
    batch = data.collate_fn([data.train[i] for i in by_len[:3] + by_len[-3:]])
    assert batch["src_mask"].any() and batch["tgt_in_mask"].any()
    # one engine-style step with the task's optimizer (decoder lr/6, encoder lr/60, HNAS weights lr)
    model.train()
    opt = TASK.configure_optimizers(model, cfg, 3e-3, 1)
    lrs = sorted(g["lr"] for g in opt.param_groups)  # every HNAS weight (HF encoder, cross) at lr
    assert lrs == pytest.approx([5e-5, 5e-4, 3e-3] if arm == "hnas-pretrained" else [5e-5, 5e-4])
    before = [p.detach().clone() for p in enc_w]
    loss = TASK.training_loss(model, batch, cfg)
    assert torch.isfinite(loss)
    loss.backward()
    for p in enc_w:  # the encoder's HNAS weight is a trained parameter
        assert p.grad is not None and float(p.grad.abs()) > 0
    opt.step()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(enc_w, before))
    model.eval()
    with torch.no_grad():
        logits = model(batch["src"], batch["tgt_in"], src_padding_mask=batch["src_mask"],
                       tgt_padding_mask=batch["tgt_in_mask"])
        assert torch.isfinite(logits).all()  # masked positions never give NaN scores
        beams = model.beam_decode(batch["src"][:2], bos_id=2, eos_id=3, max_len=4,
                                  src_padding_mask=batch["src_mask"][:2], beam_size=2)
    assert beams.shape[0] == 2
    metrics = TASK.evaluate(model, DataLoader(data.test, batch_size=8, collate_fn=data.collate_fn), data, cfg)
    assert all(0.0 <= metrics[k] <= 100.0 for k in ("rouge1", "rouge2", "rougeL"))
    ws = hnas_weights(model)
    if arm == "hnas-pretrained":  # encoder layer (learned, HF) + decoder cross-attention
        assert len(ws) == 2 and all(0.0 < w < 1.0 for w in ws.values())
        assert any(abs(w - 0.5) > 0 for w in ws.values())
    else:
        assert ws == {}


def test_headline_quick_arms_leave_out_the_minilm_rows(tmp_path: Path) -> None:
    from attnopt.experiments._engine import plan_runs
    from attnopt.experiments.headline import TASK

    quick = {c.arm for c in plan_runs(TASK, quick=True, out_dir=tmp_path)}
    full = {c.arm for c in plan_runs(TASK, quick=False, out_dir=tmp_path)}
    assert quick == {"lnas-random", "hnas-random"}
    assert full == quick | {"lnas-pretrained", "hnas-pretrained"}
    assert {c.arm for c in plan_runs(TASK, quick=True, arms=["hnas-pretrained"], out_dir=tmp_path)} == {
        "hnas-pretrained"}

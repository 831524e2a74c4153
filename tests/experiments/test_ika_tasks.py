"""The implicit-kernel tasks: one training step per arm, the KL term, metrics from the packages."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("attnopt.experiments._task", reason="the training engine (issue 10) is not merged yet")
pytest.importorskip("attnopt.models", reason="the training engine (issue 10) is not merged yet")
from attnopt.experiments._task import RunConfig  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run faster on one thread (no OpenMP hand-offs on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(task, arm, tmp_path, *, dataset=None, sizes=None, fold=0):
    scale = task.quick
    return RunConfig(
        task=task.name,
        arm=arm,
        seed=0,
        lr=task.lr_grid[0],
        epochs=1,
        batch_size=8,
        fold=fold,
        quick=True,
        dataset=dataset,
        out_dir=Path(tmp_path),
        sizes={**scale.sizes, **(sizes or {})},
    )


def _one_step(task, arm, cfg, data, batch):
    torch.manual_seed(0)
    model = task.build_model(arm, cfg, data)
    loss = task.training_loss(model, batch, cfg)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    return model


# ---------------------------------------------------------------- node classification
pytest.importorskip("torch_geometric")


def test_node_classification_one_step_per_arm_and_folds(tmp_path):
    from attnopt.experiments.ika_node_classification import TASK

    for arm in TASK.default_arms:
        cfg = _cfg(TASK, arm, tmp_path, dataset="karate", sizes={"folds": 3})
        data = TASK.build_data(cfg)
        batch = data.collate_fn([data.train[0]])
        _one_step(TASK, arm, cfg, data, batch)
    cfgs = [_cfg(TASK, "gat", tmp_path, dataset="karate", sizes={"folds": 3}, fold=f) for f in range(3)]
    tests = [TASK.build_data(c).test[0][3] for c in cfgs]
    assert not (tests[0] & tests[1]).any() and bool((tests[0] | tests[1] | tests[2]).all())


def test_node_classification_mikan_kl_enters_and_accuracy_matches_sklearn(tmp_path):
    from sklearn.metrics import accuracy_score
    from torch.utils.data import DataLoader

    from attnopt.experiments.ika_node_classification import TASK

    cfg = _cfg(TASK, "mikan", tmp_path, dataset="karate", sizes={"folds": 3})
    data = TASK.build_data(cfg)
    model = TASK.build_model("mikan", cfg, data)
    x, ei, y, mask = data.collate_fn([data.test[0]])
    with torch.no_grad():
        model.conv1.sampler.densities[0].nn1[2].bias.fill_(0.5)  # posterior away from the prior
    model.train()
    model(x, ei)
    kls = [m.kl() for m in model.modules() if m is not model and callable(getattr(m, "kl", None))]
    assert sum(kls) > 0
    sum(kls).backward()
    assert model.conv1.sampler.densities[0].nn1[2].bias.grad.abs().sum() > 0
    metrics = TASK.evaluate(model, DataLoader(data.test, batch_size=1, collate_fn=data.collate_fn), data, cfg)
    model.eval()
    with torch.no_grad():
        pred = model(x, ei)[mask].argmax(-1)
    assert metrics["accuracy"] == pytest.approx(accuracy_score(y[mask].numpy(), pred.numpy()))
    assert 0 < metrics["head_std"] < 1
    assert TASK.figures([{"arm": "mikan", "metrics": metrics}], tmp_path)[0].exists()


def test_node_classification_features_are_row_normalized(tmp_path):
    """Regression (issue 12): raw sbm features (‖x‖² ≈ 16) made the kernel arms' magnitude
    exp(‖Wh_j‖²/2) swamp their random-feature kernel (MC noise ~1/R): near-chance accuracy."""
    from attnopt.experiments._data.graphs import normalize_features
    from attnopt.experiments.ika_node_classification import TASK

    x = TASK.build_data(_cfg(TASK, "gat", tmp_path, dataset="sbm")).train[0][0]
    torch.testing.assert_close(x.norm(dim=-1), torch.ones(len(x)))
    bag = torch.tensor([[0.0, 2.0, 2.0], [0.0, 0.0, 0.0], [1.0, 0.0, 3.0]])
    want = torch.tensor([[0, 0.5, 0.5], [0, 0, 0], [0.25, 0, 0.75]])
    torch.testing.assert_close(normalize_features(bag), want)
    signed = torch.tensor([[3.0, -4.0]])
    torch.testing.assert_close(normalize_features(signed), torch.tensor([[0.6, -0.8]]))


def test_node_classification_reads_planetoid_files_from_data_dir(tmp_path):
    from dataclasses import replace

    from attnopt.experiments.ika_node_classification import TASK
    from tests.experiments.test_implicit_kernel_data import _write_planetoid

    _write_planetoid(tmp_path, "cora")
    cfg = replace(_cfg(TASK, "ikan-direct", tmp_path, dataset="cora", sizes={"folds": 3}), data_dir=tmp_path)
    data = TASK.build_data(cfg)
    assert data.info["num_features"] == 4 and data.info["num_classes"] <= 3
    x = data.train[0][0]
    live = x.abs().sum(-1) > 0
    torch.testing.assert_close(x[live].sum(-1), torch.ones(int(live.sum())))  # GAT's row sums of 1
    _one_step(TASK, "ikan-direct", cfg, data, data.collate_fn([data.train[0]]))
    with pytest.raises(FileNotFoundError, match="ind.citeseer"):
        TASK.build_data(replace(cfg, dataset="citeseer"))


# ---------------------------------------------------------------- Transformer tasks (need attnopt.models)
TINY = {"d_model": 16, "num_heads": 2, "num_layers": 1, "layers": 1, "num_samples": 4, "max_len": 12}


def _perturb_densities(model):
    """Move every implicit density's posterior away from the prior (so its KL is > 0)."""
    from attnopt.nn.spectral import ImplicitSpectralDensity

    n = 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ImplicitSpectralDensity):
                m.nn1[2].bias.fill_(0.3)
                n += 1
    return n


@pytest.mark.parametrize(
    "arm", ["transformer", "rbf-only", "expsin", "linear", "ika-s", "ika-ns", "ikan", "ikan-direct", "mikan"]
)
def test_sentence_classification_one_step_per_arm_and_kl(arm, tmp_path):
    from attnopt.experiments.ika_sentence_classification import TASK
    from attnopt.models import auxiliary_loss

    cfg = _cfg(TASK, arm, tmp_path, dataset="docstring-kind", sizes=TINY)
    data = TASK.build_data(cfg)
    batch = data.collate_fn([data.train[i] for i in range(8)])
    model = _one_step(TASK, arm, cfg, data, batch)
    has_density = _perturb_densities(model) > 0
    assert has_density == (arm in ("ika-s", "ika-ns", "ikan", "mikan"))
    model.train()
    TASK.training_loss(model, batch, cfg)
    aux = auxiliary_loss(model)
    assert (aux.item() > 0) if has_density else aux.item() == 0.0


def test_sentence_classification_accuracy_attention_file_and_figure(tmp_path):
    from sklearn.metrics import accuracy_score
    from torch.utils.data import DataLoader

    from attnopt.experiments.ika_sentence_classification import TASK

    recs = []
    for arm in ("ikan", "mikan"):
        cfg = _cfg(TASK, arm, tmp_path, dataset="docstring-kind", sizes=TINY)
        data = TASK.build_data(cfg)
        model = TASK.build_model(arm, cfg, data)
        loader = DataLoader(data.test, batch_size=64, collate_fn=data.collate_fn)
        metrics = TASK.evaluate(model, loader, data, cfg)
        model.eval()
        preds, ys = [], []
        with torch.no_grad():
            for ids, pad, y in loader:
                preds += model(ids, key_padding_mask=pad).argmax(-1).tolist()
                ys += y.tolist()
        assert metrics["accuracy"] == pytest.approx(accuracy_score(ys, preds))
        assert (tmp_path / "attention" / f"docstring-kind-{arm}-seed0.json").is_file()
        recs.append({"arm": arm, "seed": 0, "dataset": "docstring-kind", "metrics": metrics})
    figs = TASK.figures(recs, tmp_path / "figures")  # the engine hands over OUT/figures
    assert len(figs) == 1 and figs[0].exists() and figs[0].parent == tmp_path / "figures"


@pytest.mark.parametrize("arm", ["transformer", "ikan-direct", "mikan", "mikan-p0.5"])
def test_regression_one_step_per_arm(arm, tmp_path):
    from attnopt.experiments.ika_regression import TASK

    cfg = _cfg(TASK, arm, tmp_path, dataset="diabetes", sizes={**TINY, "folds": 3})
    data = TASK.build_data(cfg)
    x, y = data.train[:8]
    _one_step(TASK, arm, cfg, data, (x, y))


def test_regression_rmse_matches_sklearn_and_sparsity(tmp_path):
    from sklearn.metrics import mean_squared_error
    from torch.utils.data import DataLoader

    from attnopt.experiments.ika_regression import TASK

    cfg = _cfg(TASK, "mikan-p0.25", tmp_path, dataset="diabetes", sizes={**TINY, "folds": 3})
    data = TASK.build_data(cfg)
    model = TASK.build_model("mikan-p0.25", cfg, data)
    assert model.modules  # p parsed from the arm name
    assert any(getattr(m, "p", None) == 0.25 for m in model.modules())
    loader = DataLoader(data.test, batch_size=16)
    metrics = TASK.evaluate(model, loader, data, cfg)
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(x).squeeze(-1) for x, _ in loader])
    y = data.test.tensors[1]
    assert metrics["rmse"] == pytest.approx(math.sqrt(mean_squared_error(y.numpy(), pred.numpy())), rel=1e-5)
    assert 0 < metrics["mean_max_weight"] <= 1 and 0 <= metrics["share_above_0.99"] <= 1
    assert (tmp_path / "attention" / "diabetes-mikan-p0.25-seed0-fold0.json").is_file()


def test_regression_fig4_histograms_read_the_saved_weights(tmp_path, monkeypatch):
    """Fig. 4a-b draw the weights evaluate() saved in OUT/attention (the engine hands figures()
    OUT/figures): the bars hold every recorded weight (they were empty when the folder was wrong)."""
    import json

    import matplotlib.axes
    import numpy as np

    from attnopt.experiments.ika_regression import TASK

    folder = tmp_path / "attention"
    folder.mkdir()
    recs = []
    for arm, counts in (("mikan-p0.25", [3, 0, 1]), ("mikan-p2", [0, 5, 0])):
        (folder / f"diabetes-{arm}-seed0-fold0.json").write_text(
            json.dumps({"arm": arm, "bins": [0, 0.1, 0.2, 0.3], "counts": counts}))
        recs.append({"arm": arm, "seed": 0, "fold": 0, "dataset": "diabetes", "metrics": {"rmse": 0.5}})
    drawn = []
    bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda self, x, h, *a, **k: drawn.append(list(h)) or bar(self, x, h, *a, **k))
    monkeypatch.setattr("attnopt.experiments.ika_regression._BINS", np.array([0, 0.1, 0.2, 0.3]))
    figs = TASK.figures(recs, tmp_path / "figures")
    assert figs and figs[0].exists()
    assert drawn == [[3, 0, 1], [0, 5, 0]]


@pytest.mark.parametrize("arm", ["transformer", "ikan-direct", "mikan"])
def test_translation_one_step_per_arm_and_diagnostics(arm, tmp_path):
    from attnopt.experiments.ika_translation import TASK

    cfg = _cfg(TASK, arm, tmp_path, sizes={**TINY, "high": 200})
    data = TASK.build_data(cfg)
    batch = data.collate_fn([data.train[i] for i in range(8)])
    model = _one_step(TASK, arm, cfg, data, batch)
    diag = TASK.epoch_diagnostics(model, data, cfg, 0)
    assert set(diag) == {
        "self_max_similarity",
        "self_mean_log_magnitude",
        "cross_max_similarity",
        "cross_mean_log_magnitude",
    }
    assert all(math.isfinite(v) for v in diag.values())
    assert 0 < diag["self_max_similarity"] <= 1 + 1e-4


def test_translation_bleu_is_sacrebleu_and_perfect_decodes_score_100(tmp_path, monkeypatch):
    import sacrebleu
    from torch.utils.data import DataLoader

    from attnopt.experiments import ika_translation as tr

    cfg = _cfg(tr.TASK, "transformer", tmp_path, sizes={**TINY, "high": 200})
    data = tr.TASK.build_data(cfg)
    refs = data.test.refs
    monkeypatch.setattr(
        tr.Translation, "decode", lambda self, model, batch, data: [refs[int(i)] for i in batch["index"]]
    )
    loader = DataLoader(data.test, batch_size=16, collate_fn=data.collate_fn)
    m = tr.TASK.evaluate(torch.nn.Identity(), loader, data, cfg)
    assert m["bleu"] == pytest.approx(100.0) and m["exact_match"] == 1.0
    hyps = ["one"] * len(refs)
    assert tr._bleu(hyps, list(refs)) == pytest.approx(sacrebleu.corpus_bleu(hyps, [list(refs)]).score)

"""Fig. 5a-c of implicit-kernel-attention: the MMD test and the spectral points of the graph layers."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from attnopt.experiments._spectral import median_bandwidth, mmd2_unbiased, mmd_test


@pytest.fixture(autouse=True)
def _one_thread():
    """Small tensors: one thread (no OpenMP hand-offs on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _naive_mmd2(x, y, beta):
    def k(a, b):
        return float(torch.exp(-((a - b) ** 2).sum() / (2 * beta**2)))

    m, n = len(x), len(y)
    sxx = sum(k(x[i], x[j]) for i, j in itertools.permutations(range(m), 2)) / (m * (m - 1))
    syy = sum(k(y[i], y[j]) for i, j in itertools.permutations(range(n), 2)) / (n * (n - 1))
    sxy = sum(k(a, b) for a in x for b in y) / (m * n)
    return sxx + syy - 2 * sxy


def test_mmd2_matches_the_definition_in_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    y = torch.randn(5, 3, generator=g, dtype=torch.float64) + 0.5
    for beta in (0.5, 1.3):
        assert float(mmd2_unbiased(x, y, beta)) == pytest.approx(_naive_mmd2(x, y, beta), rel=1e-12)
    z = torch.cat([x, y])
    d = [float((z[i] - z[j]).norm()) for i, j in itertools.combinations(range(len(z)), 2)]
    median = float(torch.tensor(d, dtype=torch.float64).median())
    assert float(median_bandwidth(z)) == pytest.approx(median, rel=1e-12)


def test_mmd_test_separates_distributions_and_is_deterministic():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(150, 4, generator=g), torch.randn(150, 4, generator=g)
    shifted = torch.randn(150, 4, generator=g) * 1.5
    same = mmd_test(a, b, permutations=100, generator=torch.Generator().manual_seed(2))
    diff = mmd_test(a, shifted, permutations=100, generator=torch.Generator().manual_seed(2))
    assert same[1] > 0.05 and diff[1] < 0.02 and diff[0] > same[0]
    assert mmd_test(a, b, permutations=100, generator=torch.Generator().manual_seed(2)) == same
    with pytest.raises(ValueError, match="dimension"):
        mmd_test(a, torch.randn(5, 3))
    with pytest.raises(ValueError, match="permutations"):
        mmd_test(a, b, permutations=0)
    with pytest.raises(ValueError, match="bandwidth"):
        mmd2_unbiased(a, b, 0.0)
    with pytest.raises(TypeError, match="x"):
        mmd2_unbiased([[1.0]], b, 1.0)


pytest.importorskip("torch_geometric")


def _model(arm, seed=0):
    from attnopt.experiments._data.graphs import load_graph
    from attnopt.experiments.ika_node_classification import GraphAttentionNet

    graph = load_graph("karate")
    model = GraphAttentionNet(arm, graph.x.shape[1], 4, 2, 4, num_samples=4, seed=seed).eval()
    return model, graph


def test_spectral_points_start_at_gats_gaussian_and_move_with_the_density():
    from attnopt.experiments.ika_node_classification import spectral_points

    model, graph = _model("mikan")
    pts, heads, scale = spectral_points(model, graph.x, n=10, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)  # at init: μ = 0, σ = 1, NN₂ = 0, C = I -> w = s·z̃ exactly
    noise = torch.stack([torch.randn(10, 2, 1, 8, generator=g)[:, :, 0] for _ in range(2)])
    j = torch.arange(10)
    assert scale == pytest.approx(2**-0.5) and heads.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    assert torch.allclose(pts, scale * noise[j % 2, j, heads], atol=1e-6)
    ref = torch.randn(256, 8, generator=torch.Generator().manual_seed(4)) * scale
    gen = torch.Generator().manual_seed(5)
    at_init = mmd_test(spectral_points(model, graph.x, generator=gen)[0], ref, permutations=100,
                       generator=gen)
    with torch.no_grad():
        model.conv1.sampler.densities[0].nn1[2].bias.fill_(0.5)  # μ, log σ away from the prior
    moved = mmd_test(spectral_points(model, graph.x, generator=gen)[0], ref, permutations=100, generator=gen)
    assert at_init[1] > 0.05 and moved[1] < 0.02
    direct, _ = _model("ikan-direct")
    pts, heads, _ = spectral_points(direct, graph.x)
    assert pts.shape == (2 * 2 * 4, 8) and torch.equal(pts, direct.conv1.spectral_points.reshape(-1, 8))
    with pytest.raises(ValueError, match="kernel arm"):
        spectral_points(_model("gat")[0], graph.x)


def test_node_classification_fig5abc_metrics_file_and_figure(tmp_path, monkeypatch):
    from torch.utils.data import DataLoader

    from attnopt.experiments import ika_node_classification
    from attnopt.experiments._task import RunConfig
    from attnopt.experiments.ika_node_classification import TASK

    monkeypatch.setattr(ika_node_classification, "TSNE_POINTS", 40)  # a quick t-SNE
    cfg = RunConfig(task=TASK.name, arm="mikan", seed=0, lr=0.01, epochs=1, batch_size=1, dataset="karate",
                    out_dir=Path(tmp_path), sizes={**TASK.quick.sizes, "folds": 3, "heads": 2, "hidden": 4})
    data = TASK.build_data(cfg)
    model = TASK.build_model("mikan", cfg, data).eval()
    metrics = TASK.evaluate(model, DataLoader(data.test, batch_size=1, collate_fn=data.collate_fn), data, cfg)
    assert 0 < metrics["spectral_mmd_p"] <= 1 and metrics["copula_max_offdiag"] == pytest.approx(0, abs=1e-6)
    assert (tmp_path / "spectral" / "karate-mikan-seed0-fold0.json").is_file()
    figs = TASK.figures([{"arm": "mikan", "seed": 0, "fold": 0, "dataset": "karate", "metrics": metrics}],
                        tmp_path / "figures")
    assert [f.name for f in figs] == ["fig5abc_spectral_karate.png", "fig5d_head_std.png"]
    gat = TASK.build_model("gat", cfg, data).eval()
    assert "spectral_mmd2" not in TASK.evaluate(gat, DataLoader(data.test, batch_size=1,
                                                             collate_fn=data.collate_fn), data, cfg)

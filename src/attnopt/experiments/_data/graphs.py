r"""Graphs for implicit-kernel-attention Table 5 (node classification), offline.

- ``karate`` — PyTorch Geometric's bundled ``KarateClub`` (34 nodes, 4 communities,
  one-hot node identities as features).
- ``sbm`` — a planted-partition graph from ``networkx.stochastic_block_model`` (classes =
  blocks) with Gaussian node features ``x_i = s·μ_{y_i} + ε_i``, ``μ_c ~ N(0, I)``,
  ``ε ~ N(0, I)``: the class signal ``s`` of a single node's features is weak, so a model
  must aggregate the right neighbours to classify it (edges within blocks are likelier).
- ``cora`` / ``citeseer`` / ``pubmed`` — Planetoid's raw files (``ind.<name>.{x, tx, allx,
  y, ty, ally, graph, test.index}``) from a local folder, read by
  ``torch_geometric.io.read_planetoid_data``; nothing is downloaded.

Folds: ``sklearn.model_selection.StratifiedKFold`` over the nodes (transductive: the whole
graph is seen, labels of the test fold are not). Everything is deterministic given the seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from torch_geometric.data import Data

__all__ = [
    "GRAPH_DATASETS",
    "PLANETOID",
    "PLANETOID_FILES",
    "karate_club",
    "sbm_graph",
    "read_planetoid",
    "node_folds",
    "load_graph",
    "normalize_features",
]

GRAPH_DATASETS = ("sbm", "karate", "cora", "citeseer", "pubmed")
PLANETOID = ("cora", "citeseer", "pubmed")
PLANETOID_FILES = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


def karate_club() -> Data:
    """Zachary's karate club as PyG ships it (34 nodes, 78 undirected edges, 4 classes)."""
    from torch_geometric.datasets import KarateClub

    data = KarateClub()[0]
    return data.__class__(x=data.x, edge_index=data.edge_index, y=data.y)


def sbm_graph(
    *,
    num_classes: int = 4,
    block_size: int = 50,
    p_in: float = 0.1,
    p_out: float = 0.02,
    num_features: int = 16,
    signal: float = 0.3,
    seed: int = 0,
) -> Data:
    """Planted-partition graph with weakly informative Gaussian features (module docstring).

    Raises:
        ValueError: sizes < 1 (2 for classes), probabilities outside [0, 1], ``signal < 0``.
    """
    import networkx as nx
    from torch_geometric.data import Data
    from torch_geometric.utils import to_undirected

    if num_classes < 2 or block_size < 1 or num_features < 1:
        raise ValueError(
            "need num_classes >= 2, block_size >= 1, num_features >= 1, "
            f"got {num_classes}, {block_size}, {num_features}"
        )
    if not (0 <= p_out <= 1 and 0 <= p_in <= 1):
        raise ValueError(f"p_in and p_out must be in [0, 1], got {p_in}, {p_out}")
    if signal < 0:
        raise ValueError(f"signal must be >= 0, got {signal}")
    probs = [[p_in if a == b else p_out for b in range(num_classes)] for a in range(num_classes)]
    g = nx.stochastic_block_model([block_size] * num_classes, probs, seed=seed)
    edges = torch.tensor(list(g.edges()), dtype=torch.long).reshape(-1, 2).T
    n = num_classes * block_size
    edge_index = to_undirected(edges, num_nodes=n)
    rng = np.random.default_rng(seed + 1)
    y = np.repeat(np.arange(num_classes), block_size)
    means = rng.normal(0.0, 1.0, size=(num_classes, num_features))  # ‖μ_c‖ ≈ √F: per-feature signal s
    x = signal * means[y] + rng.normal(size=(n, num_features))
    return Data(
        x=torch.tensor(x, dtype=torch.float32), edge_index=edge_index, y=torch.tensor(y, dtype=torch.long)
    )


def read_planetoid(data_dir: str | Path, name: str) -> Data:
    """Read Planetoid's raw files ``ind.<name>.*`` from ``data_dir`` (no download).

    Raises:
        ValueError: ``name`` not one of cora/citeseer/pubmed.
        FileNotFoundError: a file is missing; the message names every expected file.
    """
    from torch_geometric.io import read_planetoid_data

    name = name.lower()
    if name not in PLANETOID:
        raise ValueError(f"name must be one of {PLANETOID}, got {name!r}")
    folder = Path(data_dir)
    missing = [f"ind.{name}.{f}" for f in PLANETOID_FILES if not (folder / f"ind.{name}.{f}").is_file()]
    if missing:
        expected = ", ".join(f"ind.{name}.{f}" for f in PLANETOID_FILES)
        raise FileNotFoundError(
            f"--data-dir {folder} lacks {', '.join(missing)}; Planetoid's raw format needs: {expected}"
        )
    from torch_geometric.utils import to_undirected

    data = read_planetoid_data(str(folder), name)
    edge_index = to_undirected(data.edge_index, num_nodes=data.num_nodes)  # the citation graph is undirected
    return data.__class__(x=data.x, edge_index=edge_index, y=data.y)


def load_graph(name: str, *, data_dir: str | Path | None = None, seed: int = 0, **sbm_options: Any) -> Data:
    """The graph ``name`` (see :data:`GRAPH_DATASETS`); Planetoid sets need ``data_dir``.

    Raises:
        ValueError: unknown name, or a Planetoid name without ``data_dir``.
    """
    if name == "karate":
        return karate_club()
    if name == "sbm":
        return sbm_graph(seed=seed, **sbm_options)
    if name in PLANETOID:
        if data_dir is None:
            raise ValueError(f"dataset {name!r} needs --data-dir with Planetoid's raw files ind.{name}.*")
        return read_planetoid(data_dir, name)
    raise ValueError(f"dataset must be one of {GRAPH_DATASETS}, got {name!r}")


def normalize_features(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to norm 1: ``x_i/‖x_i‖₁`` for non-negative features (GAT's preprocessing of
    Planetoid's bag-of-words), else ``x_i/‖x_i‖₂`` (``sbm``'s Gaussian features); zero rows stay 0.

    The kernel graph attention needs it: its magnitude ``exp(‖Wh_j‖²/2)`` (eq. 10) is cancelled
    only by an exact RBF; the random-feature kernel's Monte-Carlo noise floor (``~1/R``) cannot
    cancel it once ``‖Wh_j‖² ≫ log R``, so attention then follows the neighbours' norms.
    """
    p = 1 if bool((x >= 0).all()) else 2
    norm = x.norm(p=p, dim=-1, keepdim=True)
    return x / torch.where(norm > 0, norm, torch.ones_like(norm))


def node_folds(y: torch.Tensor, *, folds: int, fold: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (train, test) node masks of stratified fold ``fold`` of ``folds``.

    Raises:
        ValueError: ``folds < 2`` or ``fold`` out of range.
    """
    import warnings

    from sklearn.model_selection import StratifiedKFold

    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    if not 0 <= fold < folds:
        raise ValueError(f"fold must be in [0, {folds}), got {fold}")
    labels = y.numpy()
    with warnings.catch_warnings():  # small classes (karate: 4 nodes) are fine: folds differ in size
        warnings.filterwarnings("ignore", message=".*least populated class.*")
        splits = list(StratifiedKFold(folds, shuffle=True, random_state=seed).split(labels, labels))
    tr, te = splits[fold]
    train = torch.zeros(len(labels), dtype=torch.bool)
    test = torch.zeros(len(labels), dtype=torch.bool)
    train[tr] = True
    test[te] = True
    return train, test

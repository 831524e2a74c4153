"""The task contract's helpers (:mod:`attnopt.experiments._task`)."""

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from attnopt.experiments._task import dataset_len


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_dataset_len_counts_a_map_style_dataset_and_rejects_an_iterable_one():
    assert dataset_len(TensorDataset(torch.zeros(5, 2))) == 5
    with pytest.raises(TypeError, match="map-style"):
        dataset_len(_Stream())

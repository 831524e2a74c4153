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


def test_tasks_name_the_model_they_need_instead_of_an_attribute_error():
    from attnopt.experiments import headline, ika_translation
    from attnopt.experiments._task import DataBundle

    data = DataBundle(train=TensorDataset(torch.zeros(1)), test=TensorDataset(torch.zeros(1)),
                      info={"tgt_vocab": None, "max_tgt_len": 3, "orig_ids": (0, 1)})
    batch = {"src": torch.zeros(1, 2, dtype=torch.long), "src_pad": torch.zeros(1, 2, dtype=torch.bool)}
    with pytest.raises(TypeError, match="EncoderDecoder"):
        ika_translation.TASK.decode(torch.nn.Identity(), batch, data)
    with pytest.raises(TypeError, match="EncoderDecoder"):
        headline.TASK.evaluate(torch.nn.Identity(), [], data, None)  # type: ignore[arg-type]

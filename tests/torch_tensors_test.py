"""models/checkpoint/torch_tensors.py: the tensors of a ``torch.save`` state dict, read without torch and without
running the pickle's code; anything but a dict of tensors is refused, naming the file, before any of its code runs."""

from __future__ import annotations

import os

import numpy as np
import pytest

from docbeam.models.checkpoint.torch_tensors import load_tensors
from docbeam.models.families.encoder_config import CheckpointError


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_a_linear_layers_state_dict_reads_as_torch_reads_it(tmp_path, dtype):
    import torch

    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 5).to(getattr(torch, dtype))
    path = str(tmp_path / "colbert_linear.pt")
    torch.save(linear.state_dict(), path)
    tensors = load_tensors(path)
    assert sorted(tensors) == ["bias", "weight"]
    for name, value in linear.state_dict().items():
        assert tensors[name].dtype == np.float32 and tensors[name].shape == tuple(value.shape)
        np.testing.assert_array_equal(tensors[name], value.float().numpy())


def test_views_keep_their_offset_and_strides(tmp_path):
    """A transposed tensor and a slice share their base's storage: read through size, stride and offset."""
    import torch

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    path = str(tmp_path / "views.pt")
    torch.save({"t": base.t(), "row": base[2, 1:5], "base": base}, path)
    tensors = load_tensors(path)
    np.testing.assert_array_equal(tensors["t"], base.t().numpy())
    np.testing.assert_array_equal(tensors["row"], base[2, 1:5].numpy())


class Payload:
    """What a hostile checkpoint pickles: unpickling it would run ``os.system``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_code_is_refused_and_does_not_run(tmp_path):
    import torch

    marker = tmp_path / "ran"
    path = str(tmp_path / "sparse_linear.pt")
    torch.save({"weight": torch.ones(2), "hook": Payload(marker)}, path)
    with pytest.raises(CheckpointError, match=r"sparse_linear.pt is refused: its pickle names (posix|os).system"):
        load_tensors(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "obj, match",
    [
        (lambda torch: torch.nn.Linear(3, 2), "torch.nn.modules.linear.Linear"),  # a whole module, not its state dict
        (lambda torch: [torch.ones(2)], "holds a list, not a dict of tensors"),
        (lambda torch: {"n": 3}, "holds a _StateDict, not a dict of tensors|holds a dict, not a dict of tensors"),
        (lambda torch: {"i": torch.ones(2, dtype=torch.int64)}, "torch.LongStorage"),
    ],
)
def test_anything_but_a_dict_of_float_tensors_is_refused_naming_it(tmp_path, obj, match):
    import torch

    path = str(tmp_path / "head.pt")
    torch.save(obj(torch), path)
    with pytest.raises(CheckpointError, match=match):
        load_tensors(path)


def test_the_format_before_torch_1_6_is_refused(tmp_path):
    import torch

    path = str(tmp_path / "old.pt")
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="old.pt is not in torch's zip format"):
        load_tensors(path)

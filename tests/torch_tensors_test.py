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


# --- hostile files: crafted pickles, written opcode by opcode as an attacker would (no torch needed) -------------


def _text(s: str) -> bytes:
    data = s.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _int(n: int) -> bytes:
    if -(2**31) <= n < 2**31:
        return b"J" + n.to_bytes(4, "little", signed=True)
    return b"\x8a\x08" + n.to_bytes(8, "little", signed=True)  # LONG1


def _tuple(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def crafted(path, pickle_body: bytes, storages: dict[str, bytes] = {}) -> str:  # noqa: B006  (read only)
    """A zip in torch's layout around ``pickle_body`` (protocol-2 opcodes up to, not including, STOP)."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + pickle_body + b".")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
    return str(path)


def tensor_pickle(offset: int, size: tuple, stride: tuple, numel: int = 6) -> bytes:
    """``{"w": _rebuild_tensor_v2(storage('0', FloatStorage, numel), offset, size, stride, False)}``."""
    pid = _tuple(_text("storage"), b"ctorch\nFloatStorage\n", _text("0"), _text("cpu"), _int(numel)) + b"Q"
    args = _tuple(pid, _int(offset), _tuple(*map(_int, size)), _tuple(*map(_int, stride)), b"\x89")
    return b"}" + _text("w") + b"ctorch._utils\n_rebuild_tensor_v2\n" + args + b"Rs"


SIX = np.arange(6, dtype=np.float32).tobytes()


def test_a_crafted_tensor_like_a_real_one_reads(tmp_path):
    """The crafting is right: the same opcodes with a sane view read as numpy reads it."""
    got = load_tensors(crafted(tmp_path / "ok.pt", tensor_pickle(1, (2, 2), (2, 1)), {"0": SIX}))
    np.testing.assert_array_equal(got["w"], [[1, 2], [3, 4]])


@pytest.mark.parametrize(
    ("offset", "size", "stride", "numel"),
    [
        (0, (3,), (-1,), 6),  # a negative stride reads before the storage (heap bytes, or a segfault)
        (-4, (2,), (1,), 6),  # a negative offset
        (0, (2, 3), (3, -2), 6),
        (5, (3,), (1,), 6),  # past the end
        (0, (1 << 20, 1 << 20), (0, 0), 6),  # 4 TiB of one value repeated: a stride of 0 asks for it
        (7, (0,), (1,), 6),  # an offset past the storage, even for an empty tensor
    ],
)
def test_strides_offsets_and_sizes_outside_the_storage_are_refused(tmp_path, offset, size, stride, numel):
    path = crafted(tmp_path / "bad.pt", tensor_pickle(offset, size, stride, numel), {"0": SIX})
    with pytest.raises(
        CheckpointError, match=r"bad.pt is refused: .*(not a tuple of non-negative|reaches past|do not fit)"
    ):
        load_tensors(path)


def test_a_storage_whose_declared_size_is_not_its_bytes_is_refused_before_it_is_read(tmp_path):
    path = crafted(tmp_path / "huge.pt", tensor_pickle(0, (6,), (1,), numel=1 << 40), {"0": SIX})
    with pytest.raises(CheckpointError, match="holds 24 bytes, not 1099511627776 values"):
        load_tensors(path)


def test_a_refused_file_changes_nothing_for_the_next_file_read(tmp_path):
    """A pickle that sets attributes on a storage type (BUILD) is refused, and a benign file read after it in the same
    process reads its floats as floats, not as another type's bit patterns."""
    benign = crafted(tmp_path / "benign.pt", tensor_pickle(0, (6,), (1,)), {"0": SIX})
    before = load_tensors(benign)["w"]
    rewrite = b"ctorch\nFloatStorage\n}" + _text("dtype") + _text("i4") + b"sb"
    with pytest.raises(CheckpointError, match="sets attributes on a storage type"):
        load_tensors(crafted(tmp_path / "hostile.pt", rewrite))
    np.testing.assert_array_equal(load_tensors(benign)["w"], before)
    np.testing.assert_array_equal(before, np.arange(6, dtype=np.float32))


def test_attributes_a_pickle_sets_on_the_state_dict_class_stay_with_its_file(tmp_path):
    """BUILD on OrderedDict's stand-in (setting its keys) is that file's own class: a real state dict read after it
    reads as torch reads it."""
    import torch

    hostile = b"ccollections\nOrderedDict\nN}" + _text("keys") + b"ccollections\nOrderedDict\ns\x86b"
    with pytest.raises(CheckpointError):
        load_tensors(crafted(tmp_path / "hostile.pt", hostile))
    linear = torch.nn.Linear(3, 2)
    torch.save(linear.state_dict(), str(tmp_path / "real.pt"))
    tensors = load_tensors(str(tmp_path / "real.pt"))
    np.testing.assert_array_equal(tensors["weight"], linear.weight.detach().numpy())


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_zip_is_refused_naming_the_file(tmp_path, damage):
    path = crafted(tmp_path / "damaged.pt", tensor_pickle(0, (6,), (1,)), {"0": SIX * 100})
    data = bytearray(open(path, "rb").read())
    if damage == "truncated":
        data = data[: len(data) // 2] + data[-22:]  # the end record kept: still "a zip"
    else:
        start = data.index(b"archive/data/0") + len(b"archive/data/0")
        data[start + 10 : start + 40] = bytes(30)
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="damaged.pt"):
        load_tensors(path)

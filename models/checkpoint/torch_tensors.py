"""Plain tensors from a ``torch.save`` file (its zip format), read without torch and without running the
pickle's code: bge-m3 ships its sparse and ColBERT heads as ``sparse_linear.pt`` and ``colbert_linear.pt``, state
dicts of a ``torch.nn.Linear``.

A torch file is a zip holding ``<name>/data.pkl`` (the pickle of the object) and ``<name>/data/<key>`` (each
storage's raw bytes). The pickle is read by an unpickler that resolves only the names a state dict of tensors
needs (a dict, torch's tensor rebuild, its storage types), each to docbeam's own function; any other name (a
module, a function, a class of the repository's) is refused before anything is called, naming it. This is what
``torch.load(weights_only=True)`` allows, minus everything but tensors.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import zipfile
import zlib

import ml_dtypes
import numpy as np

from docbeam.models.families.encoder_config import CheckpointError


@dataclasses.dataclass(frozen=True)
class _Storage:
    """A storage type of torch (``torch.FloatStorage``): its numpy dtype. Immutable, and made afresh for every file
    (``_allowed``): a pickle's BUILD on it is refused, so no file can change how a later one reads."""

    dtype: np.dtype

    def __setstate__(self, state):
        raise pickle.UnpicklingError("its pickle sets attributes on a storage type, which a state dict never does")


# ml_dtypes (jax's own dependency) gives numpy a bfloat16.
STORAGES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "DoubleStorage": np.float64,
    "BFloat16Storage": ml_dtypes.bfloat16,
}


def _state_dict_type() -> type:
    """``collections.OrderedDict`` as a state dict pickles it (with its ``_metadata`` attribute): a class of its own
    for each file, so what a pickle's BUILD sets on it stays with that file."""
    return type("_StateDict", (dict,), {})


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(n) is int and n >= 0 for n in value):
        raise pickle.UnpicklingError(f"a tensor's {what} is {value!r}, not a tuple of non-negative integers")
    return value


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2: a view of ``storage`` (a numpy array) by offset, size and stride, each
    checked against the storage first: no negative offset or stride, nothing past its end, no more values than it
    holds (a state dict's tensor never repeats its storage), so a crafted file can neither read outside it nor
    ask for terabytes."""
    del requires_grad, metadata
    if backward_hooks:
        raise pickle.UnpicklingError("a tensor with backward hooks (functions) is not a plain tensor")
    if not isinstance(storage, np.ndarray):
        raise pickle.UnpicklingError(f"a tensor's storage is a {type(storage).__name__}, not a storage")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if type(storage_offset) is not int or not 0 <= storage_offset <= len(storage) or len(size) != len(stride):
        raise pickle.UnpicklingError(
            f"a tensor's offset {storage_offset!r}, size {size} and stride {stride} do not fit its storage of "
            f"{len(storage)} values"
        )
    if math.prod(size) and (
        storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) >= len(storage)
        or math.prod(size) > len(storage)
    ):
        raise pickle.UnpicklingError(f"a tensor of size {tuple(size)} reaches past its storage of {len(storage)}")
    itemsize = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage[storage_offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride), writeable=False
    )
    return np.array(view, np.float32)


def _allowed() -> dict:
    """The names a state dict of tensors needs, each to docbeam's own stand-in: new for every file read."""
    return {
        ("collections", "OrderedDict"): _state_dict_type(),
        ("torch._utils", "_rebuild_tensor_v2"): lambda *args, **kwargs: _rebuild_tensor_v2(*args, **kwargs),
        **{("torch", name): _Storage(np.dtype(dtype)) for name, dtype in STORAGES.items()},
    }


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self._archive, self._prefix, self._allowed = archive, prefix, _allowed()

    def find_class(self, module: str, name: str):
        if (module, name) not in self._allowed:
            raise pickle.UnpicklingError(
                f"its pickle names {module}.{name}, which is not part of a state dict of tensors"
            )
        return self._allowed[module, name]

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise pickle.UnpicklingError(f"its pickle refers to {pid!r}, which is not a tensor's storage")
        _, storage, key, _location, numel = pid
        name = f"{self._prefix}/data/{key}"
        if type(numel) is not int or numel < 0 or name not in self._archive.namelist():
            raise pickle.UnpicklingError(f"its pickle refers to storage {key!r} of {numel!r} values, which it lacks")
        declared = self._archive.getinfo(name).file_size
        if declared != numel * storage.dtype.itemsize:
            raise pickle.UnpicklingError(f"storage {key} holds {declared} bytes, not {numel} values")
        return np.frombuffer(self._archive.read(name), storage.dtype)


def load_tensors(path: str) -> dict[str, np.ndarray]:
    """The state dict saved at ``path`` by ``torch.save``: name → float32 array. Anything but a dict of tensors
    (a pickled module, a function, the format before torch 1.6) is a CheckpointError naming the file."""
    fix = "save the head's state_dict() with a recent torch, or convert it to safetensors"
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"model.path: {path} is not in torch's zip format (torch.save since 1.6), the only one "
            f"docbeam reads without running its pickle; {fix}"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            return _read_archive(path, archive, fix)
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError) as e:
        raise CheckpointError(f"model.path: {path} is a damaged zip ({type(e).__name__}: {e}); {fix}") from None


def _read_archive(path: str, archive: zipfile.ZipFile, fix: str) -> dict[str, np.ndarray]:
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise CheckpointError(f"model.path: {path} holds {len(pickles)} data.pkl records, not one; {fix}")
    prefix = pickles[0].rsplit("/", 1)[0]
    byteorder = f"{prefix}/byteorder"
    if byteorder in archive.namelist() and archive.read(byteorder) != b"little":
        raise CheckpointError(f"model.path: {path} was saved big-endian ({byteorder}); {fix}")
    try:
        with archive.open(pickles[0]) as f:
            state = _Unpickler(f, archive, prefix).load()
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(
            f"model.path: {path} is refused: {e}; docbeam reads only a dict of plain tensors "
            f"from it, never the pickle's own code; {fix}"
        ) from None
    # dict's own items, never the (per-file) class's: a pickle may have set attributes such as keys on it
    items = list(dict.items(state)) if isinstance(state, dict) else None
    if items is None or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in items):
        raise CheckpointError(f"model.path: {path} holds a {type(state).__name__}, not a dict of tensors; {fix}")
    return dict(items)

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

import pickle
import zipfile

import ml_dtypes
import numpy as np

from docbeam.models.families.encoder_config import CheckpointError


class _Storage:
    """A storage type of torch (``torch.FloatStorage``): its numpy dtype."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


# ml_dtypes (jax's own dependency) gives numpy a bfloat16.
STORAGES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "DoubleStorage": np.float64,
    "BFloat16Storage": ml_dtypes.bfloat16,
}


class _StateDict(dict):
    """``collections.OrderedDict`` as a state dict pickles it (with its ``_metadata`` attribute)."""


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2: a view of ``storage`` (a numpy array) by offset, size and stride."""
    del requires_grad, metadata
    if backward_hooks:
        raise pickle.UnpicklingError("a tensor with backward hooks (functions) is not a plain tensor")
    itemsize = storage.dtype.itemsize
    if size and storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) >= len(storage):
        raise pickle.UnpicklingError(f"a tensor of size {tuple(size)} reaches past its storage of {len(storage)}")
    view = np.lib.stride_tricks.as_strided(
        storage[storage_offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
    )
    return np.array(view, np.float32)


ALLOWED = {
    ("collections", "OrderedDict"): _StateDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    **{("torch", name): _Storage(dtype) for name, dtype in STORAGES.items()},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self._archive, self._prefix = archive, prefix

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(
                f"its pickle names {module}.{name}, which is not part of a state dict of tensors"
            )
        return ALLOWED[module, name]

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise pickle.UnpicklingError(f"its pickle refers to {pid!r}, which is not a tensor's storage")
        _, storage, key, _location, numel = pid
        data = self._archive.read(f"{self._prefix}/data/{key}")
        if len(data) != numel * storage.dtype.itemsize:
            raise pickle.UnpicklingError(f"storage {key} holds {len(data)} bytes, not {numel} values")
        return np.frombuffer(data, storage.dtype)


def load_tensors(path: str) -> dict[str, np.ndarray]:
    """The state dict saved at ``path`` by ``torch.save``: name → float32 array. Anything but a dict of tensors
    (a pickled module, a function, the format before torch 1.6) is a CheckpointError naming the file."""
    fix = "save the head's state_dict() with a recent torch, or convert it to safetensors"
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"model.path: {path} is not in torch's zip format (torch.save since 1.6), the only one "
            f"docbeam reads without running its pickle; {fix}"
        )
    with zipfile.ZipFile(path) as archive:
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
        except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"model.path: {path} is refused: {e}; docbeam reads only a dict of plain tensors "
                f"from it, never the pickle's own code; {fix}"
            ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, np.ndarray) for k, v in state.items()
    ):
        raise CheckpointError(f"model.path: {path} holds a {type(state).__name__}, not a dict of tensors; {fix}")
    return dict(state)

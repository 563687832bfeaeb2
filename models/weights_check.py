"""model.safetensors held against config.json before anything runs, without loading the weights: the file's
header gives every tensor's name, dtype and shape; a few values of each are read for finiteness.

A config.json that disagrees with its weights would otherwise run: fewer layers than the file holds run fewer
layers (other vectors, exit 0), and a wrong shape or a NaN fails on the workers. Here each is a CheckpointError
(exit 2 at start) naming the file and the tensor or key. The shapes are those the family's ``read_params`` makes
of the header's shapes (``ShapeOnly`` stands in for each tensor, so nothing is allocated), held against the
shapes the family's Flax module asks for (``jax.eval_shape`` of its init): the one rule for every family.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import BinaryIO, Callable

import numpy as np

from docbeam.models.families.config import CheckpointError

ITEM_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
FLOATS = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "BF16": None}  # BF16: its upper float32 half, read by hand
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
SAMPLE_VALUES = 256  # read at the start, the middle and the end of every tensor: a NaN tensor shows in any of them
LAYER = re.compile(r"(?:^|\.)(?:layers?|h|blocks)\.(\d+)\.")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")  # how config.json names the layer count


@dataclasses.dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # the tensor's bytes in the file: [start, end)
    end: int


@dataclasses.dataclass(frozen=True)
class WeightsFile:
    """A model.safetensors where it lies: ``path`` (local, or a Beam FileSystem's such as gs://), its size, and
    how to open it for reading."""

    path: str
    size: int
    open: Callable[[], BinaryIO]


def local_file(path: str) -> WeightsFile:
    return WeightsFile(path, os.path.getsize(path), lambda: open(path, "rb"))


def remote_file(path: str) -> WeightsFile | None:
    """gs:// (any Beam FileSystem): read with ranged requests, never downloaded whole; None if it is not there."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    if not FileSystems.exists(path):
        return None
    (match,) = FileSystems.match([path])
    return WeightsFile(path, match.metadata_list[0].size_in_bytes,
                       lambda: FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED))


def weights_to_check(path: str, folder: str, with_weights: bool) -> tuple[WeightsFile | None, bool]:
    """(the model.safetensors to hold against config.json in this process, whether to sample its values). The
    driver checks wherever it can read the header: a local folder, ``pkg:``, a Hub snapshot in the cache, and
    ``gs://`` by ranged reads (its values are sampled by the workers, once they hold the file: scattered reads
    of a remote file would cost a download), and a Hub id online by HTTP ranges. A worker holding the file
    samples a remote checkpoint's values."""
    local = os.path.join(folder, "model.safetensors")
    remote = "://" in path
    if with_weights:
        return (local_file(local) if remote and os.path.isfile(local) else None), True
    if os.path.isfile(local):
        return local_file(local), True
    if path.startswith("hf://") and not _hub_offline():
        from docbeam.models.checkpoint_source import hub_weights_file, pinned_path

        return hub_weights_file(pinned_path(path, folder)), False
    if remote and not path.startswith("hf://"):
        return remote_file(f"{path.rstrip('/')}/model.safetensors"), False
    return None, False  # a Hub id offline whose cache lacks the weights: its digest refuses it


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def read_header(file: WeightsFile) -> dict[str, Entry]:
    """Every tensor of a safetensors file by name, checked to lie inside the file with as many bytes as its
    dtype and shape need; a file that is not one is refused naming what is wrong."""
    path, size = file.path, file.size

    def refuse(why: str):
        return CheckpointError(f"model.path: {path} is not a readable safetensors file: {why}; write it again "
                               "(safetensors' save_file, or transformers' save_pretrained)")

    with file.open() as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
            raise refuse(f"its first 8 bytes give a header of {length} bytes in a file of {size}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, ValueError) as e:
            raise refuse(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise refuse(f"its header is a JSON {type(header).__name__}, not an object")
    entries = {}
    for name, raw in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = raw["dtype"], tuple(raw["shape"]), raw["data_offsets"]
            ok = dtype in ITEM_BYTES and all(type(n) is int and n >= 0 for n in (*shape, start, end))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or end - start != math.prod(shape) * ITEM_BYTES[dtype] or 8 + length + end > size:
            raise refuse(f"tensor {name!r} is described as {json.dumps(raw)[:200]}, which is no dtype of "
                         f"{sorted(ITEM_BYTES)} with as many bytes as its shape needs inside the file")
        entries[name] = Entry(dtype, shape, 8 + length + start, 8 + length + end)
    return entries


def layer_problem(names: list[str], num_layers: int) -> str | None:
    """Why the tensors' layer indices are not exactly 0 … num_layers - 1, or None."""
    found = sorted({int(m.group(1)) for m in map(LAYER.search, names) if m})
    if not found:
        return None
    unused, missing = [i for i in found if i >= num_layers], sorted(set(range(num_layers)) - set(found))
    if unused:
        return (f"holds tensors of {len(found)} layers (indices {found[0]} to {found[-1]}), but config.json sets "
                f"{num_layers} layers: layers {unused[0]} to {unused[-1]} would not run")
    if missing:
        return (f"holds no tensors of layer {missing[0]} ({len(missing)} of the {num_layers} layers config.json "
                f"sets are missing)")
    return None


def not_finite(file: WeightsFile, entries: dict[str, Entry], names) -> str | None:
    """The first of ``names`` (floating tensors) whose sampled values hold a NaN or an infinity, or None."""
    with file.open() as f:
        for name in names:
            entry = entries[name]
            item = ITEM_BYTES[entry.dtype]
            count = (entry.end - entry.start) // item
            for first in sorted({0, max(count // 2 - SAMPLE_VALUES // 2, 0), max(count - SAMPLE_VALUES, 0)}):
                f.seek(entry.start + first * item)
                raw = f.read(min(SAMPLE_VALUES, count - first) * item)
                values = (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4") if entry.dtype == "BF16" \
                    else np.frombuffer(raw, FLOATS[entry.dtype])
                if not np.isfinite(values).all():
                    return name
    return None


def check_weights(file: WeightsFile, family, config, raw_config: dict, config_path: str,
                  sample: bool = True) -> None:
    """model.safetensors ``file`` against ``config`` (read from ``config_path``, ``raw_config`` as written):
    layer count, every tensor's dtype and shape as the family reads it, and (``sample``) a sample of each one's
    values."""
    from docbeam.models.families.tensors import Tensors

    path = file.path
    entries = read_header(file)
    tensors = Tensors({name: ShapeOnly(e.shape, (name,)) for name, e in entries.items()}, family.PREFIXES, path)
    problem = layer_problem(list(tensors.tensors), config.num_layers)
    if problem:
        key = next((k for k in LAYER_KEYS if k in raw_config), LAYER_KEYS[0])
        raise CheckpointError(f"model.path: {path} {problem}; {config_path} sets {key}: "
                              f"{json.dumps(raw_config.get(key))}. The two belong to different models: give the "
                              "checkpoint its own config.json")
    read = Reads(tensors)
    try:
        made = family.read_params(read, config)
    except ValueError as e:  # tensors whose shapes cannot even be put together (a fused projection's parts)
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"model.path: {path}: the tensors {read.describe(entries)} cannot be put together "
                              f"({e}): one has another shape than {config_path} says") from None
    not_float = [n for n in read.names if entries[n].dtype not in FLOATS]
    if not_float:
        raise CheckpointError(f"model.path: {path} holds {not_float[0]} as {entries[not_float[0]].dtype}; a weight "
                              f"must be one of {', '.join(FLOATS)}")
    expected = expected_shapes(family, config)
    for where, shape in flat(made).items():
        want = expected.get(where)
        if want is not None and tuple(shape.shape) != want:
            raise CheckpointError(
                f"model.path: {path}: the tensors read for the parameter {where} "
                f"({read.describe(entries, shape.sources)}) make "
                f"shape {list(shape.shape)}, but {config_path} (hidden_size, num_attention_heads, "
                f"intermediate_size, vocab_size, ...) needs {list(want)}: a tensor of another shape than the config "
                "says, or a config.json of another model")
    missing = sorted(set(expected) - set(flat(made)))
    if missing:
        raise CheckpointError(f"model.path: {path} gives no parameter {missing[0]} that the model needs")
    bad = not_finite(file, entries, read.names) if sample else None
    if bad:
        raise CheckpointError(f"model.path: {path} holds NaN or infinite values in the tensor {bad} (in a sample "
                              "of its values): the weights are damaged; download or convert them again")


def expected_shapes(family, config) -> dict[str, tuple[int, ...]]:
    """The family module's parameter shapes for ``config``, traced (nothing computed or allocated)."""
    import jax
    import jax.numpy as jnp

    from docbeam import attention

    model = family.Model(dataclasses.replace(config, dtype="float32"), attention.get("native").bind())
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32),
                                               jnp.ones((1,), jnp.int32)))["params"]
    return {where: tuple(leaf.shape) for where, leaf in flat(shapes).items()}


def flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict) and not hasattr(tree, "items"):
        return {prefix: tree}
    return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}/{key}" if prefix else key).items()}


class Reads:
    """A Tensors of ShapeOnly values that notes which tensors the family reads, by their names in the file."""

    def __init__(self, tensors):
        self._tensors, self.names = tensors, []

    def __getattr__(self, name):
        from docbeam.models.families.tensors import Tensors

        method = getattr(Tensors, name, None)
        return method.__get__(self) if callable(method) else getattr(self._tensors, name)

    def has(self, name: str) -> bool:
        return self._tensors.has(name)

    def __call__(self, name: str):
        for candidate in (name, name.replace(".weight", ".gamma"), name.replace(".bias", ".beta")):
            if self._tensors.has(candidate):
                value = self._tensors.tensors[candidate]
                self.names += value.sources
                return value
        return self._tensors(name)  # raises, naming the tensor the family needs

    def describe(self, entries: dict[str, Entry], names=None) -> str:
        """The tensors ``names`` (by default the last few read) with their shapes in the file."""
        return ", ".join(f"{n} {list(entries[n].shape)}" for n in (self.names[-4:] if names is None else names))


class ShapeOnly(np.lib.mixins.NDArrayOperatorsMixin):
    """A tensor's shape standing in for its values while ``read_params`` runs: transposes, slices, casts,
    concatenations, splits and arithmetic give the shape they would give, allocate nothing, and carry the names
    of the file's tensors they were made from (``sources``), so a wrong shape is traced to its tensor."""

    def __init__(self, shape, sources: tuple[str, ...] = ()):
        self.shape, self.sources = tuple(shape), sources

    ndim = property(lambda self: len(self.shape))
    T = property(lambda self: ShapeOnly(self.shape[::-1], self.sources))

    def astype(self, *_, **__):
        return self

    def __getitem__(self, key):
        return ShapeOnly(np.broadcast_to(np.empty((), np.int8), self.shape)[key].shape, self.sources)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        shapes, sources = [getattr(x, "shape", ()) for x in inputs], _sources(inputs)
        if ufunc is np.matmul:
            return ShapeOnly((*shapes[0][:-1], shapes[1][-1]), sources)
        return ShapeOnly(np.broadcast_shapes(*shapes), sources)

    def __array_function__(self, func, types, args, kwargs):
        many = isinstance(args[0], (list, tuple))
        given = list(args[0]) if many else [args[0]]
        probe = [np.broadcast_to(np.empty((), np.int8), x.shape) if isinstance(x, ShapeOnly) else x for x in given]
        result, sources = func(probe if many else probe[0], *args[1:], **kwargs), _sources(given)
        if isinstance(result, list):
            return [ShapeOnly(r.shape, sources) for r in result]
        return ShapeOnly(result.shape, sources)


def _sources(values) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for v in values for n in getattr(v, "sources", ())))

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
import re

import numpy as np

from docbeam.models.checkpoint.weights_file import WeightsFile
from docbeam.models.families.encoder_config import CheckpointError

ITEM_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
FLOATS = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "BF16": None}  # BF16: its upper float32 half, decoded here
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
SAMPLE_VALUES = 256  # read at the start, the middle and the end of every tensor: a NaN tensor shows in any of them
LAYER = re.compile(r"(?:^|\.)(?:layers?|h|blocks)\.(\d+)\.")
LAYER_KEYS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")  # how config.json names the layer count


@dataclasses.dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # the tensor's bytes in the file: [start, end)
    end: int


def read_header(file: WeightsFile) -> dict[str, Entry]:
    """Every tensor of a safetensors file by name, checked to lie inside the file with as many bytes as its
    dtype and shape need; a file that is not one is refused naming what is wrong."""
    path, size = file.path, file.size

    def refuse(why: str):
        return CheckpointError(
            f"model.path: {path} is not a readable safetensors file: {why}; write it again "
            "(safetensors' save_file, or transformers' save_pretrained)"
        )

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
            raise refuse(
                f"tensor {name!r} is described as {json.dumps(raw)[:200]}, which is no dtype of "
                f"{sorted(ITEM_BYTES)} with as many bytes as its shape needs inside the file"
            )
        entries[name] = Entry(dtype, shape, 8 + length + start, 8 + length + end)
    # safetensors' own loader wants the tensors to cover the data exactly, end to end: checked here, at start,
    # not when the workers load it after the lock and staging
    position = 8 + length
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        if entry.start != position:
            raise refuse(
                f"tensor {name!r} starts at byte {entry.start - 8 - length} of the data where the tensors before it "
                f"end at {position - 8 - length}: they overlap or leave a gap"
            )
        position = entry.end
    if position != size:
        raise refuse(f"its tensors end at byte {position} of a file of {size}: the header does not cover the file")
    return entries


def layer_problem(names: list[str], num_layers: int) -> str | None:
    """Why the tensors' layer indices are not exactly 0 … num_layers - 1, or None."""
    found = sorted({int(m.group(1)) for m in map(LAYER.search, names) if m})
    if not found:
        return None
    unused, missing = [i for i in found if i >= num_layers], sorted(set(range(num_layers)) - set(found))
    if unused:
        return (
            f"holds tensors of {len(found)} layers (indices {found[0]} to {found[-1]}), but config.json sets "
            f"{num_layers} layers: layers {unused[0]} to {unused[-1]} would not run"
        )
    if missing:
        return (
            f"holds no tensors of layer {missing[0]} ({len(missing)} of the {num_layers} layers config.json "
            f"sets are missing)"
        )
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
                values = (
                    (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4")
                    if entry.dtype == "BF16"
                    else np.frombuffer(raw, FLOATS[entry.dtype])
                )
                if not np.isfinite(values).all():
                    return name
    return None


def check_weights(file: WeightsFile, family, config, raw_config: dict, config_path: str, sample: bool = True) -> None:
    """model.safetensors ``file`` against ``config`` (read from ``config_path``, ``raw_config`` as written):
    layer count, every tensor's dtype and shape as the family reads it, and (``sample``) a sample of each one's
    values."""
    path = file.path
    entries = read_header(file)
    tensors = shape_tensors(entries, family.PREFIXES, path)
    problem = layer_problem(list(tensors.tensors), config.num_layers)
    if problem:
        key = next((k for k in LAYER_KEYS if k in raw_config), LAYER_KEYS[0])
        raise CheckpointError(
            f"model.path: {path} {problem}; {config_path} sets {key}: "
            f"{json.dumps(raw_config.get(key))}. The two belong to different models: give the "
            "checkpoint its own config.json"
        )
    try:
        made = family.read_params(tensors, config)
    except ValueError as e:  # tensors whose shapes cannot even be put together (a fused projection's parts)
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"model.path: {path}: the tensors {described(entries, tensors.read[-4:])} cannot be "
            f"put together ({e}): one has another shape than {config_path} says"
        ) from None
    not_float = [n for n in tensors.read if entries[n].dtype not in FLOATS]
    if not_float:
        raise CheckpointError(
            f"model.path: {path} holds {not_float[0]} as {entries[not_float[0]].dtype}; a weight "
            f"must be one of {', '.join(FLOATS)}"
        )
    expected = expected_shapes(family, config)
    for where, shape in flat(made).items():
        want = expected.get(where)
        if want is not None and tuple(shape.shape) != want:
            raise CheckpointError(
                f"model.path: {path}: the tensors read for the parameter {where} "
                f"({described(entries, shape.sources)}) make "
                f"shape {list(shape.shape)}, but {config_path} (hidden_size, num_attention_heads, "
                f"intermediate_size, vocab_size, ...) needs {list(want)}: a tensor of another shape than the config "
                "says, or a config.json of another model"
            )
    missing = sorted(set(expected) - set(flat(made)))
    if missing:
        raise CheckpointError(f"model.path: {path} gives no parameter {missing[0]} that the model needs")
    bad = not_finite(file, entries, tensors.read) if sample else None
    if bad:
        raise CheckpointError(
            f"model.path: {path} holds NaN or infinite values in the tensor {bad} (in a sample "
            "of its values): the weights are damaged; download or convert them again"
        )


def expected_shapes(family, config) -> dict[str, tuple[int, ...]]:
    """The family module's parameter shapes for ``config``, traced (nothing computed or allocated)."""
    import jax
    import jax.numpy as jnp

    from docbeam import attention

    model = family.Model(dataclasses.replace(config, dtype="float32"), attention.get("native").bind())
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32), jnp.ones((1,), jnp.int32))
    )["params"]
    return {where: tuple(leaf.shape) for where, leaf in flat(shapes).items()}


def flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict) and not hasattr(tree, "items"):
        return {prefix: tree}
    return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}/{key}" if prefix else key).items()}


def shape_tensors(entries: dict[str, Entry], prefixes: tuple[str, ...], where: str):
    """The file's tensors as ShapeOnly values, in a Tensors that notes the ones the family reads (``read``,
    by their names in the file) for the dtype and finiteness checks."""
    from docbeam.models.families.tensors import Tensors

    class ShapeTensors(Tensors):
        def __call__(self, name: str):
            for candidate in (name, name.replace(".weight", ".gamma"), name.replace(".bias", ".beta")):
                if candidate in self.tensors:
                    self.read += self.tensors[candidate].sources
                    return self.tensors[candidate]
            return super().__call__(name)  # raises, naming the tensor the family needs

    tensors = ShapeTensors({name: ShapeOnly(e.shape, (name,)) for name, e in entries.items()}, prefixes, where)
    tensors.read = []
    return tensors


def described(entries: dict[str, Entry], names) -> str:
    return ", ".join(f"{n} {list(entries[n].shape)}" for n in names)


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

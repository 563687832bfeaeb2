"""The worker's chips as one device mesh: a ``data`` axis that splits a batch's rows and a ``model`` axis that
splits the parameters Megatron-style, with sharding annotations only (GSPMD partitions the program; nothing
here writes a collective).

Which dimension of a parameter the model axis splits is read from its shape, not its name: a matrix is split on
its largest dimension that the axis divides (ties: the first). That is Megatron's layout for every projection the families have: a
fused QKV or an MLP's up projection [D, 3D | F] on its outputs (heads, the intermediate dimension), the
attention's output and the MLP's down projection [N·H | F, D] on their inputs, a word embedding [V, D] and
SPLADE's masked-LM decoder [D, V] on the vocabulary; a vocabulary the axis does not divide (BERT's 30,522 on
4 chips, Qwen3's 151,669 on any) on the width instead. Vectors (biases, norms, int8 scales) and matrices no
dimension of which the axis divides are replicated.

A fused projection is split in contiguous columns, so with a model axis the q | k | v (or a GLU's a | b) halves
do not line up with the shards, and XLA moves the columns to their heads once per layer (attention/on_mesh.py
pins q, k and v per head). Correct on any mesh; a per-shard column order at load would save that traffic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

AXES = ("data", "model")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """``runner.mesh`` resolved: chips on the data axis (0: every local chip the model axis leaves) and on
    the model axis. Frozen and hashable: part of the encoder plan the workers receive."""

    data: int = 1
    model: int = 1

    def __post_init__(self):
        if self.data < 0 or self.model < 1:
            raise ValueError(f"runner.mesh: data must be >= 0 (0: auto) and model >= 1, got {self}")

    @property
    def auto(self) -> bool:
        return self.data == 0

    def on(self, device_count: int) -> "MeshShape":
        """This shape on a worker with ``device_count`` local chips: ``auto`` takes every chip the model axis
        leaves; a fixed shape must fit."""
        if device_count % self.model:
            raise ValueError(
                f"runner.mesh: model: {self.model} does not divide this worker's {device_count} chips; use a "
                f"model axis that divides {device_count}"
            )
        data = self.data or device_count // self.model
        if data * self.model > device_count:
            raise ValueError(
                f"runner.mesh: {{data: {data}, model: {self.model}}} needs {data * self.model} chips, this worker "
                f"has {device_count}; use a mesh of at most {device_count} chips, or a machine type with more"
            )
        return MeshShape(data, self.model)

    @property
    def devices(self) -> int:
        return self.data * self.model

    def as_dict(self) -> dict:
        return {"data": self.data, "model": self.model}

    def __str__(self) -> str:
        return f"{{data: {self.data or 'auto'}, model: {self.model}}}"


def make_mesh(shape: MeshShape, devices: Sequence[Any] | None = None):
    """The ``jax.sharding.Mesh`` of ``shape`` over this process's local devices (the first data × model)."""
    import jax

    devices = list(devices if devices is not None else jax.local_devices())
    shape = shape.on(len(devices))
    # Auto axes: GSPMD propagates the annotations through the family's code, which names no mesh axis (an
    # explicit axis would ask every gather and dot of every family where its output lives).
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    if shape.devices == len(devices):  # every chip: jax orders them by the chips' physical topology
        return jax.make_mesh((shape.data, shape.model), AXES, auto, devices=devices)
    # Some of the chips: jax's topology-aware ordering asserts a whole block of a TPU slice, so in device order.
    grid = np.array(devices[: shape.devices], dtype=object).reshape(shape.data, shape.model)
    return jax.sharding.Mesh(grid, AXES, axis_types=auto)


def split_dimension(shape: tuple[int, ...], model: int) -> int | None:
    """The dimension of a parameter of ``shape`` the model axis splits, or None: replicated."""
    divided = [d for d in range(len(shape)) if shape[d] % model == 0]
    if model == 1 or len(shape) < 2 or not divided:
        return None
    return max(divided, key=lambda d: (shape[d], -d))


def param_spec(shape: tuple[int, ...], model: int):
    """The PartitionSpec of one parameter (``split_dimension``'s dimension on the model axis)."""
    from jax.sharding import PartitionSpec as P

    dim = split_dimension(tuple(shape), model)
    return P() if dim is None else P(*[("model" if d == dim else None) for d in range(len(shape))])


def param_shardings(params, mesh):
    """A NamedSharding per leaf of ``params`` (arrays or ShapeDtypeStructs)."""
    import jax
    from jax.sharding import NamedSharding

    model = mesh.shape["model"]
    return jax.tree.map(lambda x: NamedSharding(mesh, param_spec(x.shape, model)), params)


def rows_sharding(mesh):
    """A batch's arrays (ids, lengths, segment ids, slots, spans; the forward's output) split on rows."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P("data"))


def per_device_bytes(params_shapes, model: int) -> int:
    """Bytes of ``params_shapes`` (a pytree of arrays or ShapeDtypeStructs) each chip holds on a model axis of
    ``model``: a split parameter's share, a replicated one whole."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(params_shapes):
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        total += nbytes // model if split_dimension(tuple(leaf.shape), model) is not None else nbytes
    return total


def padded_rows(rows: int, data: int) -> int:
    """Rows a batch runs with on a data axis of ``data``: the next multiple (the extra rows are dropped)."""
    return -(-rows // data) * data


def pad_rows(arrays: Sequence[Any], data: int) -> tuple[Any, ...]:
    """Each array (None stays None) with rows appended, copies of its last row, up to ``padded_rows``: a copy
    of a real row runs like one, so no padding row can make a NaN the batch's real rows would not."""
    out = []
    for a in arrays:
        if a is None or a.shape[0] % data == 0:
            out.append(a)
            continue
        extra = padded_rows(a.shape[0], data) - a.shape[0]
        out.append(np.concatenate([a, np.repeat(a[-1:], extra, axis=0)], axis=0))
    return tuple(out)

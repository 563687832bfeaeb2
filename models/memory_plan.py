"""What the encoder needs of each chip's memory, worked out before anything loads: its parameters' bytes per chip
on the mesh (exact: the parameters' abstract shapes, ``jax.eval_shape`` of the family's own ``init``, split as
models/mesh.py splits them), and the forward's working memory for the largest batch a chip takes (an estimate
from the shapes, ``activation_bytes``: the driver has no accelerator to compile for). A job that does not fit
is refused at start, naming the smallest mesh that does.

The estimate is held to XLA's own memory analysis of the compiled forward in tests/memory_plan_test.py: it
must not be below it. It counts one layer's temporaries (XLA reuses a layer's buffers for the next), the
residual stream in float32, and attention's scores: whole ([rows, heads, T, T]) for native, one block of
``BLOCK_KEYS`` keys per query for a backend that walks key blocks (flash kernels, chunked).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from docbeam.models.mesh import MeshShape, per_device_bytes

# Each chip's memory by Dataflow's worker_accelerator type, in the vendors' own decimal gigabytes
# (https://cloud.google.com/tpu/docs/system-architecture-tpu-vm, https://cloud.google.com/compute/docs/gpus).
GB = 10**9
GIB = 1 << 30
ACCELERATOR_MEMORY = {
    "tpu-v5-lite-podslice": 16 * GB,  # v5e
    "tpu-v6e-slice": 32 * GB,  # v6e (Trillium)
    "tpu-v5p-slice": 95 * GB,
    "nvidia-l4": 24 * GB,
    "nvidia-tesla-t4": 16 * GB,
    "nvidia-tesla-v100": 16 * GB,
    "nvidia-tesla-a100": 40 * GB,
    "nvidia-a100-80gb": 80 * GB,
    "nvidia-h100-80gb": 80 * GB,
    "nvidia-h100-mega-80gb": 80 * GB,
}
# What of a chip's memory the encoder may plan for: on TPU all but what XLA keeps for itself (its own buffers, the
# compiled programs, fragmentation); on GPU JAX's allocator stops at XLA_PYTHON_CLIENT_MEM_FRACTION of it (75% by
# default, preallocated or not: https://docs.jax.dev/en/latest/gpu_memory_allocation.html).
HEADROOM = 0.9
GPU_MEM_FRACTION = 0.75
BLOCK_KEYS = 512  # keys per block a flash or chunked backend holds scores for, at most


@functools.lru_cache(maxsize=8)
def abstract_params(config):
    """The family's parameters as ShapeDtypeStructs (no weights read, none allocated): traced once per config
    and process (a scheduler's or notebook's next job plans the same model)."""
    import jax
    import numpy as np

    from docbeam.attention import registry
    from docbeam.models.encoder import Encoder

    module = Encoder(config, registry.get("native").bind())
    ids = jax.ShapeDtypeStruct((1, 8), np.int32)
    lengths = jax.ShapeDtypeStruct((1,), np.int32)
    return jax.eval_shape(module.init, jax.random.key(0), ids, lengths)["params"]


def activation_bytes(config, rows: int, bucket: int, model: int, whole_scores: bool = True) -> int:
    """The forward's working memory on one chip for ``rows`` rows (this chip's share) of ``bucket`` tokens, with
    the heads and the MLP split ``model`` ways: one layer's live intermediates, in float32. ``whole_scores``:
    the backend holds every query's scores over every key (native), not a block of keys at a time."""
    head_dim, kv_heads = config.attention_shape(config.attention_features[0])
    heads = config.num_heads / model
    kv = (kv_heads or config.num_heads) / model
    tokens = rows * bucket
    residual = 2 * config.hidden_size  # the stream and the block's output added to it
    qkv = (heads + 2 * kv) * head_dim  # the fused projection (q, k and v are views of it)
    mlp = 3 * config.intermediate_size / model  # the up projection (both halves of a GLU) and its activation
    scores = heads * (bucket if whole_scores else min(bucket, BLOCK_KEYS))  # per query (softmax fuses into them)
    return int(4 * tokens * (residual + qkv + mlp + scores))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One chip's share of a job: parameters, the largest batch's working memory, and what the chip has."""

    mesh: MeshShape
    rows: int  # the largest batch's rows on each chip
    bucket: int
    param_bytes: int
    activation_bytes: int
    device_bytes: int | None  # None: not known (a CPU worker: host memory, not checked)
    source: str  # where device_bytes came from
    tokens_per_batch: int = 0  # batching.tokens_per_batch as the job runs it (``auto`` resolved here)
    usable: float = HEADROOM  # the share of device_bytes the encoder may plan for

    @property
    def usable_bytes(self) -> int | None:
        return None if self.device_bytes is None else int(self.usable * self.device_bytes)

    @property
    def needed_bytes(self) -> int:
        return self.param_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.device_bytes is None or self.needed_bytes <= self.usable_bytes

    def as_dict(self) -> dict:
        """For summary.json: bytes per chip."""
        return {
            "param_bytes": self.param_bytes,
            "activation_bytes": self.activation_bytes,
            "needed_bytes": self.needed_bytes,
            "device_bytes": self.device_bytes,
            "device_bytes_from": self.source,
            "usable_bytes": self.usable_bytes,
            "largest_batch": {"rows_per_chip": self.rows, "bucket_len": self.bucket},
            "tokens_per_batch": self.tokens_per_batch,
        }

    def describe(self) -> str:
        have = (
            f"{gib(self.usable_bytes)} usable ({self.usable:.0%} of {gib(self.device_bytes)}, {self.source})"
            if self.device_bytes
            else f"not checked ({self.source})"
        )
        return (
            f"mesh {{data: {self.mesh.data}, model: {self.mesh.model}}}: per chip {gib(self.param_bytes)} parameters "
            f"+ {gib(self.activation_bytes)} working memory ({self.rows} row{'s' if self.rows > 1 else ''} x {self.bucket} tokens) = "
            f"{gib(self.needed_bytes)} of {have}"
        )


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class Batch:
    """The batch a plan is made for: all its rows (split over the data axis), its bucket, its backend's kind."""

    rows: int
    bucket: int
    whole_scores: bool = True


@dataclasses.dataclass(frozen=True)
class Chips:
    """What the plan knows of a worker's chips: their memory (None: not checked), where that came from, the share
    of it the encoder may use, and the platform (its row tile)."""

    device_bytes: int | None
    source: str
    usable: float = HEADROOM
    platform: str = "tpu"


def plan_for(config, params, mesh: MeshShape, batch: Batch, chips: Chips) -> MemoryPlan:
    share = math.ceil(batch.rows / max(mesh.data, 1))
    return MemoryPlan(
        mesh,
        share,
        batch.bucket,
        per_device_bytes(params, mesh.model),
        activation_bytes(config, share, batch.bucket, mesh.model, batch.whole_scores),
        chips.device_bytes,
        chips.source,
        usable=chips.usable,
    )


# ``batching.tokens_per_batch: auto``: rows per chip in whole row tiles where there are that many (a TPU's 8
# sublanes; a GPU's warps take 8 rows of a tile too), at most MAX_TOKENS_PER_CHIP tokens a chip (larger batches
# only add latency and compile time once the matmuls are full), and on a CPU, whose memory the plan does not know,
# CPU_TOKENS_PER_CHIP (configs/local.yaml's 1,024: the shape that stays in a CPU's cache,
# benchmarks/results/batch_shapes.json).
ROW_TILE = {"tpu": 8, "gpu": 8}
MAX_TOKENS_PER_CHIP = 32768
CPU_TOKENS_PER_CHIP = 1024


def auto_rows_per_chip(config, params, mesh: MeshShape, bucket: int, whole_scores: bool, chips: Chips) -> int:
    """The most rows of ``bucket`` tokens a chip's memory left after the parameters holds (at least one: a job
    that cannot fit one row is refused by the plan), in whole row tiles when there are that many."""
    if chips.device_bytes is None:
        return max(1, CPU_TOKENS_PER_CHIP // bucket)
    left = chips.usable * chips.device_bytes - per_device_bytes(params, mesh.model)
    per_row = activation_bytes(config, 1, bucket, mesh.model, whole_scores)
    rows = max(1, min(int(left // per_row), MAX_TOKENS_PER_CHIP // bucket))
    tile = ROW_TILE.get(chips.platform, 1)
    return rows // tile * tile if rows >= tile else rows


def smallest_fitting(config, chips: int, plan_on):
    """The plan with the smallest model axis that fits ``chips`` chips (the rest on the data axis), or None;
    ``plan_on(mesh)``: the job's plan on that mesh (its batch sized for it)."""
    for model in range(1, chips + 1):
        if chips % model or config.num_heads % model:
            continue
        plan = plan_on(MeshShape(chips // model, model))
        if plan.fits:
            return plan
    return None

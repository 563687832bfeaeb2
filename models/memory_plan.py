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
import math

from docbeam.models.mesh import MeshShape, per_device_bytes

# Each chip's memory by Dataflow's worker_accelerator type (https://cloud.google.com/tpu/docs/system-architecture-tpu-vm,
# https://cloud.google.com/compute/docs/gpus): HBM per chip.
GIB = 1 << 30
ACCELERATOR_MEMORY = {
    "tpu-v5-lite-podslice": 16 * GIB,  # v5e
    "tpu-v6e-slice": 32 * GIB,  # v6e (Trillium)
    "tpu-v5p-slice": 95 * GIB,
    "nvidia-l4": 24 * GIB,
    "nvidia-tesla-t4": 16 * GIB,
    "nvidia-tesla-v100": 16 * GIB,
    "nvidia-tesla-a100": 40 * GIB,
    "nvidia-a100-80gb": 80 * GIB,
    "nvidia-h100-80gb": 80 * GIB,
    "nvidia-h100-mega-80gb": 80 * GIB,
}
# What the runtime keeps for itself: XLA's own buffers, the compiled programs, fragmentation.
HEADROOM = 0.9
BLOCK_KEYS = 512  # keys per block a flash or chunked backend holds scores for, at most


def abstract_params(config):
    """The family's parameters as ShapeDtypeStructs (no weights read, none allocated)."""
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

    @property
    def needed_bytes(self) -> int:
        return self.param_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.device_bytes is None or self.needed_bytes <= HEADROOM * self.device_bytes

    def as_dict(self) -> dict:
        """For summary.json: bytes per chip."""
        return {
            "param_bytes": self.param_bytes,
            "activation_bytes": self.activation_bytes,
            "needed_bytes": self.needed_bytes,
            "device_bytes": self.device_bytes,
            "device_bytes_from": self.source,
            "largest_batch": {"rows_per_chip": self.rows, "bucket_len": self.bucket},
            "tokens_per_batch": self.tokens_per_batch,
        }

    def describe(self) -> str:
        have = f"{gib(self.device_bytes)} ({self.source})" if self.device_bytes else f"not checked ({self.source})"
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


def plan_for(config, params, mesh: MeshShape, batch: Batch, device_bytes, source: str) -> MemoryPlan:
    share = math.ceil(batch.rows / max(mesh.data, 1))
    return MemoryPlan(
        mesh,
        share,
        batch.bucket,
        per_device_bytes(params, mesh.model),
        activation_bytes(config, share, batch.bucket, mesh.model, batch.whole_scores),
        device_bytes,
        source,
    )


# ``batching.tokens_per_batch: auto``: rows per chip a multiple of the platform's row tile (a TPU's 8 sublanes;
# a GPU's warps take 8 rows of a tile too), at most MAX_TOKENS_PER_CHIP tokens a chip (larger batches only add
# latency and compile time once the matmuls are full), and on a CPU, whose memory the plan does not know,
# CPU_TOKENS_PER_CHIP (configs/local.yaml's 1,024: the shape that stays in a CPU's cache,
# benchmarks/results/batch_shapes.json).
ROW_TILE = {"tpu": 8, "gpu": 8}
MAX_TOKENS_PER_CHIP = 32768
CPU_TOKENS_PER_CHIP = 1024


def auto_rows_per_chip(config, params, mesh: MeshShape, bucket: int, whole_scores: bool, device_bytes, platform) -> int:
    """The most rows of ``bucket`` tokens a chip's memory left after the parameters holds, in whole row tiles."""
    tile = ROW_TILE.get(platform, 1)
    most = max(tile, MAX_TOKENS_PER_CHIP // bucket // tile * tile)
    if device_bytes is None:
        return max(1, CPU_TOKENS_PER_CHIP // bucket)
    left = HEADROOM * device_bytes - per_device_bytes(params, mesh.model)
    per_row = activation_bytes(config, 1, bucket, mesh.model, whole_scores)
    rows = int(left // per_row) // tile * tile
    return max(tile, min(rows, most))


def smallest_fitting(config, params, chips: int, batch: Batch, device_bytes: int, source: str):
    """The plan with the smallest model axis that fits ``chips`` chips (the rest on the data axis), or None."""
    for model in range(1, chips + 1):
        if chips % model or config.num_heads % model:
            continue
        plan = plan_for(config, params, MeshShape(chips // model, model), batch, device_bytes, source)
        if plan.fits:
            return plan
    return None

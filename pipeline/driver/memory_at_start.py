"""The memory plan at start (models/memory_plan.py), for the worker the config describes: its chips from the
profile's ``worker_accelerator`` (a TPU topology ``2x4`` is 8 chips, a GPU ``count:2`` is 2), each chip's memory
from ``runner.device_memory``, else the accelerator's type, else the driver's own chip when it is the one the
job plans for. A job whose mesh does not fit its chips, or whose model does not fit the chips' memory, is
refused here (exit 2) with the bytes and the smallest mesh that fits, not on every worker after start-up.

A CPU worker's memory is the host's, which a machine type does not say here: its plan is shown, and checked only
against a ``runner.device_memory`` the config states.
"""

from __future__ import annotations

import dataclasses
import math
import re

from docbeam.config import parse_bytes
from docbeam.errors import Refused
from docbeam.models.memory_plan import (
    ACCELERATOR_MEMORY,
    HEADROOM,
    Batch,
    MemoryPlan,
    abstract_params,
    auto_rows_per_chip,
    plan_for,
    smallest_fitting,
)
from docbeam.models.mesh import MeshShape
from docbeam.pipeline.stages.packer import rows_for

ACCELERATOR = re.compile(r"worker_accelerator=(.*)")


class MemoryPlanError(Refused, ValueError):
    """The job's model or mesh does not fit its workers' chips: exit 2, nothing started."""


def accelerator(options: dict) -> dict:
    """The ``worker_accelerator`` service option's fields ({"type": ..., "topology": ..., "count": ...}), or {}."""
    for option in options.get("dataflow_service_options") or []:
        found = ACCELERATOR.match(str(option))
        if found:
            return dict(part.split(":", 1) for part in found.group(1).split(";") if ":" in part)
    return {}


def worker_chips(options: dict) -> int | None:
    """Chips per worker the profile asks Dataflow for; None: no accelerator named (CPU, DirectRunner)."""
    fields = accelerator(options)
    if "topology" in fields:
        return math.prod(int(n) for n in fields["topology"].split("x"))
    if "count" in fields:
        return int(fields["count"])
    return 1 if fields else None


def device_memory(runner, platform: str) -> tuple[int | None, str]:
    """(each chip's bytes, where that came from)."""
    if runner.device_memory:
        return parse_bytes(runner.device_memory), "runner.device_memory"
    kind = accelerator(runner.options).get("type")
    if kind in ACCELERATOR_MEMORY:
        return ACCELERATOR_MEMORY[kind], f"worker_accelerator type {kind}"
    import jax

    local = jax.local_devices()[0]
    stats = local.memory_stats() if local.platform == platform and local.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"this machine's {local.device_kind}"
    return None, "a CPU worker's host memory" if platform == "cpu" else "unknown: set runner.device_memory, e.g. 16GiB"


def chips_and_mesh(runner, local_devices: int) -> tuple[int, MeshShape]:
    """(chips per worker, runner.mesh resolved on them); refused when the mesh needs more chips than there are."""
    chips = worker_chips(runner.options) or local_devices
    try:
        return chips, runner.mesh_shape().on(chips)
    except ValueError as e:
        raise MemoryPlanError(f"{e} (the worker's chips: {chips}, from the profile's worker_accelerator)") from None


def memory_plan(cfg, encoder, choices, platform: str, local_devices: int = 1) -> MemoryPlan:
    """The plan of the bucket that needs the most per chip (``choices``: the backend per bucket); refused when
    the mesh or the memory does not fit."""
    chips, mesh = chips_and_mesh(cfg.runner, local_devices)
    if encoder.num_heads % mesh.model:
        raise MemoryPlanError(
            f"runner.mesh: model: {mesh.model} does not divide the model's {encoder.num_heads} attention heads; "
            f"use a model axis that divides {encoder.num_heads}"
        )
    device_bytes, source = device_memory(cfg.runner, platform)
    # A CPU worker's memory is the host's, unless the config states it.
    checked = device_bytes if platform != "cpu" or cfg.runner.device_memory else None
    params = abstract_params(encoder)
    tokens_per_batch = cfg.batching.tokens_per_batch
    if tokens_per_batch == "auto":  # sized by the largest bucket, the one with the fewest rows
        largest = max(choices, key=lambda c: c.case.seq_len)
        bucket, whole = largest.case.seq_len, largest.backend == "native"
        rows = auto_rows_per_chip(encoder, params, mesh, bucket, whole, checked, platform)
        tokens_per_batch = rows * mesh.data * bucket
    batches = [
        Batch(rows_for(c.case.seq_len, tokens_per_batch), c.case.seq_len, c.backend == "native") for c in choices
    ]
    plan, batch = max(
        ((plan_for(encoder, params, mesh, b, checked, source), b) for b in batches), key=lambda pb: pb[0].needed_bytes
    )
    plan = dataclasses.replace(plan, tokens_per_batch=tokens_per_batch)
    if plan.fits:
        return plan
    fitting = smallest_fitting(encoder, params, chips, batch, checked, source)
    if fitting is not None:
        fix = (
            f"runner.mesh: {{data: auto, model: {fitting.mesh.model}}} (data {fitting.mesh.data} x model "
            f"{fitting.mesh.model} on the worker's {chips} chips: {fitting.describe()})"
        )
    else:
        fix = (
            f"no mesh of this worker's {chips} chips fits it: choose a worker with more chips or more memory per "
            f"chip, a smaller model.dtype, or a smaller batching.tokens_per_batch"
        )
    raise MemoryPlanError(
        f"the model does not fit its chips: {plan.describe()}; {gib_short(plan.needed_bytes)} needed per chip, "
        f"{gib_short(int(HEADROOM * plan.device_bytes))} usable. Use {fix}"
    )


def gib_short(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"

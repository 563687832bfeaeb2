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
    GPU_MEM_FRACTION,
    HEADROOM,
    Batch,
    Chips,
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


def service_options(options: dict) -> list[str]:
    """``dataflow_service_options`` as a list, whether the config gives a list or one string."""
    given = options.get("dataflow_service_options") or []
    return [given] if isinstance(given, str) else list(given)


def accelerator(options: dict) -> dict:
    """The ``worker_accelerator`` service option's fields ({"type": ..., "topology": ..., "count": ...}), or {}."""
    for option in service_options(options):
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


def gpu_fraction(runner) -> float:
    """What JAX's GPU allocator may take of a chip in the workers' environment (runner.worker_env)."""
    env = runner.worker_env
    given = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or env.get("XLA_CLIENT_MEM_FRACTION")
    return float(given) if given else GPU_MEM_FRACTION


def device_memory(runner, platform: str) -> Chips:
    """Each chip's bytes, where that came from, and the share the encoder may use: ``runner.device_memory``,
    else the profile's accelerator type, else (no accelerator named) this machine's chip of that platform."""
    usable = gpu_fraction(runner) if platform == "gpu" else HEADROOM
    if runner.device_memory:
        return Chips(parse_bytes(runner.device_memory), "runner.device_memory", usable, platform)
    kind = accelerator(runner.options).get("type")
    if kind in ACCELERATOR_MEMORY:
        return Chips(ACCELERATOR_MEMORY[kind], f"worker_accelerator type {kind}", usable, platform)
    if kind is None:
        import jax

        local = jax.local_devices()[0]
        stats = local.memory_stats() if local.platform == platform and local.platform != "cpu" else None
        if stats and stats.get("bytes_limit"):  # the allocator's own limit: its fraction already applied
            return Chips(int(stats["bytes_limit"]), f"this machine's {local.device_kind}", HEADROOM, platform)
    if platform == "cpu":
        return Chips(None, "a CPU worker's host memory", usable, platform)
    named = f"worker_accelerator type {kind} is not in docbeam's table" if kind else "no worker_accelerator"
    return Chips(None, f"unknown ({named}): set runner.device_memory, e.g. 16GiB", usable, platform)


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
    if mesh.devices > 1 and cfg.runner.name.endswith("DataflowRunner") and not cfg.runner.one_model_per_vm:
        raise MemoryPlanError(
            f"runner.mesh {mesh} spans {mesh.devices} chips, but runner.one_model_per_vm is false: each of the VM's "
            "SDK processes would build its own encoder on every chip; set runner.one_model_per_vm: true"
        )
    memory = device_memory(cfg.runner, platform)
    # A CPU worker's memory is the host's, unless the config states it.
    if platform == "cpu" and not cfg.runner.device_memory:
        memory = dataclasses.replace(memory, device_bytes=None)
    params = abstract_params(encoder)

    def plan_on(on: MeshShape) -> MemoryPlan:
        """The job on mesh ``on``: its batch (auto: sized for that mesh), the bucket that needs the most."""
        tokens_per_batch = cfg.batching.tokens_per_batch
        if tokens_per_batch == "auto":  # sized by the largest bucket, the one with the fewest rows
            largest = max(choices, key=lambda c: c.case.seq_len)
            bucket, whole = largest.case.seq_len, largest.backend == "native"
            tokens_per_batch = auto_rows_per_chip(encoder, params, on, bucket, whole, memory) * on.data * bucket
        plans = [
            plan_for(
                encoder,
                params,
                on,
                Batch(rows_for(c.case.seq_len, tokens_per_batch), c.case.seq_len, c.backend == "native"),
                memory,
            )
            for c in choices
        ]
        return dataclasses.replace(max(plans, key=lambda p: p.needed_bytes), tokens_per_batch=tokens_per_batch)

    plan = plan_on(mesh)
    if plan.fits:
        return plan
    fitting = smallest_fitting(encoder, chips, plan_on)
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
        f"{gib_short(plan.usable_bytes)} usable. Use {fix}"
    )


def gib_short(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"

"""The loaded encoder of one worker process: parameters on its chips (one, or a mesh of them: models/mesh.py),
one compiled forward per (shape, backend), compiled ahead when the shapes are known, and one timing record per
batch.

It runs the attention backend per bucket it is given (``RuntimeSpec.choices``: the job's plan, or the
worker's re-plan when its platform is not the planned one); it never chooses. What it reports goes through
``RuntimeHooks``, supplied by its owner, so models/ knows nothing of the pipeline's metrics or storage.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from docbeam.attention.dispatch import Choice, bind_choice
from docbeam.attention.on_mesh import on_mesh
from docbeam.attention.settings import AttentionConfig
from docbeam.models.compile_pool import CompilePool
from docbeam.models.mesh import MeshShape, make_mesh, pad_rows, padded_rows, param_shardings, rows_sharding
from docbeam.models.nan_repair import reencode_row_mates
from docbeam.models.profiler import FirstBatchesProfiler

STARTUP_TAG = "startup"  # a timing record's start-up report, taken off before the record is written
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderPlan:
    """The encoder a job runs, as the driver planned it: a part of the job plan (``JobPlan.encoder_plan``) that
    the workers receive as it is. Frozen, picklable and hashable: a process keeps one warm runtime per plan."""

    model_path: str  # model.path, a Hub id's branch pinned to the commit the driver resolved it to
    dtype: str  # model.dtype
    head: Any  # a models/heads Head: its pooling and layers run inside the forward
    attention: AttentionConfig  # the job's attention section as it is: the backends' typed options
    choices: tuple[Choice, ...]  # one per bucket that can receive a batch: the backend that runs it, and why
    platform: str  # the platform the choices were made for
    checked: bool = False  # the driver probed (and with attention.verify gated) them on that platform
    packing: bool = False  # batches carry segment ids and slot lengths
    task: str | None = None  # model.task: the adapter merged into the weights (models/checkpoint.py)
    # What the driver read of the checkpoint (weights' and Dense modules' digests, its config): a warm runtime
    # serves a later job only while these match, so a checkpoint rewritten in place is loaded afresh.
    checkpoint_key: tuple = ()
    mesh: MeshShape = MeshShape()  # runner.mesh: the worker's chips on the data and model axes
    engine: str = "xla"  # runner.engine: xla | openvino | auto (models/engines/)

    def __post_init__(self):
        if not self.choices:
            raise ValueError(
                "EncoderPlan.choices is empty: pass the job plan's choices (JobPlan.choices), one per "
                "bucket; a worker does not choose backends itself"
            )


@dataclasses.dataclass(frozen=True)
class RuntimeSpec:
    """What one worker loads and runs: the job's encoder plan, with the choices this worker runs (the plan's, or
    its re-plan for its own platform) and the shapes it compiles ahead. Frozen and hashable."""

    plan: EncoderPlan
    choices: tuple[Choice, ...]  # one per bucket: the backend that runs it on this worker
    compile_ahead: tuple[tuple[int, int], ...] = ()  # (rows, bucket_len) shapes compiled before their batches
    slots: tuple[tuple[int, int], ...] = ()  # packing: (bucket_len, windows per row) of every bucket
    replanned: str | None = None  # why these choices are not the job plan's ("planned cpu, worker gpu")
    engine_cache: str | None = None  # where OpenVINO's models and auto's verdicts are kept (models/engines/shapes.py)

    @property
    def head(self):
        return self.plan.head

    @property
    def packing(self) -> bool:
        return self.plan.packing


@dataclasses.dataclass(frozen=True)
class RuntimeHooks:
    """How the runtime reports, supplied by its owner."""

    watch: Any  # .in_this_thread() -> (compilations, seconds, persistent-cache hits) of the forward
    fn_name: str  # the jitted forward's name, as ``watch`` counts it
    on_fresh_compile: Callable[[], None] = lambda: None  # a compilation the persistent cache did not serve
    batch_facts: Callable[[Any], dict] = lambda device: {}  # device, worker, memory: added to each record
    publish_trace: Callable[[str], None] | None = None  # a finished profiler trace folder
    profile_batches: int = 0


# XLA:CPU's memory-optimized scheduler orders the forward so fewer intermediates are live at once: a long
# document's forward needs less memory, at about the same speed (`python benchmarks/cpu_scheduler.py`,
# benchmarks/results/cpu_scheduler.json; the figures in CHANGELOG.md, 2026-12-06). Other platforms compile with
# XLA's defaults.
CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def compiler_options(platform: str) -> dict | None:
    """The options the encoder's forward is compiled with on ``platform`` (None: XLA's defaults)."""
    return dict(CPU_COMPILER_OPTIONS) if platform == "cpu" else None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a worker's encoder lives: one chip, or a mesh of them. ``params`` and ``rows`` are the
    shardings of the parameters and of a batch's arrays (and the forward's output)."""

    mesh: Any  # jax.sharding.Mesh (one chip: a 1x1 mesh)
    shape: MeshShape  # the mesh's axes, ``auto`` resolved on this worker's chips

    @classmethod
    def of(cls, shape: MeshShape) -> "Placement":
        mesh = make_mesh(shape)
        return cls(mesh, MeshShape(mesh.shape["data"], mesh.shape["model"]))

    @property
    def device(self):
        """The mesh's first chip: what a single-chip record names."""
        return self.mesh.devices.flat[0]

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    def rows(self):
        return rows_sharding(self.mesh)

    def params(self, params):
        return param_shardings(params, self.mesh)

    def put_rows(self, arrays) -> list:
        """A batch's arrays, rows padded to the data axis (None stays None), on the chips."""
        import jax

        sharding = self.rows()
        padded = pad_rows(arrays, self.shape.data)
        return [x if x is None else jax.device_put(x, sharding) for x in padded]


def load(spec: RuntimeSpec, fn_name: str):
    """(placement, EncoderConfig, parameters on its chips, {backend: jitted forward named ``fn_name``})."""
    import jax

    from docbeam.models import checkpoint, encoder

    plan = spec.plan
    placement = Placement.of(plan.mesh)
    device = placement.device
    ck = checkpoint.open_checkpoint(plan.model_path, plan.dtype, with_weights=True, task=plan.task)
    params = checkpoint.load_params(ck.folder, ck.config)
    # The head's layers (sentence-transformers' Dense modules, a classifier) run inside the jitted forward,
    # right after pooling.
    head = plan.head
    if head.layers or head.reduce is not None:
        params = {"encoder": params, "head": head.load_params(ck.folder)}
    forwards = {}
    for name in sorted({c.backend for c in spec.choices}):
        attend = on_mesh(bind_choice(plan.attention, name), placement.mesh)
        embed = encoder.embed_fn(ck.config, attend, head.pooling, head.layers, head.reduce)

        def forward(params, ids_BxT, lengths_B, *packed, embed=embed):
            return embed(params, ids_BxT, lengths_B, *packed)

        forward.__name__ = forward.__qualname__ = fn_name  # the owner's compile watch counts by this name
        forwards[name] = jax.jit(
            forward, out_shardings=placement.rows(), compiler_options=compiler_options(device.platform)
        )
    return placement, ck.config, jax.block_until_ready(jax.device_put(params, placement.params(params))), forwards


def engine_set(spec: RuntimeSpec, placement: Placement):
    """The runtime's engines (models/engines/shapes.py), or None where ``runner.engine`` is xla."""
    if spec.plan.engine == "xla":
        return None
    from docbeam.models.engines.export import Recipe
    from docbeam.models.engines.shapes import EngineSet, engine_folder

    plan = spec.plan
    return EngineSet(
        requested=plan.engine,
        platform=placement.device.platform,
        chips=len(placement.devices),
        dtype=plan.dtype,
        model_key=(plan.model_path, plan.checkpoint_key, repr(plan.head), plan.task, plan.packing),
        recipe=lambda backend: Recipe(plan.model_path, plan.head, plan.attention, backend, plan.task),
        folder=engine_folder(spec.engine_cache),
    )


def window_outputs(head, pooled: np.ndarray, batch):
    """Each window's output in ``batch.windows``' order: its vector (rows of an array), or for a multi-vector
    head, whose forward gives every token's vector, the list of its kept token vectors (the head cuts them)."""
    per_token = head.window_vectors
    return per_token(pooled, batch) if per_token else pooled.reshape(-1, pooled.shape[-1])[batch.window_slots()]


def forward_inputs(batch) -> tuple:
    """The forward's arguments for ``batch``: packed rows add segment ids and slot lengths, late chunking's
    context windows their chunks' spans (models/encoder.py embed_fn)."""
    if batch.packed:
        return batch.ids_BxT, batch.lengths_B, batch.segment_ids_BxT, batch.slot_lengths_BxK
    if batch.spans_BxKx3 is not None:
        return batch.ids_BxT, batch.lengths_B, None, None, batch.spans_BxKx3[..., :2]
    return batch.ids_BxT, batch.lengths_B


def measurement_once(told: set[int], choice: Choice) -> str:
    """auto's measurement of the batch's bucket (JSON) on a job's first batch of the bucket only (``told``: the
    buckets already told): the summary reads each worker's measurement from it, and the other records stay small."""
    if choice.measurement is None or choice.case.seq_len in told:
        return ""
    told.add(choice.case.seq_len)
    return json.dumps(choice.measurement.as_dict(), sort_keys=True)


class EncoderRuntime:
    """Parameters on device, one jitted forward per backend of ``spec.choices``, the compile pool."""

    def __init__(self, spec: RuntimeSpec, hooks: RuntimeHooks, startup: dict | None = None, job: str = ""):
        self.spec, self.hooks, self._job = spec, hooks, job
        t0 = time.perf_counter()
        self.placement, self.config, self.params, self.forwards = load(spec, hooks.fn_name)
        self.engines = engine_set(spec, self.placement)
        self.choices = {c.case.seq_len: c for c in spec.choices}
        self._shapes_seen: set = set()
        self._measurements_told: set[int] = set()  # buckets whose auto measurement a record has carried
        self.profiler = FirstBatchesProfiler(hooks.profile_batches, hooks.publish_trace)
        # Worker threads share it; one batch at a time keeps compile counts, shapes and profiles per batch.
        self._lock = threading.Lock()
        self._report_lock = threading.Lock()  # the bundle's end takes the report outside a batch
        self._startup = {**(startup or {}), "checkpoint_s": time.perf_counter() - t0}
        # Longest bucket first: it has the fewest rows and takes every full window of a long document, so its
        # first batch tends to fill first (on the sample the first batch is bucket 256's).
        keys = [(self.choices[b].backend, (rows, b)) for rows, b in sorted(spec.compile_ahead, key=lambda s: -s[1])]
        self._shapes_seen.update(keys)
        self.pool = CompilePool(functools.partial(compile_shape, self), keys)

    @property
    def device(self):
        """The encoder's first chip (its only one without a mesh)."""
        return self.placement.device

    def serve(self, job: str) -> EncoderRuntime:
        """This runtime, for ``job``: one that finds it loaded by an earlier job is told so (``reused_s``)."""
        with self._report_lock:
            if job != self._job:
                self.pool.take_finished()  # the earlier job's compilations, finished after its end
                self._job, self._startup = job, {"reused_s": 0.0}
                self._measurements_told = set()  # each job's summary gets auto's measurements of its own
        return self

    def take_startup_report(self, wait: bool = False) -> dict | None:
        """What loading cost (once) and the compilations finished in the background since the last report;
        ``wait``: after every one has finished. None when there is nothing new."""
        if wait:
            self.pool.wait()
        with self._report_lock:
            report, self._startup = self._startup or {}, None
            compiles = self.pool.take_finished()
        if not report and not compiles:
            return None
        return {**report, "compiles": compiles}

    def finish_profile(self) -> None:
        with self._lock:
            self.profiler.finish()

    def encode(self, batch) -> tuple[np.ndarray, dict]:
        """The batch's window outputs (``window_outputs``) and its timing record (with any start-up news)."""
        with self._lock:
            self.profiler.before_batch()
            vectors, timing = self._encode(batch)
            self.profiler.after_batch()
            report = self.take_startup_report()
            if report is not None:
                timing[STARTUP_TAG] = report
            return vectors, timing

    def _encode(self, batch) -> tuple[np.ndarray, dict]:
        import jax

        choice = self.choices[batch.bucket_len]
        started_at = datetime.datetime.now(datetime.timezone.utc)
        t0 = time.perf_counter()
        late = batch.spans_BxKx3 is not None  # late chunking's context windows: unpacked, compiled at first use
        if batch.packed != self.spec.packing and not late:
            raise ValueError(
                f"batch {batch.batch_id} is {'' if batch.packed else 'not '}packed, but this encoder was "
                f"built for batching.packing: {self.spec.packing}"
            )
        inputs = forward_inputs(batch)
        watch, compiling = self.hooks.watch, self.pool.pending()
        compiles_before, compile_s_before, hits_before = watch.in_this_thread()
        key = (choice.backend, batch.ids_BxT.shape, *(("late",) if late else ()))
        forward, waited_s = self.pool.executable(key) if not late else (None, 0.0)
        forward = forward or self.forwards[choice.backend]  # a shape not planned for: jit compiles it now
        device_inputs = self.placement.put_rows(inputs)
        verdict, told = engine_for_batch(self, key, forward, device_inputs, batch)
        forward = self.engines.forward(key, forward) if self.engines is not None else forward
        t1 = time.perf_counter()
        pooled = jax.block_until_ready(forward(self.params, *device_inputs))
        t2 = time.perf_counter()
        vectors = window_outputs(self.spec.head, np.asarray(pooled)[: batch.rows], batch)
        alone = (
            reencode_row_mates(
                lambda *rows: np.asarray(forward(self.params, *self.placement.put_rows(rows)))[: len(rows[0])],
                batch,
                vectors,
                self.spec.head.window_vectors,
            )
            if batch.packed
            else []
        )
        t3 = time.perf_counter()
        compiles_after, compile_s_after, hits_after = watch.in_this_thread()
        compiled = compiles_after > compiles_before
        if compiled and not hits_after - hits_before:
            self.hooks.on_fresh_compile()
        if compiled and key in self._shapes_seen and not self.pool.planned(key):
            log.warning("recompiled the encoder for shape %s (backend %s) after warm-up", key[1], key[0])
        self._shapes_seen.add(key)
        return vectors, {
            "batch_id": batch.batch_id,
            "bucket_len": batch.bucket_len,
            "rows": batch.rows,
            "real_rows": batch.real_rows,
            "real_tokens": batch.real_tokens,
            "packed": batch.packed,
            "reencoded_alone": len(alone),
            # What the chips computed: on a mesh the rows padded to the data axis too.
            "padded_tokens": padded_rows(batch.rows, self.placement.shape.data) * batch.ids_BxT.shape[1],
            "attention_backend": choice.backend,
            "attention_requested": choice.requested,
            "attention_kernel": choice.kernel,
            "fallback_reason": choice.fallback_reason,
            "attention_measured": measurement_once(self._measurements_told, choice),
            "replanned": self.spec.replanned,
            # The engine that compiled and ran the forward (models/engines/), why, and its first batch's figures.
            "engine": verdict.engine if verdict is not None else "xla",
            "engine_reason": verdict.reason if verdict is not None else "runner.engine: xla",
            "engine_measured": told,
            "compiled": compiled,
            # Compiling this batch's shape, or waiting for its compilation in the background.
            "compile_ms": round((compile_s_after - compile_s_before + waited_s) * 1e3, 3),
            "compile_cache_hits": hits_after - hits_before,
            "compiling_ahead": max(compiling, self.pool.pending()),  # start-up compilations beside it
            "compute_ms": round((t2 - t1) * 1e3, 3),
            "total_ms": round((t3 - t0) * 1e3, 3),
            "started_at": started_at.isoformat(),
            "mesh": self.placement.shape.as_dict(),
            **self.hooks.batch_facts(self.placement.devices),
        }


def compile_shape(runtime: EncoderRuntime, backend: str, shape: tuple[int, int]):
    """The executable for one (rows, bucket) shape, and what it cost (counted in the calling thread)."""
    import jax

    hits = runtime.hooks.watch.in_this_thread()[2]
    t0 = time.perf_counter()
    rows = runtime.placement.rows()
    shape = (padded_rows(shape[0], runtime.placement.shape.data), shape[1])
    inputs = [shape, shape[:1]]
    if runtime.spec.packing:  # segment ids [rows, bucket] and slot lengths [rows, slots]
        inputs += [shape, (shape[0], dict(runtime.spec.slots)[shape[1]])]
    abstract = [jax.ShapeDtypeStruct(s, np.int32, sharding=rows) for s in inputs]
    executable = runtime.forwards[backend].lower(runtime.params, *abstract).compile()
    record = {
        "backend": backend,
        "rows": shape[0],
        "bucket_len": shape[1],
        "seconds": time.perf_counter() - t0,
        "cache_hits": runtime.hooks.watch.in_this_thread()[2] - hits,
    }
    if runtime.engines is not None:
        executable = runtime.engines.prepare(backend, executable, tuple(tuple(a.shape) for a in abstract))
        record["openvino_s"] = round(executable.compile_s, 3)
        record["openvino_refused"] = executable.refused
    if not record["cache_hits"]:
        runtime.hooks.on_fresh_compile()
    return executable, record


def engine_for_batch(runtime: EncoderRuntime, key, forward, device_inputs, batch):
    """(the shape's engine verdict, its figures as JSON once per shape or ''); (None, '') without engines."""
    if runtime.engines is None:
        return None, ""
    head = runtime.spec.head
    return runtime.engines.for_batch(
        key,
        forward,
        runtime.forwards[key[0]],
        runtime.params,
        device_inputs,
        lambda out: window_outputs(head, np.asarray(out)[: batch.rows], batch),
        runtime.pool.wait,
    )

"""Encode: padded Batches → window embeddings and one timing record per batch, through RunInference.

Each worker process loads the encoder once (RunInference shares it via ``shared.Shared``; models/runtime.py
holds it) and runs the job plan's attention backend per bucket (``EncoderPlan.choices``). Only a worker whose
platform is not the planned one chooses again, for its own platform, and each of its timing records says so
(``replanned``). Shapes compile ahead in background threads when the spec says how many rows a bucket's
batches have (``tokens_per_batch``); otherwise each at its first batch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Iterable, Sequence

import apache_beam as beam
from apache_beam.metrics import Metrics

from docbeam.attention.dispatch import Choice, replan
from docbeam.models.runtime import STARTUP_TAG, EncoderPlan, EncoderRuntime, RuntimeHooks, RuntimeSpec
from docbeam.pipeline import compat
from docbeam.pipeline.records import Batch, WindowEmbedding
from docbeam.pipeline.telemetry.observe import (
    COMPILE_MS,
    COMPUTE_MS,
    ENCODER_FN_NAME,
    FALLBACKS,
    METRICS_NAMESPACE,
    STARTUP_MS,
    STARTUP_PARTS,
    CompileWatch,
    Progress,
    StageClock,
    describe_devices,
    fallback_key,
    memory,
    metric_name,
    shape_label,
    worker_name,
)

# RunInference's module, imported without its optional ModelManager (which imports torch): pipeline/compat.py.
run_inference = compat.run_inference_without_model_manager()
ModelHandler, PredictionResult, RunInference = (
    run_inference.ModelHandler,
    run_inference.PredictionResult,
    run_inference.RunInference,
)

TIMING_TAG = "timing"
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    """All a worker needs to build the encoder: the job plan's encoder part as it is (``plan``: the model, its
    head, the attention section and the backend per bucket; the worker runs those choices as they are), and how
    this run's workers load and report it. Small, picklable, hashable: the process keeps one runtime per spec."""

    plan: EncoderPlan  # pipeline.driver.plan.JobPlan.encoder_plan, referenced, not copied
    profile_batches: int = 0
    profile_dir: str | None = None
    progress_seconds: float = 10.0  # 0: no progress lines
    one_model_per_vm: bool = False  # RunInference shares one runtime between the VM's SDK processes
    compilation_cache: str | None = None  # JAX's persistent cache, local or gs:// (pipeline/stages/compile_cache.py)
    worker_env: tuple[tuple[str, str], ...] = ()  # set before the encoder loads
    tokens_per_batch: int | None = None  # batching.tokens_per_batch: compile every shape ahead; None: at first use
    job: str = dataclasses.field(default="", compare=False)  # the run it is for: not part of the runtime's key


def worker_choices(spec: EncoderSpec, platform: str) -> tuple[tuple[Choice, ...], str | None]:
    """(what this worker runs per bucket, why it is not the plan's or None). The plan's choices as they are
    on the planned platform (gated here when the driver could not run them and attention.verify is set); on
    another platform the planned buckets chosen again for this one."""
    from docbeam.attention.dispatch import gate

    plan = spec.plan
    if platform != plan.platform:
        log.warning(
            "job was planned for %s but this worker has %s; re-planning attention here", plan.platform, platform
        )
        choices, why = replan(plan.attention, plan.choices, platform), f"planned {plan.platform}, worker {platform}"
    elif plan.attention.verify and not plan.checked:
        choices, why = tuple(gate(plan.attention, list(plan.choices))), None
    else:
        choices, why = plan.choices, None
    return measured_here(spec, choices), why


def measured_here(spec: EncoderSpec, choices: tuple[Choice, ...]) -> tuple[Choice, ...]:
    """``attention.backend: auto``: the buckets the driver could not measure on this kind of chip (another platform,
    or another processor: a laptop's plan on a c3 worker) measured here, once per process, or read from the
    measurement cache beside the compilation cache."""
    import jax

    from docbeam.attention.candidates import AUTO
    from docbeam.attention.measure import device_kind
    from docbeam.config import BatchingConfig
    from docbeam.pipeline.stages.measurement_cache import measured_on_this_chip

    if not any(c.requested == AUTO for c in choices):
        return choices
    here = device_kind()
    stale = [
        dataclasses.replace(c, backend="native", measurement=None)
        if c.requested == AUTO and (c.measurement is None or c.measurement.device != here)
        else c
        for c in choices
    ]
    if not any(c.to_measure for c in stale):
        return choices
    mesh = spec.plan.mesh.on(len(jax.local_devices()))
    tokens = spec.tokens_per_batch or BatchingConfig().tokens_per_batch
    return measured_on_this_chip(spec.plan.attention, stale, tokens, mesh, spec.compilation_cache)


def load_encoder(spec: EncoderSpec) -> EncoderRuntime:
    """The worker's encoder: its compile cache set up, the plan's choices (or this platform's), each probed
    once per process (a broken backend fails the job here), then the runtime loaded."""
    import jax

    from docbeam.attention.probe_once import probe_all
    from docbeam.pipeline.stages.compile_cache import CompileCache
    from docbeam.pipeline.stages.packer import max_windows_per_row, rows_for
    from docbeam.pipeline.store import storage

    t0 = time.perf_counter()
    # Before the first compilation (the attention probes compile too).
    cache = CompileCache(spec.compilation_cache) if spec.compilation_cache else None
    choices, replanned = worker_choices(spec, jax.devices()[0].platform)
    probe_all(spec.plan.attention, choices)  # on the DirectRunner the driver has probed them already: no cost
    buckets = sorted(c.case.seq_len for c in choices)
    runtime_spec = RuntimeSpec(
        spec.plan,
        choices,
        compile_ahead=tuple((rows_for(b, spec.tokens_per_batch), b) for b in buckets) if spec.tokens_per_batch else (),
        slots=tuple((b, max_windows_per_row(b)) for b in buckets),
        replanned=replanned,
        engine_cache=cache.local if cache is not None else None,
    )
    publish = (
        (lambda trace: storage.copy_tree(trace, f"{spec.profile_dir}/{worker_name().replace(':', '-')}"))
        if spec.profile_dir
        else None
    )
    hooks = RuntimeHooks(
        CompileWatch.get(),
        ENCODER_FN_NAME,
        cache.push if cache is not None else (lambda: None),
        batch_facts=lambda devices: {"device": describe_devices(devices), "worker": worker_name(), **memory(devices)},
        publish_trace=publish,
        profile_batches=spec.profile_batches,
    )
    return EncoderRuntime(runtime_spec, hooks, startup={"probes_s": time.perf_counter() - t0}, job=spec.job)


_RUNTIMES: dict[EncoderSpec, EncoderRuntime] = {}  # at most one: the process's warm encoder
_RUNTIMES_LOCK = threading.Lock()


def runtime_for(spec: EncoderSpec) -> EncoderRuntime:
    """The process's runtime for ``spec`` (its ``job`` aside), loaded at the first call and kept warm.

    RunInference's ``shared.Shared`` holds the model only while a DoFn instance references it; the
    DirectRunner tears instances down between stages (GroupIntoBatches flushes its partial batches in a
    later bundle), and a reload would recompile every shape. A later job in the same process with the same
    spec (a scheduler or notebook calling docbeam.run again, the DirectRunner's in-memory workers) starts warm
    and its summary says so; one with another spec replaces it, so a long-lived process holds one encoder,
    not one per job.
    """
    with _RUNTIMES_LOCK:
        runtime = _RUNTIMES.get(spec)
        if runtime is None:
            _RUNTIMES.clear()  # before loading: the old one's memory is free for the new one
            runtime = _RUNTIMES[spec] = load_encoder(spec)
    return runtime.serve(spec.job)


def stop_compiling(spec: EncoderSpec) -> None:
    """Drop the compilations not started yet of this process's runtime of ``spec``, if it has one (a job that
    ended before its batches needed them)."""
    with _RUNTIMES_LOCK:
        runtime = _RUNTIMES.get(spec)
    if runtime is not None:
        runtime.pool.stop()


class EncoderHandler(ModelHandler[Batch, PredictionResult, EncoderRuntime]):
    """RunInference's contract: load once per process (or once per VM), run pre-built batches one at a time.

    With ``one_model_per_vm`` the first SDK process on a VM builds the runtime and serves it (Beam's
    MultiProcessShared); the others send it their batches, so one process owns the accelerator and the
    weights, the checkpoint copy and the compilations happen once per VM.
    """

    def __init__(self, spec: EncoderSpec):
        super().__init__()
        self._spec = spec
        self._env_vars = dict(spec.worker_env)  # ModelHandler.set_environment_vars applies them in setup()

    def load_model(self) -> EncoderRuntime:
        return runtime_for(self._spec)

    def share_model_across_processes(self) -> bool:
        return self._spec.one_model_per_vm

    def model_copies(self) -> int:
        return 1  # one device per VM: a second copy would fight the first for it

    def run_inference(
        self, batch: Sequence[Batch], model: EncoderRuntime, inference_args: dict[str, Any] | None = None
    ) -> Iterable[PredictionResult]:
        from docbeam.pipeline.telemetry.observe import worker_name

        results = []
        for b in batch:
            vectors, timing = model.encode(b)
            # Which SDK process sent the batch; "worker" says which one encoded it (the same unless shared).
            results.append(PredictionResult(b, (vectors, {**timing, "requested_by": worker_name()})))
        return results

    def batch_elements_kwargs(self):
        return {"min_batch_size": 1, "max_batch_size": 1}  # batches are already shaped by BucketBatches

    def get_metrics_namespace(self) -> str:
        return METRICS_NAMESPACE


class _SplitResults(beam.DoFn):
    def __init__(self, spec: EncoderSpec):
        self._spec = spec
        self._progress_seconds = spec.progress_seconds
        self._progress = None
        self._real = Metrics.counter(METRICS_NAMESPACE, "real_tokens")
        self._padded = Metrics.counter(METRICS_NAMESPACE, "padded_tokens")
        self._batches = Metrics.counter(METRICS_NAMESPACE, "batches")
        self._compiles = Metrics.counter(METRICS_NAMESPACE, "compiles")
        self._clock = StageClock("encode")

    def process(self, result: PredictionResult, total_windows: int):
        batch: Batch = result.example
        vectors, timing = result.inference
        startup = timing.pop(STARTUP_TAG, None)
        if startup is not None:
            yield beam.pvalue.TaggedOutput(STARTUP_TAG, self._report_startup(startup))
        self._clock.add(timing["total_ms"] / 1e3)
        if self._progress is None:
            self._progress = Progress(self._progress_seconds, total_windows)
        late = batch.spans_BxKx3 is not None  # its windows are late chunks, whose documents finish elsewhere
        finished_docs = 0 if late else sum(1 for w in batch.windows if w.index == w.num_windows - 1)
        self._progress.update(finished_docs, batch.real_rows, batch.real_tokens)
        self._real.inc(timing["real_tokens"])
        self._padded.inc(timing["padded_tokens"])
        self._batches.inc()
        self._compiles.inc(int(timing["compiled"]))
        if not timing["compiled"]:  # a compiling call's time is mostly compilation, not device work
            name = metric_name(COMPUTE_MS, f"{timing['bucket_len']},{timing['attention_backend']}")
            Metrics.distribution(METRICS_NAMESPACE, name).update(int(round(timing["compute_ms"])))
        if timing["fallback_reason"]:
            key = fallback_key(
                timing["attention_requested"], timing["attention_backend"], timing["fallback_reason"][:80]
            )
            Metrics.counter(METRICS_NAMESPACE, metric_name(FALLBACKS, key)).inc()
        yield beam.pvalue.TaggedOutput(TIMING_TAG, timing)
        for w, length, vector in zip(batch.windows, batch.window_lengths(), vectors):
            vector = self._spec.plan.head.compact_window(vector)  # the sparse head's: its nonzero terms only
            yield WindowEmbedding(
                w.doc_id,
                w.index,
                w.num_windows,
                int(length),
                w.doc_tokens,
                w.truncated,
                vector,
                batch.bucket_len,
                timing["attention_backend"],
                w.char_start,
                w.char_end,
                late=late,
            )

    def _report_startup(self, startup: dict) -> dict:
        """Beam metrics (startup_ms[...] and compile_ms[<rows>x<bucket>,<backend>]) and one record for
        the summary from an encoder's start-up report."""
        for part in STARTUP_PARTS:
            if f"{part}_s" in startup:
                Metrics.distribution(METRICS_NAMESPACE, metric_name(STARTUP_MS, part)).update(
                    int(round(startup[f"{part}_s"] * 1e3))
                )
        for c in startup["compiles"]:
            label = shape_label(c["rows"], c["bucket_len"], c["backend"])
            Metrics.distribution(METRICS_NAMESPACE, metric_name(COMPILE_MS, label)).update(
                int(round(c["seconds"] * 1e3))
            )
        self._compiles.inc(len(startup["compiles"]))
        return {**startup, "worker": worker_name()}

    def finish_bundle(self):
        for runtime in list(_RUNTIMES.values()):
            runtime.finish_profile()
        # The compilations that finished after this process's last batch of the bundle (shapes still to come,
        # or that no batch used) count too; waiting for them here also lets no compilation outlive the job.
        runtime = _RUNTIMES.get(self._spec)
        report = runtime.take_startup_report(wait=True) if runtime is not None else None
        if report is not None:
            from apache_beam.transforms.window import GlobalWindow
            from apache_beam.utils.windowed_value import WindowedValue

            yield beam.pvalue.TaggedOutput(
                STARTUP_TAG,
                WindowedValue(self._report_startup(report), GlobalWindow().max_timestamp(), [GlobalWindow()]),
            )


class Encode(beam.PTransform):
    """Outputs ``windows`` (WindowEmbedding), ``timing`` (one dict per batch) and ``startup`` (what loading
    each encoder cost: seconds to load the checkpoint and to probe the backends, once, and each shape's
    compilation ahead of its batches as it finishes).

    ``total_windows`` (a one-element PCollection) lets progress lines give an ETA.
    """

    def __init__(self, spec: EncoderSpec, total_windows):
        super().__init__()
        self._spec = spec
        self._total_windows = total_windows

    def expand(self, batches):
        results = (
            batches
            | "RunInference" >> RunInference(EncoderHandler(self._spec))
            | "Split"
            >> beam.ParDo(
                _SplitResults(self._spec), total_windows=beam.pvalue.AsSingleton(self._total_windows)
            ).with_outputs(TIMING_TAG, STARTUP_TAG, main="windows")
        )
        return {"windows": results.windows, "timing": results[TIMING_TAG], "startup": results[STARTUP_TAG]}

"""Encode: padded Batches → window embeddings and one timing record per batch, through RunInference.

Each worker process loads the encoder once (RunInference shares it via ``shared.Shared``), decides per
bucket which attention backend runs (capability checks, fallback, optional parity gate), and compiles
every (bucket, rows) shape once: as it loads it starts compiling all of them in background threads when the
spec says how many rows a bucket's batches have (``tokens_per_batch``); otherwise each at its first batch.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Iterable, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

# Beam's RunInference module imports its ModelManager when it can, and that imports torch (1.4 s and
# ~300 MB on the 2-core test machine) wherever torch is installed. docbeam never uses the ModelManager, and
# RunInference treats it as optional (an ImportError leaves it None), so this process does without it.
if "apache_beam.ml.inference.base" not in sys.modules:
    sys.modules.setdefault("apache_beam.ml.inference.model_manager", None)
    import resource

    import apache_beam.ml.inference.base as _run_inference

    # The same try block imports `resource` first and sets it to None on the ImportError: give it back, so
    # RunInference still reports the process's memory.
    _run_inference.resource = _run_inference.resource or resource
from apache_beam.ml.inference.base import ModelHandler, PredictionResult, RunInference  # noqa: E402

from attention.plan import AttentionSpec, bind_choice, choose_backends, gate
from pipeline.telemetry.observe import (ENCODER_FN_NAME, METRICS_NAMESPACE, CompileWatch, Progress, StageClock,
                                        describe_device, fallback_key, memory, worker_name)
from pipeline.records import Batch, WindowEmbedding

TIMING_TAG = "timing"
STARTUP_TAG = "startup"  # what loading an encoder cost, as it becomes known (summary.json's breakdown)
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    """All a worker needs to build the encoder: small and picklable."""

    model_path: str
    dtype: str
    pooling: str
    buckets: tuple[int, ...]
    attention: AttentionSpec
    platform: str = "auto"  # the platform the job was planned for; "auto": whatever the worker has
    profile_batches: int = 0
    profile_dir: str | None = None
    progress_seconds: float = 10.0  # 0: no progress lines
    one_model_per_vm: bool = False  # RunInference shares one runtime between the VM's SDK processes
    compilation_cache: str | None = None  # JAX's persistent cache, local or gs:// (pipeline/driver/compile_cache.py)
    worker_env: tuple[tuple[str, str], ...] = ()  # set before the encoder loads
    tokens_per_batch: int | None = None  # batching.tokens_per_batch: compile every shape ahead; None: at first use
    packing: bool = False  # batching.packing: batches carry segment ids and slot lengths


class EncoderRuntime:
    """The loaded encoder of one worker process: parameters on device, one jitted forward per backend."""

    def __init__(self, spec: EncoderSpec):
        import jax

        from models import checkpoint, encoder
        from pipeline.driver.compile_cache import CompileCache
        from pipeline.driver.plan import attention_cases, probe_all

        self.spec = spec
        t0 = time.perf_counter()
        # Before the first compilation (the attention probes below compile too).
        self.compile_cache = CompileCache(spec.compilation_cache) if spec.compilation_cache else None
        self.device = jax.devices()[0]
        platform = self.device.platform
        if spec.platform not in ("auto", platform):
            log.warning("job was planned for %s but this worker has %s; re-planning attention here",
                        spec.platform, platform)
        ck = checkpoint.open_checkpoint(spec.model_path, spec.dtype, with_weights=True)
        self.config = ck.config
        params = checkpoint.load_params(ck.folder, ck.config)
        # sentence-transformers' Dense modules run inside the jitted forward, right after pooling.
        activations = tuple(d.activation for d in ck.settings.dense)
        if activations:
            params = {"encoder": params, "dense": checkpoint.load_dense(ck.folder, ck.settings)}
        self.params = jax.block_until_ready(jax.device_put(params, self.device))
        t1 = time.perf_counter()
        choices = choose_backends(spec.attention, attention_cases(ck.config, spec.buckets, platform, spec.packing))
        if spec.attention.verify:
            choices = gate(spec.attention, choices)
        # Always, on the platform that will run it: a broken backend fails the job here. Once per process:
        # on the DirectRunner the driver has probed them already.
        probe_all(spec.attention, choices)
        self.choices = {c.case.seq_len: c for c in choices}
        t2 = time.perf_counter()
        self.watch = CompileWatch.get()
        self._forward = {}
        for name in sorted({c.backend for c in choices}):
            embed = encoder.embed_fn(ck.config, bind_choice(spec.attention, name), spec.pooling, activations)

            def forward(params, ids_BxT, lengths_B, *packed, embed=embed):
                return embed(params, ids_BxT, lengths_B, *packed)

            forward.__name__ = forward.__qualname__ = ENCODER_FN_NAME  # CompileWatch counts by this name
            self._forward[name] = jax.jit(forward)
        self._batches_done = 0
        self._shapes_seen: set = set()
        self._profiling = False
        # Worker threads share this runtime; one batch at a time keeps the compile count, the shapes seen
        # and the profiler per batch, and costs nothing with one device.
        self._lock = threading.Lock()
        self._reports_lock = threading.Lock()  # the background compilations add to the reports
        self._startup_report = {"checkpoint_s": t1 - t0, "probes_s": t2 - t1}
        self._finished_compiles: list[dict] = []  # compiled ahead, not yet reported
        self._compiling: dict = {}  # (backend, (rows, bucket)) → Future of its executable
        if spec.tokens_per_batch:
            self._compile_ahead(choices)

    def _compile_ahead(self, choices) -> None:
        """Start compiling every (bucket, rows) shape in background threads (XLA compiles without the GIL),
        so batches find their executable ready; a batch whose shape has not started yet compiles it itself
        rather than wait behind the others."""
        from pipeline.stages.packer import rows_for

        # One core fewer than the machine has: the worker's own stages (reading, tokenizing, and on the
        # DirectRunner all of Beam) keep one, or they would wait behind the compilations they overlap.
        workers = max(1, min(len(choices), (os.cpu_count() or 2) - 1))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="docbeam-compile")
        # Longest bucket first: it has the fewest rows and takes every full window of a long document, so
        # its first batch tends to fill first (on the sample the first batch is bucket 256's).
        for choice in sorted(choices, key=lambda c: -c.case.seq_len):
            key = (choice.backend, (rows_for(choice.case.seq_len, self.spec.tokens_per_batch), choice.case.seq_len))
            self._compiling[key] = self._pool.submit(self._compile_in_background, *key)
            self._shapes_seen.add(key)

    def _compile(self, backend: str, shape: tuple[int, int]):
        """The executable for one (rows, bucket) shape, and what it cost (counted in the calling thread)."""
        import jax

        from pipeline.stages.packer import max_windows_per_row

        hits = self.watch.in_this_thread()[2]
        t0 = time.perf_counter()
        packed = ()
        if self.spec.packing:  # segment ids [rows, bucket] and slot lengths [rows, slots]
            packed = (jax.ShapeDtypeStruct(shape, np.int32),
                      jax.ShapeDtypeStruct((shape[0], max_windows_per_row(shape[1])), np.int32))
        executable = self._forward[backend].lower(self.params, jax.ShapeDtypeStruct(shape, np.int32),
                                                  jax.ShapeDtypeStruct(shape[:1], np.int32), *packed).compile()
        record = {"backend": backend, "rows": shape[0], "bucket_len": shape[1],
                  "seconds": time.perf_counter() - t0, "cache_hits": self.watch.in_this_thread()[2] - hits}
        if self.compile_cache is not None and not record["cache_hits"]:
            self.compile_cache.push()
        return executable, record

    def _compile_in_background(self, backend: str, shape: tuple[int, int]):
        executable, record = self._compile(backend, shape)
        with self._reports_lock:
            self._finished_compiles.append(record)
        return executable

    def _executable(self, backend: str, shape: tuple[int, int]):
        """(what to call for this shape, seconds spent waiting for its compilation in the background)."""
        future = self._compiling.get((backend, shape))
        if future is None:  # a shape not planned for: jit compiles it at this call
            return self._forward[backend], 0.0
        if future.cancel():  # not started: compile it here, as this batch's compilation
            executable, _ = self._compile(backend, shape)
            future = self._compiling[(backend, shape)] = concurrent.futures.Future()
            future.set_result(executable)
            return executable, 0.0
        if future.done():
            return future.result(), 0.0
        t0 = time.perf_counter()
        executable = future.result()
        return executable, time.perf_counter() - t0

    def stop_compiling(self) -> None:
        """Drop the compilations not started yet (a job that ended before its batches needed them); a batch
        that comes later compiles its shape itself."""
        if self._compiling:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def take_startup_report(self, wait: bool = False) -> dict | None:
        """What loading this encoder cost (checkpoint and probes, once) and the compilations finished in the
        background since the last report; ``wait``: after every one has finished. None when there is
        nothing new. Batches carry these to the job's metrics and summary."""
        if wait:
            for future in list(self._compiling.values()):
                if not future.cancelled():
                    future.result()
        with self._reports_lock:
            report, self._startup_report = self._startup_report or {}, None
            compiles, self._finished_compiles = self._finished_compiles, []
        if not report and not compiles:
            return None
        return {**report, "compiles": compiles}

    def encode(self, batch: Batch) -> tuple[np.ndarray, dict]:
        with self._lock:
            vectors, timing = self._encode(batch)
            report = self.take_startup_report()
            if report is not None:
                timing[STARTUP_TAG] = report  # taken off by _SplitResults before the timing record is written
            return vectors, timing

    def _encode(self, batch: Batch) -> tuple[np.ndarray, dict]:
        import jax

        self._maybe_start_profile()
        choice = self.choices[batch.bucket_len]
        started_at = datetime.datetime.now(datetime.timezone.utc)
        t0 = time.perf_counter()
        if batch.packed != self.spec.packing:
            raise ValueError(f"batch {batch.batch_id} is {'' if batch.packed else 'not '}packed, but this encoder was "
                             f"built for batching.packing: {self.spec.packing}")
        inputs = (batch.ids_BxT, batch.lengths_B) + ((batch.segment_ids_BxT, batch.slot_lengths_BxK)
                                                     if batch.packed else ())
        inputs = [jax.device_put(x, self.device) for x in inputs]
        compiles_before, compile_s_before, hits_before = self.watch.in_this_thread()
        forward, waited_s = self._executable(choice.backend, batch.ids_BxT.shape)
        t1 = time.perf_counter()
        pooled = forward(self.params, *inputs)
        pooled.block_until_ready()
        t2 = time.perf_counter()
        pooled = np.asarray(pooled)
        vectors = pooled.reshape(-1, pooled.shape[-1])[batch.window_slots()]
        alone = self._reencode_row_mates(forward, batch, vectors) if batch.packed else []
        t3 = time.perf_counter()
        compiles_after, compile_s_after, hits_after = self.watch.in_this_thread()
        compiled = compiles_after > compiles_before
        cache_hits = hits_after - hits_before
        if compiled and self.compile_cache is not None and not cache_hits:
            self.compile_cache.push()
        shape = (choice.backend, batch.ids_BxT.shape)
        if compiled and shape in self._shapes_seen and shape not in self._compiling:
            log.warning("recompiled the encoder for shape %s (backend %s) after warm-up", batch.ids_BxT.shape,
                        choice.backend)
        self._shapes_seen.add(shape)
        self._batches_done += 1
        self._maybe_stop_profile()
        timing = {
            "batch_id": batch.batch_id, "bucket_len": batch.bucket_len, "rows": batch.rows,
            "real_rows": batch.real_rows, "real_tokens": batch.real_tokens, "packed": batch.packed,
            "reencoded_alone": len(alone),
            "padded_tokens": int(batch.ids_BxT.size), "attention_backend": choice.backend,
            "attention_requested": choice.requested, "attention_kernel": choice.kernel,
            "fallback_reason": choice.fallback_reason, "compiled": compiled,
            # Compiling this batch's shape, or waiting for its compilation in the background.
            "compile_ms": round((compile_s_after - compile_s_before + waited_s) * 1e3, 3),
            "compile_cache_hits": cache_hits,
            "compute_ms": round((t2 - t1) * 1e3, 3), "total_ms": round((t3 - t0) * 1e3, 3),
            "device": describe_device(self.device), "worker": worker_name(),
            "started_at": started_at.isoformat(), **memory(self.device),
        }
        return vectors, timing

    def _reencode_row_mates(self, forward, batch: Batch, vectors: np.ndarray) -> list[int]:
        """A non-finite value in one packed window can reach the others of its row (a zero attention weight
        times NaN is NaN): encode each window of such a row again, alone in a row of the same compiled
        shape, so only the window that is non-finite by itself is refused downstream. Updates ``vectors``
        in place; returns the windows encoded again."""
        import jax

        bad = ~np.isfinite(vectors).all(axis=1)
        if not bad.any():
            return []
        slots = batch.slot_lengths_BxK.shape[1]
        where = batch.window_slots()
        row_of = where // slots
        bad_rows, windows_in_row = set(row_of[bad].tolist()), np.bincount(row_of, minlength=batch.rows)
        redo = [i for i in range(len(vectors)) if row_of[i] in bad_rows and windows_in_row[row_of[i]] > 1]
        for start in range(0, len(redo), batch.rows):
            chunk = redo[start:start + batch.rows]
            ids_BxT, segment_ids_BxT = np.zeros_like(batch.ids_BxT), np.zeros_like(batch.segment_ids_BxT)
            slot_lengths_BxK = np.zeros_like(batch.slot_lengths_BxK)
            for r, i in enumerate(chunk):
                row, k = divmod(int(where[i]), slots)
                tokens = batch.ids_BxT[row][batch.segment_ids_BxT[row] == k + 1]
                ids_BxT[r, :len(tokens)], segment_ids_BxT[r, :len(tokens)], slot_lengths_BxK[r, 0] = tokens, 1, len(tokens)
            inputs = (ids_BxT, slot_lengths_BxK.sum(axis=1, dtype=np.int32), segment_ids_BxT, slot_lengths_BxK)
            pooled = np.asarray(forward(self.params, *[jax.device_put(x, self.device) for x in inputs]))
            vectors[chunk] = pooled[: len(chunk), 0]
        log.warning("batch %s: a non-finite vector in a packed row; encoded its %d row-mates again, each alone",
                    batch.batch_id, len(redo))
        return redo

    def _maybe_start_profile(self):
        if self.spec.profile_batches and self._batches_done == 0 and not self._profiling:
            import jax

            self._trace_dir = tempfile.mkdtemp(prefix="docbeam-profile-")
            jax.profiler.start_trace(self._trace_dir, create_perfetto_trace=True)
            self._profiling = True

    def _maybe_stop_profile(self):
        if self._profiling and self._batches_done >= self.spec.profile_batches:
            self._finish_profile()

    def finish_profile(self):
        """Also called at the end of each bundle: a worker that gets fewer batches than profile.batches still
        leaves its trace, and before the commit (an exit hook would write after it)."""
        with self._lock:
            self._finish_profile()

    def _finish_profile(self):
        if not self._profiling:
            return
        import jax

        from pipeline.store import storage

        jax.profiler.stop_trace()
        self._profiling = False
        storage.copy_tree(self._trace_dir, f"{self.spec.profile_dir}/{worker_name().replace(':', '-')}")
        shutil.rmtree(self._trace_dir, ignore_errors=True)


_RUNTIMES: dict[str, EncoderRuntime] = {}
_RUNTIMES_LOCK = threading.Lock()


def runtime_for(spec: EncoderSpec) -> EncoderRuntime:
    """One runtime per spec per process, kept for the process's life.

    RunInference's ``shared.Shared`` holds the model only while a DoFn instance references it; the
    DirectRunner tears instances down between stages (GroupIntoBatches flushes its partial batches in a
    later bundle), and a reload would recompile every shape.
    """
    key = repr(spec)
    with _RUNTIMES_LOCK:
        if key not in _RUNTIMES:
            _RUNTIMES[key] = EncoderRuntime(spec)
        return _RUNTIMES[key]


def stop_compiling(spec: EncoderSpec) -> None:
    """``EncoderRuntime.stop_compiling`` for this process's runtime of ``spec``, if it has one."""
    with _RUNTIMES_LOCK:
        runtime = _RUNTIMES.get(repr(spec))
    if runtime is not None:
        runtime.stop_compiling()


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

    def run_inference(self, batch: Sequence[Batch], model: EncoderRuntime,
                      inference_args: dict[str, Any] | None = None) -> Iterable[PredictionResult]:
        from pipeline.telemetry.observe import worker_name

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
        finished_docs = sum(1 for _, index, num_windows, _, _ in batch.windows if index == num_windows - 1)
        self._progress.update(finished_docs, batch.real_rows, batch.real_tokens)
        self._real.inc(timing["real_tokens"])
        self._padded.inc(timing["padded_tokens"])
        self._batches.inc()
        self._compiles.inc(int(timing["compiled"]))
        if not timing["compiled"]:  # a compiling call's time is mostly compilation, not device work
            name = f"compute_ms[{timing['bucket_len']},{timing['attention_backend']}]"
            Metrics.distribution(METRICS_NAMESPACE, name).update(int(round(timing["compute_ms"])))
        if timing["fallback_reason"]:
            key = fallback_key(timing["attention_requested"], timing["attention_backend"],
                               timing["fallback_reason"][:80])
            Metrics.counter(METRICS_NAMESPACE, f"fallbacks[{key}]").inc()
        yield beam.pvalue.TaggedOutput(TIMING_TAG, timing)
        for (doc_id, index, num_windows, doc_tokens, truncated), length, vector in zip(
                batch.windows, batch.window_lengths(), vectors):
            yield WindowEmbedding(doc_id, index, num_windows, int(length), doc_tokens, truncated, vector,
                                  batch.bucket_len, timing["attention_backend"])

    def _report_startup(self, startup: dict) -> dict:
        """Beam metrics (startup_ms[...] and compile_ms[<rows>x<bucket>,<backend>]) and one record for
        the summary from an encoder's start-up report."""
        for part in ("checkpoint", "probes"):
            if f"{part}_s" in startup:
                Metrics.distribution(METRICS_NAMESPACE, f"startup_ms[{part}]").update(
                    int(round(startup[f"{part}_s"] * 1e3)))
        for c in startup["compiles"]:
            Metrics.distribution(METRICS_NAMESPACE, f"compile_ms[{c['rows']}x{c['bucket_len']},{c['backend']}]"
                                 ).update(int(round(c["seconds"] * 1e3)))
        self._compiles.inc(len(startup["compiles"]))
        return {**startup, "worker": worker_name()}

    def finish_bundle(self):
        for runtime in list(_RUNTIMES.values()):
            runtime.finish_profile()
        # The compilations that finished after this process's last batch of the bundle (shapes still to come,
        # or that no batch used) count too; waiting for them here also lets no compilation outlive the job.
        runtime = _RUNTIMES.get(repr(self._spec))
        report = runtime.take_startup_report(wait=True) if runtime is not None else None
        if report is not None:
            from apache_beam.transforms.window import GlobalWindow
            from apache_beam.utils.windowed_value import WindowedValue

            yield beam.pvalue.TaggedOutput(STARTUP_TAG, WindowedValue(
                self._report_startup(report), GlobalWindow().max_timestamp(), [GlobalWindow()]))


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
        results = (batches
                   | "RunInference" >> RunInference(EncoderHandler(self._spec))
                   | "Split" >> beam.ParDo(_SplitResults(self._spec),
                                           total_windows=beam.pvalue.AsSingleton(self._total_windows))
                   .with_outputs(TIMING_TAG, STARTUP_TAG, main="windows"))
        return {"windows": results.windows, "timing": results[TIMING_TAG], "startup": results[STARTUP_TAG]}

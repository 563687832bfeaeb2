"""Encode: padded Batches → window embeddings and one timing record per batch, through RunInference.

Each worker process loads the encoder once (RunInference shares it via ``shared.Shared``), decides per
bucket which attention backend runs (capability checks, fallback, optional parity gate), and reuses one
jitted forward per backend; jit compiles each (bucket, rows) shape once.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Iterable, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import ModelHandler, PredictionResult, RunInference

from attention.plan import AttentionSpec, bind_choice, choose_backends, gate, probe
from pipeline.observe import (ENCODER_FN_NAME, METRICS_NAMESPACE, CompileWatch, describe_device, fallback_key, memory,
                              worker_name)
from pipeline.records import Batch, WindowEmbedding

TIMING_TAG = "timing"
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


class EncoderRuntime:
    """The loaded encoder of one worker process: parameters on device, one jitted forward per backend."""

    def __init__(self, spec: EncoderSpec):
        import jax

        from models import checkpoint, encoder
        from pipeline.plan import attention_cases

        self.spec = spec
        self.device = jax.devices()[0]
        platform = self.device.platform
        if spec.platform not in ("auto", platform):
            log.warning("job was planned for %s but this worker has %s; re-planning attention here",
                        spec.platform, platform)
        ck = checkpoint.open_checkpoint(spec.model_path, spec.dtype, with_weights=True)
        self.config = ck.config
        self.params = jax.device_put(checkpoint.load_params(ck.folder, ck.config), self.device)
        choices = choose_backends(spec.attention, attention_cases(ck.config, spec.buckets, platform))
        if spec.attention.verify:
            choices = gate(spec.attention, choices)
        for choice in choices:  # always, on the platform that will run it: a broken backend fails the job here
            probe(spec.attention, choice)
        self.choices = {c.case.seq_len: c for c in choices}
        self.watch = CompileWatch.get()
        self._forward = {}
        for name in sorted({c.backend for c in choices}):
            embed = encoder.embed_fn(ck.config, bind_choice(spec.attention, name), spec.pooling)

            def forward(params, ids_BxT, lengths_B, embed=embed):
                return embed(params, ids_BxT, lengths_B)

            forward.__name__ = forward.__qualname__ = ENCODER_FN_NAME  # CompileWatch counts by this name
            self._forward[name] = jax.jit(forward)
        self._batches_done = 0
        self._shapes_seen: set = set()
        self._profiling = False
        # Worker threads share this runtime; one batch at a time keeps the compile count, the shapes seen
        # and the profiler per batch, and costs nothing with one device.
        self._lock = threading.Lock()

    def encode(self, batch: Batch) -> tuple[np.ndarray, dict]:
        with self._lock:
            return self._encode(batch)

    def _encode(self, batch: Batch) -> tuple[np.ndarray, dict]:
        import jax

        self._maybe_start_profile()
        choice = self.choices[batch.bucket_len]
        started_at = datetime.datetime.now(datetime.timezone.utc)
        t0 = time.perf_counter()
        ids = jax.device_put(batch.ids_BxT, self.device)
        lengths = jax.device_put(batch.lengths_B, self.device)
        compiles_before, compile_s_before = self.watch.count, self.watch.seconds
        t1 = time.perf_counter()
        pooled = self._forward[choice.backend](self.params, ids, lengths)
        pooled.block_until_ready()
        t2 = time.perf_counter()
        vectors = np.asarray(pooled)[: batch.real_rows]
        t3 = time.perf_counter()
        compiled = self.watch.count > compiles_before
        shape = (choice.backend, batch.ids_BxT.shape)
        if compiled and shape in self._shapes_seen:
            log.warning("recompiled the encoder for shape %s (backend %s) after warm-up", batch.ids_BxT.shape,
                        choice.backend)
        self._shapes_seen.add(shape)
        self._batches_done += 1
        self._maybe_stop_profile()
        timing = {
            "batch_id": batch.batch_id, "bucket_len": batch.bucket_len, "rows": batch.rows,
            "real_rows": batch.real_rows, "real_tokens": batch.real_tokens,
            "padded_tokens": int(batch.ids_BxT.size), "attention_backend": choice.backend,
            "attention_requested": choice.requested, "attention_kernel": choice.kernel,
            "fallback_reason": choice.fallback_reason, "compiled": compiled,
            "compile_ms": round((self.watch.seconds - compile_s_before) * 1e3, 3),
            "compute_ms": round((t2 - t1) * 1e3, 3), "total_ms": round((t3 - t0) * 1e3, 3),
            "device": describe_device(self.device), "worker": worker_name(),
            "started_at": started_at.isoformat(), **memory(self.device),
        }
        return vectors, timing

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

        jax.profiler.stop_trace()
        self._profiling = False
        copy_tree(self._trace_dir, f"{self.spec.profile_dir}/{worker_name().replace(':', '-')}")
        shutil.rmtree(self._trace_dir, ignore_errors=True)


class Progress:
    """A progress line every ``every_s`` seconds (never per batch, so logs stay readable), with an ETA
    when the job's window count is known. Counts are this worker's; on Dataflow the Beam counters in the
    monitoring UI give the job-wide view."""

    def __init__(self, every_s: float, total_windows: int | None = None):
        self.every_s, self.total_windows = every_s, total_windows
        self.started = self.last = time.monotonic()
        self.documents = self.windows = self.tokens = 0

    def update(self, documents: int, windows: int, tokens: int) -> str | None:
        self.documents += documents
        self.windows += windows
        self.tokens += tokens
        now = time.monotonic()
        if not self.every_s or now - self.last < self.every_s:
            return None
        self.last = now
        elapsed = max(now - self.started, 1e-9)
        line = (f"progress: {self.documents} documents, {self.windows} windows, {self.tokens} tokens in "
                f"{elapsed:.0f} s ({self.tokens / elapsed:.0f} tokens/s)")
        if self.total_windows:
            remaining = max(self.total_windows - self.windows, 0)
            line += (f"; {100 * self.windows / self.total_windows:.0f}% of the job's {self.total_windows} windows, "
                     f"ETA {remaining / (self.windows / elapsed):.0f} s at this worker's rate")
        log.info(line)
        return line


def copy_tree(local_dir: str, dest: str) -> None:
    """Profiles are written locally by JAX, then copied byte for byte to the output (local or gs://)."""
    from pipeline import storage

    for root, _, files in os.walk(local_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), local_dir)
            target = storage.join(dest, *rel.split(os.sep))
            if "://" not in target:
                os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(os.path.join(root, name), "rb") as src:
                storage.write_bytes(target, src.read())


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


class EncoderHandler(ModelHandler[Batch, PredictionResult, EncoderRuntime]):
    """RunInference's contract: load once per process, run pre-built batches one at a time."""

    def __init__(self, spec: EncoderSpec):
        super().__init__()
        self._spec = spec

    def load_model(self) -> EncoderRuntime:
        return runtime_for(self._spec)

    def run_inference(self, batch: Sequence[Batch], model: EncoderRuntime,
                      inference_args: dict[str, Any] | None = None) -> Iterable[PredictionResult]:
        return [PredictionResult(b, model.encode(b)) for b in batch]

    def batch_elements_kwargs(self):
        return {"min_batch_size": 1, "max_batch_size": 1}  # batches are already shaped by BucketBatches

    def get_metrics_namespace(self) -> str:
        return METRICS_NAMESPACE


class _SplitResults(beam.DoFn):
    def __init__(self, progress_seconds: float):
        self._progress_seconds = progress_seconds
        self._progress = None
        self._real = Metrics.counter(METRICS_NAMESPACE, "real_tokens")
        self._padded = Metrics.counter(METRICS_NAMESPACE, "padded_tokens")
        self._batches = Metrics.counter(METRICS_NAMESPACE, "batches")
        self._compiles = Metrics.counter(METRICS_NAMESPACE, "compiles")

    def process(self, result: PredictionResult, total_windows: int):
        batch: Batch = result.example
        vectors, timing = result.inference
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
                batch.windows, batch.lengths_B, vectors):
            yield WindowEmbedding(doc_id, index, num_windows, int(length), doc_tokens, truncated, vector,
                                  batch.bucket_len, timing["attention_backend"])

    def finish_bundle(self):
        for runtime in list(_RUNTIMES.values()):
            runtime.finish_profile()


class Encode(beam.PTransform):
    """Outputs ``windows`` (WindowEmbedding) and ``timing`` (one dict per batch).

    ``total_windows`` (a one-element PCollection) lets progress lines give an ETA.
    """

    def __init__(self, spec: EncoderSpec, total_windows):
        super().__init__()
        self._spec = spec
        self._total_windows = total_windows

    def expand(self, batches):
        results = (batches
                   | "RunInference" >> RunInference(EncoderHandler(self._spec))
                   | "Split" >> beam.ParDo(_SplitResults(self._spec.progress_seconds),
                                           total_windows=beam.pvalue.AsSingleton(self._total_windows))
                   .with_outputs(TIMING_TAG, main="windows"))
        return {"windows": results.windows, "timing": results[TIMING_TAG]}

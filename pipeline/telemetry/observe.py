"""What every batch reports about the process it ran in (compilations, memory, device, worker), and the names
the job's metrics are reported under."""

from __future__ import annotations

import logging
import os
import resource
import socket
import threading
import time
from typing import Iterable, Iterator

import psutil

log = logging.getLogger(__name__)

ENCODER_FN_NAME = "docbeam_embed"  # the jitted forward's name, as jax.monitoring reports it
METRICS_NAMESPACE = "docbeam"  # every Beam counter and distribution of the job; the summary queries it
# The stages whose own code is timed (Beam counters stage_us[<stage>]); the rest of the wall time is Beam's:
# bucketing, grouping, the Parquet and JSONL sinks, moving elements between steps.
STAGES = ("read", "tokenize", "encode", "pool", "commit")
# Metric families: one Beam metric per label, named ``family[label]`` (metric_name); read back with
# labelled(), never by slicing the name where it is read.
STAGE_US = "stage_us"  # [stage]: microseconds inside a stage's own code (StageClock)
DOCS_REJECTED = "docs_rejected"  # [kind]: documents rejected for that reason
CHUNKS_NOT_WRITTEN = "chunks_not_written"  # [reason]: chunk rows of written documents left out (non_finite, range)
FALLBACKS = "fallbacks"  # [fallback_key]: batches that ran on another backend than requested
STARTUP_MS = "startup_ms"  # [<STARTUP_PARTS>]: an encoder's start-up steps
STARTUP_PARTS = ("checkpoint", "probes", "reused")  # reused: warm from an earlier job in the process, nothing loaded
COMPILE_MS = "compile_ms"  # [shape_label]: compiling one batch shape ahead of its batch
COMPUTE_MS = "compute_ms"  # [bucket_len,backend]: steady batches' compute time


def metric_name(family: str, label: object) -> str:
    """The Beam metric name of ``family``'s member ``label``: ``stage_us[read]``."""
    return f"{family}[{label}]"


def parse_metric_name(name: str) -> tuple[str, str | None]:
    """``metric_name`` read back: (family, label), or (name, None) for a metric without a label. A label
    may hold brackets of its own (a fallback's reason); a family never does."""
    family, bracket, rest = name.partition("[")
    if not bracket or not rest.endswith("]"):
        return name, None
    return family, rest[:-1]


def labelled(metrics: dict, family: str) -> dict:
    """{label: value} of the metrics (name → value) in ``family``, in the order given."""
    found = {}
    for name, value in metrics.items():
        member_of, label = parse_metric_name(name)
        if member_of == family and label is not None:
            found[label] = value
    return found


def shape_label(rows: int, bucket_len: int, backend: str) -> str:
    """A compiled batch shape as summary.json and the ``compile_ms`` metric name it: ``8x128,native``."""
    return f"{rows}x{bucket_len},{backend}"


def fallback_key(requested: str, ran: str, reason: str) -> str:
    """How a fallback is named in summary.json, the report and the Beam counter ``fallbacks[<key>]``."""
    return f"{requested}->{ran}: {reason}"


class CompileWatch:
    """Counts lowerings of the encoder's jitted forward (a jit cache miss: a new shape or backend).

    jax.monitoring reports every compilation with the function's name, so this measures what XLA did
    instead of inferring it from shapes we have seen. It reports them in the thread that compiles, so
    ``in_this_thread`` tells a batch's own compilations from those running beside it (compile ahead).
    """

    _instance = None
    _lock = threading.Lock()

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.cache_hits = 0  # executables JAX's persistent compilation cache served instead of compiling
        self._thread = threading.local()
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        jax.monitoring.register_event_listener(self._on_cache_event)

    def _on_cache_event(self, event: str, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1
            self._thread.cache_hits = getattr(self._thread, "cache_hits", 0) + 1

    def _on_event(self, event: str, duration: float, **kwargs):
        if kwargs.get("fun_name") != f"jit({ENCODER_FN_NAME})":
            return
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            self.count += 1
            self._thread.count = getattr(self._thread, "count", 0) + 1
        if event in ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration"):
            self.seconds += duration
            self._thread.seconds = getattr(self._thread, "seconds", 0.0) + duration

    def in_this_thread(self) -> tuple[int, float, int]:
        """(compilations, seconds, cache hits) so far in the calling thread."""
        t = self._thread
        return getattr(t, "count", 0), getattr(t, "seconds", 0.0), getattr(t, "cache_hits", 0)

    @classmethod
    def get(cls) -> "CompileWatch":
        with cls._lock:
            if cls._instance is None:
                cls._instance = CompileWatch()
            return cls._instance


def process_started() -> float:
    """When this process started (epoch seconds): start-up is measured from here. On Linux from the
    process's age in clock ticks (10 ms); psutil's create_time adds the boot time, which Linux gives in
    whole seconds, so it can be up to a second early."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return psutil.Process().create_time()


class StageClock:
    """Time spent inside one stage's own code, as the Beam counter ``stage_us[<stage>]`` (microseconds, so
    that many short calls add up). Only the stage's own work counts: on a fused runner a DoFn's ``yield``
    runs the next steps, so ``timed`` stops the clock while the consumer holds an element."""

    def __init__(self, stage: str):
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        from apache_beam.metrics import Metrics

        self.stage = stage
        self._counter = Metrics.counter(METRICS_NAMESPACE, metric_name(STAGE_US, stage))

    def add(self, seconds: float) -> None:
        self._counter.inc(int(seconds * 1e6))

    def timed(self, items: Iterable) -> Iterator:
        spent, iterator = 0.0, iter(items)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    spent += time.perf_counter() - t0
                yield item
        finally:
            self.add(spent)


def memory(devices: list) -> dict:
    """The encoder's chips' memory where the platform reports it (GPU/TPU), host RSS otherwise (CPU). On a mesh
    (several ``devices``) the chip with the most in use speaks for the batch (the one that runs out first), and
    ``memory_per_device`` and ``memory_peak_per_device`` keep each chip's, so a leak on one chip is seen on that
    chip."""
    stats = [(d, d.memory_stats() if hasattr(d, "memory_stats") else None) for d in devices]
    reported = [(d, s) for d, s in stats if s and "bytes_in_use" in s]
    if reported:
        per_device = {
            describe_device(d): (int(s["bytes_in_use"]), int(s.get("peak_bytes_in_use", s["bytes_in_use"])))
            for d, s in reported
        }
        in_use, peak = max(per_device.values())
        facts = {"memory_in_use_bytes": in_use, "memory_peak_bytes": peak, "memory_source": "device"}
        if len(per_device) > 1:
            facts["memory_per_device"] = {name: used for name, (used, _) in per_device.items()}
            facts["memory_peak_per_device"] = {name: peak for name, (_, peak) in per_device.items()}
        return facts
    return {
        "memory_in_use_bytes": psutil.Process().memory_info().rss,
        "memory_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "memory_source": "host_rss",
    }


def describe_devices(devices: list) -> str:
    """One chip as ``describe_device`` says it; a mesh as its first chip and how many: ``tpu:0 (TPU v5 lite) +7``."""
    return describe_device(devices[0]) + (f" +{len(devices) - 1}" if len(devices) > 1 else "")


def describe_device(device) -> str:
    return f"{device.platform}:{device.id} ({getattr(device, 'device_kind', '')})"


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


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
        line = (
            f"progress: {self.documents} documents, {self.windows} windows, {self.tokens} tokens in "
            f"{elapsed:.0f} s ({self.tokens / elapsed:.0f} tokens/s)"
        )
        if self.total_windows:
            remaining = max(self.total_windows - self.windows, 0)
            line += (
                f"; {100 * self.windows / self.total_windows:.0f}% of the job's {self.total_windows} windows, "
                f"ETA {remaining / (self.windows / elapsed):.0f} s at this worker's rate"
            )
        log.info(line)
        return line

"""Running attention candidates on one chip for auto's measurement (attention/measure.py): the shape one chip of
the mesh sees, the inputs and native's reference output at that shape, and timing in turns."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

import numpy as np

from docbeam.attention.dispatch import STATIC_FEATURES, probe_inputs
from docbeam.attention.interface import AttentionCase

MIN_ROUNDS = 5
MAX_ROUNDS = 60
SAMPLE_S = 0.002  # a sample repeats a fast call until it takes about this long, above the timer's noise


def chip_case(case: AttentionCase, model_axis: int) -> AttentionCase:
    """The case one chip of the mesh runs (attention/on_mesh.py): its share of the heads when the model axis
    divides them and the call is split per shard; every head when GSPMD partitions it (bias, relative positions)."""
    from docbeam.attention.on_mesh import GSPMD_FEATURES

    if model_axis <= 1 or case.num_heads % model_axis or any(getattr(case, f) for f in GSPMD_FEATURES):
        return case
    heads = case.num_heads // model_axis
    kv = case.kv_heads
    kv = kv // model_axis if kv % model_axis == 0 else heads  # replicated k/v: each chip gathers one per query head
    return dataclasses.replace(case, num_heads=heads, num_kv_heads=kv if kv != heads else None)


def free_memory_bytes() -> int | None:
    """What the chip has free: the device's own figure on GPU/TPU, the host's available memory on CPU."""
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def native_scores_bytes(case: AttentionCase, rows: int) -> int:
    """Native materialises float32 scores and their exponent: two [rows, heads, T, T] tensors."""
    return 2 * 4 * rows * case.num_heads * case.seq_len * case.seq_len


@dataclasses.dataclass
class Inputs:
    """One case's inputs at the real per-chip shape, jitted calls on them, and native's output as the reference."""

    case: AttentionCase
    q: Any
    k: Any
    v: Any
    kwargs: dict

    @classmethod
    def probe(cls, case: AttentionCase, rows: int) -> "Inputs":

        return cls(case, *probe_inputs(case, batch=rows, seed=1))

    @property
    def lengths(self):
        return self.kwargs["kv_lengths_B"]

    def compiled(self, fn):
        """``fn`` jitted on these inputs (compiled by its first call); the window and bias closed over."""
        import jax

        static = {key: self.kwargs[key] for key in STATIC_FEATURES if key in self.kwargs}
        arrays = {key: value for key, value in self.kwargs.items() if key not in static}
        scale = self.case.head_dim**-0.5
        jitted = jax.jit(lambda q, k, v, kw: fn(q, k, v, scale=scale, **kw, **static))
        return lambda: jitted(self.q, self.k, self.v, arrays)

    def reference(self, native, head_group: int) -> np.ndarray:
        """Native's output, ``head_group`` query heads at a time where the case allows (per-head math: the same
        numbers); a bias or relative positions are per head of the whole model, so such a case runs whole."""
        import jax

        n, kv = self.case.num_heads, self.case.kv_heads
        whole = head_group >= n or self.case.bias or self.case.relative_positions
        if whole:
            return np.asarray(jax.block_until_ready(self.compiled(native)()), np.float32)
        per_kv = n // kv
        group = max(per_kv, head_group - head_group % per_kv)
        parts = []
        for start in range(0, n, group):
            q = self.q[:, :, start : start + group]
            k, v = (x[:, :, start // per_kv : (start + group) // per_kv] for x in (self.k, self.v))
            part = dataclasses.replace(self.case, num_heads=q.shape[2], num_kv_heads=k.shape[2])
            sliced = Inputs(part, q, k, v, self.kwargs)
            parts.append(np.asarray(jax.block_until_ready(sliced.compiled(native)()), np.float32))
        return np.concatenate(parts, axis=2)


def check_output(out, inputs: Inputs) -> str:
    """Why an output cannot be compared (wrong shape or dtype), or ""."""
    if out.shape != inputs.q.shape or out.dtype != inputs.q.dtype:
        return f"returned {out.dtype}{list(out.shape)} for q of {inputs.q.dtype}{list(inputs.q.shape)}"
    return ""


@dataclasses.dataclass
class Runner:
    """A candidate compiled on each kind of layer's inputs: ``call()`` runs one call of each kind."""

    label: str
    calls: list[Callable[[], Any]]
    kernel: str = ""

    def call(self):
        import jax

        return jax.block_until_ready([c() for c in self.calls])


def time_in_turns(runners: list[Runner], budget_s: float) -> dict[str, list[float]]:
    """Seconds per call of each runner, sampled in turns (the order reversed every round), after one warm call."""
    for r in runners:
        r.call()
    repeats = {}
    for r in runners:
        t0 = time.perf_counter()
        r.call()
        repeats[r.label] = max(1, math.ceil(SAMPLE_S / max(time.perf_counter() - t0, 1e-7)))
    samples: dict[str, list[float]] = {r.label: [] for r in runners}
    started = time.perf_counter()
    for round_ in range(MAX_ROUNDS):
        for r in runners if round_ % 2 == 0 else reversed(runners):
            n = repeats[r.label]
            t0 = time.perf_counter()
            for _ in range(n):
                r.call()
            samples[r.label].append((time.perf_counter() - t0) / n)
        if round_ + 1 >= MIN_ROUNDS and time.perf_counter() - started >= budget_s:
            break
    return samples


def spread(samples: list[float]) -> float:
    median = statistics.median(samples)
    return statistics.median(abs(s - median) for s in samples)

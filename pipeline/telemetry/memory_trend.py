"""Memory growth per worker: the steady-state trend a leak shows, read from every batch's memory figure.

First-vs-last would call warm-up (compilations, caches filling) a leak, and miss nothing else; a plain
least-squares slope is pulled by one late compilation's step. So the rule, stated in the README:

1. Per worker (host:pid and device), batches in start order; the first ``WARMUP_FRACTION`` of them (at least
   ``MIN_WARMUP`` batches), and every batch up to the last that ran beside the encoder's start-up compilations
   (timing's ``compiling_ahead``: from a cold cache they run into a short job's batches, and the memory they
   take would read as growth), are warm-up and left out.
2. The rest is cut into four quarters; each quarter's median memory stands for it (noise drops out).
3. The growth is the median of the three slopes between neighbouring quarters (bytes per batch): one step,
   wherever it falls, moves only one of them.
4. ``leak_suspected`` when all three slopes are positive and that growth is at least
   ``LEAK_MB_PER_1K_BATCHES`` MB per 1,000 batches, on a worker with at least ``MIN_STEADY_BATCHES`` steady
   batches (fewer cannot tell a leak from warm-up: the verdict is then false, and the summary says why).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

WARMUP_FRACTION = 0.2
MIN_WARMUP = 3
MIN_STEADY_BATCHES = 16
LEAK_MB_PER_1K_BATCHES = 64.0
MB = 1 << 20
RULE = (
    f"after a warm-up of {WARMUP_FRACTION:.0%} of a worker's batches (at least {MIN_WARMUP}, and up to the last "
    "that ran beside the encoder's start-up compilations), the median of "
    "the slopes between the medians of the remaining four quarters; a leak is suspected when all three "
    f"slopes are positive and that growth is at least {LEAK_MB_PER_1K_BATCHES:g} MB per 1,000 batches "
    f"(workers with fewer than {MIN_STEADY_BATCHES} batches after warm-up are not judged)"
)


@dataclasses.dataclass(frozen=True)
class Trend:
    """One worker's memory over its batches."""

    worker: str
    batches: int
    peak_bytes: int
    growth_mb_per_1k_batches: float | None  # None: too few batches after warm-up to judge
    rising: bool  # all three quarter-to-quarter slopes positive

    @property
    def leak_suspected(self) -> bool:
        return (
            self.growth_mb_per_1k_batches is not None
            and self.rising
            and self.growth_mb_per_1k_batches >= LEAK_MB_PER_1K_BATCHES
        )

    def projected_bytes(self, factor: float = 10.0) -> int | None:
        """Memory after ``factor`` times this worker's batches, if the steady growth went on."""
        if self.growth_mb_per_1k_batches is None:
            return None
        extra_batches = (factor - 1.0) * self.batches
        return int(self.peak_bytes + max(self.growth_mb_per_1k_batches, 0.0) * MB * extra_batches / 1000)


def steady_growth(in_use_bytes: Iterable[float], warming: Iterable[bool] | None = None) -> tuple[float | None, bool]:
    """(growth in bytes per batch, whether every quarter rose) of one worker's series in batch order, or
    (None, False) when too few batches remain after warm-up. ``warming``: per batch, whether it ran beside the
    start-up compilations."""
    values = np.asarray(list(in_use_bytes), np.float64)
    flags = np.zeros(len(values), bool) if warming is None else np.asarray(list(warming), bool)
    finite = np.isfinite(values)
    series, compiling = values[finite], np.flatnonzero(flags[finite])
    warmup = max(MIN_WARMUP, int(len(series) * WARMUP_FRACTION), int(compiling[-1]) + 1 if len(compiling) else 0)
    steady = series[warmup:]
    if len(steady) < MIN_STEADY_BATCHES:
        return None, False
    quarters = np.array_split(np.arange(len(steady)), 4)
    centres = np.array([q.mean() for q in quarters])
    medians = np.array([np.median(steady[q]) for q in quarters])
    slopes = np.diff(medians) / np.diff(centres)
    return float(np.median(slopes)), bool(np.all(slopes > 0))


def trend(worker: str, in_use_bytes: list[float], peak_bytes: list[float], warming: list[bool] | None = None) -> Trend:
    growth, rising = steady_growth(in_use_bytes, warming)
    peaks = [p for p in list(peak_bytes) + list(in_use_bytes) if np.isfinite(p)]
    return Trend(
        worker=worker,
        batches=len(in_use_bytes),
        peak_bytes=int(max(peaks, default=0)),
        growth_mb_per_1k_batches=None if growth is None else round(growth * 1000 / MB, 3),
        rising=rising,
    )


def chip_readings(timing: dict) -> list[tuple]:
    """(device, bytes in use, peak bytes) a batch's timing record reports: one per chip on a mesh
    (``memory_per_device``, ``memory_peak_per_device``), else the record's own. The job's leak alarm and the
    report both read a record through this, so both watch the same series."""
    nan = float("nan")
    per_device = timing.get("memory_per_device")
    if not per_device:
        return [(timing.get("device"), timing.get("memory_in_use_bytes", nan), timing.get("memory_peak_bytes", nan))]
    peaks = timing.get("memory_peak_per_device") or {}
    return [(device, used, peaks.get(device, nan)) for device, used in sorted(per_device.items())]


def worker_key(timing: dict) -> str:
    """Which series a batch belongs to: the process, and the device whose memory it reports."""
    return f"{timing.get('worker', '?')} {timing.get('device', '?')}"


def trend_from_samples(worker: str, samples: Iterable[tuple[str, float, float, int]]) -> Trend:
    """``samples``: (started_at ISO string, in-use bytes, peak bytes, start-up compilations beside it) per
    batch, in any order."""
    ordered = sorted(samples)
    return trend(worker, [s[1] for s in ordered], [s[2] for s in ordered], [s[3] > 0 for s in ordered])


def summary_block(trends: list[Trend], limit_mb_per_1k_batches: float | None = None) -> dict:
    """``summary.json``'s ``memory``: each worker's trend, the worst one, and the verdict with its rule."""
    judged = [t for t in trends if t.growth_mb_per_1k_batches is not None]
    worst = max(judged, key=lambda t: t.growth_mb_per_1k_batches, default=None)
    block = {
        "leak_suspected": any(t.leak_suspected for t in trends),
        "worst_worker": worst.worker if worst else None,
        "growth_mb_per_1k_batches": worst.growth_mb_per_1k_batches if worst else None,
        "peak_bytes": max((t.peak_bytes for t in trends), default=None),
        "projected_bytes_at_10x": worst.projected_bytes() if worst else None,
        "limit_mb_per_1k_batches": limit_mb_per_1k_batches,
        "rule": RULE,
        "workers": {
            t.worker: {
                "batches": t.batches,
                "peak_bytes": t.peak_bytes,
                "growth_mb_per_1k_batches": t.growth_mb_per_1k_batches,
                "leak_suspected": t.leak_suspected,
            }
            for t in trends
        },
    }
    if not judged and trends:
        block["note"] = f"no worker had {MIN_STEADY_BATCHES} batches after warm-up: too few to judge a trend"
    return block


def over_limit(block: dict) -> str | None:
    """Why a run breaks ``runner.max_memory_growth_mb_per_1k_batches``, or None."""
    limit, growth = block.get("limit_mb_per_1k_batches"), block.get("growth_mb_per_1k_batches")
    if limit is None or growth is None or growth <= limit:
        return None
    return (
        f"memory grew {growth:g} MB per 1,000 batches on {block['worst_worker']} after warm-up, more than "
        f"runner.max_memory_growth_mb_per_1k_batches={limit:g}"
    )

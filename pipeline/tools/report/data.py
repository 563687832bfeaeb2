"""The figures ``docbeam report`` and ``--baseline`` are built from, computed from a loaded run
(pipeline/tools/report/load.py). Nothing here draws or imports matplotlib, so comparing runs (and the CLI's
``--help``) stays cheap; pipeline/tools/report/charts.py and pipeline/tools/report/page.py render what this
returns.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from docbeam.errors import Refused
from docbeam.pipeline.telemetry import memory_trend
from docbeam.pipeline.telemetry.observe import fallback_key
from docbeam.pipeline.tools.report.load import Run


@dataclasses.dataclass(frozen=True)
class BucketStats:
    """Latency and throughput of one (bucket, backend); the time figures leave out compiling calls."""

    bucket_len: float
    backend: str
    batches: int
    compiles: int
    median_ms: float
    p90_ms: float
    tokens_per_s: float
    padding_efficiency: float


@dataclasses.dataclass(frozen=True)
class Regression:
    what: str  # "latency", "memory growth", "rejected documents" or "fallbacks"
    where: str
    baseline: float
    current: float
    detail: str

    def __str__(self) -> str:
        return f"{self.what} ({self.where}): {self.detail}"


def groups(batches: dict[str, np.ndarray]) -> list[tuple[tuple[float, str], np.ndarray]]:
    """((bucket_len, backend), row mask) for every pair present, by bucket then backend."""
    keys = sorted(
        set(zip(batches["bucket_len"].tolist(), batches["attention_backend"].tolist())),
        key=lambda k: (np.nan_to_num(k[0], nan=np.inf), k[1]),
    )
    return [
        ((bucket, backend), (_same(batches["bucket_len"], bucket)) & (batches["attention_backend"] == backend))
        for bucket, backend in keys
    ]


def _same(column: np.ndarray, value: float) -> np.ndarray:
    return np.isnan(column) if np.isnan(value) else column == value


def steady(batches: dict[str, np.ndarray], mask: np.ndarray) -> np.ndarray:
    """The batches in ``mask`` that did not compile and have a compute_ms: the ones latency is judged by."""
    return mask & ~batches["compiled"] & np.isfinite(batches["compute_ms"])


def buckets(batches: dict[str, np.ndarray]) -> list[float]:
    return sorted({v for v in batches["bucket_len"].tolist() if np.isfinite(v)})


def bucket_stats(batches: dict[str, np.ndarray]) -> list[BucketStats]:
    stats = []
    for (bucket, backend), mask in groups(batches):
        steady_rows = steady(batches, mask)
        compute_ms = batches["compute_ms"][steady_rows]
        stats.append(
            BucketStats(
                bucket_len=bucket,
                backend=backend,
                batches=int(mask.sum()),
                compiles=int((mask & batches["compiled"]).sum()),
                median_ms=float(np.median(compute_ms)) if compute_ms.size else np.nan,
                p90_ms=float(np.percentile(compute_ms, 90)) if compute_ms.size else np.nan,
                tokens_per_s=ratio(batches["real_tokens"][steady_rows], compute_ms / 1e3),
                padding_efficiency=ratio(batches["real_tokens"][mask], batches["padded_tokens"][mask]),
            )
        )
    return stats


def padding_by_bucket(batches: dict[str, np.ndarray]) -> list[tuple[float, float, int]]:
    """(bucket_len, real ÷ padded tokens, batches) per bucket."""
    return [
        (k, ratio(batches["real_tokens"][m], batches["padded_tokens"][m]), int(m.sum()))
        for k in buckets(batches)
        for m in [batches["bucket_len"] == k]
    ]


def ratio(numerator: np.ndarray, denominator: np.ndarray) -> float:
    """sum(numerator) / sum(denominator) over the entries where both are known; NaN when that sum is 0."""
    ok = np.isfinite(numerator) & np.isfinite(denominator)
    total = denominator[ok].sum()
    return float(numerator[ok].sum() / total) if total > 0 else np.nan


def recompilations(batches: dict[str, np.ndarray]) -> np.ndarray:
    """Indices of batches that compiled although an earlier batch of the same shape already ran in the same
    process on the same device: a warm cache missed, so some argument's shape, dtype or static value moved."""
    seen, found = set(), []
    for i in range(len(batches["compiled"])):
        shape = tuple(str(batches[name][i]) for name in ("worker", "device", "bucket_len", "rows", "attention_backend"))
        if shape in seen and batches["compiled"][i]:
            found.append(i)
        seen.add(shape)
    return np.array(found, dtype=int)


def rejected_by_kind(run: Run) -> dict[str, int]:
    if run.errors:
        kinds = [str(e.get("kind") or "unknown") for e in run.errors]
        return {kind: kinds.count(kind) for kind in sorted(set(kinds))}
    return {str(k): int(v) for k, v in (run.summary.get("rejected_by_kind") or {}).items()}


def fallbacks(run: Run) -> dict[str, int]:
    """Batches that ran on another backend than configured, keyed "<requested>-><ran>: <reason>"."""
    if "fallbacks" in run.summary:
        return {str(k): int(v) for k, v in (run.summary["fallbacks"] or {}).items()}
    b, counts = run.batches, {}
    # auto's measured choice is not a fallback (attention/measure.py): only a named backend that did not run is
    named = (b["attention_requested"] != "") & (b["attention_requested"] != "auto")
    fell_back = (b["fallback_reason"] != "") | (named & (b["attention_requested"] != b["attention_backend"]))
    for i in np.flatnonzero(fell_back):
        key = fallback_key(b["attention_requested"][i], b["attention_backend"][i], b["fallback_reason"][i])
        counts[key] = counts.get(key, 0) + 1
    return counts


def latency_changes(run: Run, baseline: Run) -> list[tuple[BucketStats, BucketStats]]:
    """(baseline, current) stats for every (bucket, backend) present with steady batches in both runs."""
    before = {(s.bucket_len, s.backend): s for s in bucket_stats(baseline.batches)}
    return [
        (before[(s.bucket_len, s.backend)], s)
        for s in bucket_stats(run.batches)
        if (s.bucket_len, s.backend) in before
        and np.isfinite(before[(s.bucket_len, s.backend)].median_ms)
        and np.isfinite(s.median_ms)
    ]


def compare(run: Run, baseline: Run, threshold: float = 0.10) -> list[Regression]:
    """Regressions of ``run`` against ``baseline``: a (bucket, backend) whose median compute_ms grew by more
    than ``threshold`` (a fraction), a suspected memory leak (memory_regression), and any increase in rejected
    documents or fallback batches."""
    check_threshold(threshold)
    found = []
    for before, now in latency_changes(run, baseline):
        if now.median_ms > before.median_ms * (1 + threshold):
            found.append(
                Regression(
                    "latency",
                    f"bucket {fmt(now.bucket_len)} / {now.backend or '?'}",
                    before.median_ms,
                    now.median_ms,
                    f"median compute {now.median_ms:.2f} ms vs {before.median_ms:.2f} ms "
                    f"({now.median_ms / before.median_ms - 1:+.1%}, threshold {threshold:.0%})",
                )
            )
    memory = memory_regression(run, baseline, threshold)
    if memory is not None:
        found.append(memory)
    dearer = cost_regression(run, baseline, threshold)
    if dearer is not None:
        found.append(dearer)
    for what, count in (("rejected documents", rejected_by_kind), ("fallbacks", fallbacks)):
        before, now = count(baseline), count(run)
        if sum(now.values()) > sum(before.values()):
            grew = [f"{key} {now[key] - before.get(key, 0):+d}" for key in now if now[key] > before.get(key, 0)]
            found.append(
                Regression(
                    what,
                    "all",
                    sum(before.values()),
                    sum(now.values()),
                    f"{sum(now.values())} vs {sum(before.values())} ({'; '.join(grew)})",
                )
            )
    return found


def cost_regression(run: Run, baseline: Run, threshold: float) -> Regression | None:
    """The run's USD per million tokens above the baseline's by more than ``threshold``; None when lower, or when
    either run has no price (summary.json's cost: pipeline/telemetry/cost.py)."""
    before, now = (
        (r.summary.get("cost") or {}).get("usd_per_million_tokens") if isinstance(r.summary.get("cost"), dict) else None
        for r in (baseline, run)
    )
    if not all(isinstance(v, (int, float)) and v > 0 for v in (before, now)) or now <= before * (1 + threshold):
        return None
    return Regression(
        "cost",
        "per million tokens",
        before,
        now,
        f"${now:.4f} vs ${before:.4f} per million tokens ({now / before - 1:+.1%}, threshold {threshold:.0%})",
    )


@dataclasses.dataclass(frozen=True)
class MemorySeries:
    """One worker's chip over the run: the batches it reports (indices into ``run.batches``, in time order) and
    its bytes in use and peak after each (NaN where a record has no peak for it)."""

    worker: str
    device: str
    rows: list[int]
    in_use: np.ndarray
    peak: np.ndarray

    @property
    def key(self) -> str:
        return memory_trend.worker_key({"worker": self.worker, "device": self.device})


def memory_series(run: Run) -> list[MemorySeries]:
    """A series per (worker, chip): a mesh's records split into their chips (``memory_per_device``), as the
    job's own leak alarm watches them."""
    b = run.batches
    found: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    for i, (worker, readings) in enumerate(zip(b["worker"], b["chip_memory"])):
        for device, used, peak in readings:
            found.setdefault((worker, device), []).append((i, used, peak))
    return [
        MemorySeries(
            worker,
            device,
            [i for i, _, _ in points],
            np.array([u for _, u, _ in points], float),
            np.array([p for _, _, p in points], float),
        )
        for (worker, device), points in sorted(found.items())
    ]


def memory_trends(run: Run) -> list[memory_trend.Trend]:
    """Each worker's memory trend (each chip's, on a mesh) from the timing records (batches are sorted by start
    time), so a run whose summary predates the ``memory`` block gets one too."""
    ahead = run.batches["compiling_ahead"]
    return [
        memory_trend.trend(series.key, list(series.in_use), list(series.peak), list(ahead[series.rows]))
        for series in memory_series(run)
    ]


def memory_regression(run: Run, baseline: Run, threshold: float) -> Regression | None:
    """A suspected leak the baseline did not have, or one that grows more than ``threshold`` faster."""

    def worst(r):
        judged = [t for t in memory_trends(r) if t.growth_mb_per_1k_batches is not None]
        return max(judged, key=lambda t: t.growth_mb_per_1k_batches, default=None)

    now, before = worst(run), worst(baseline)
    if now is None or not now.leak_suspected:
        return None
    before_growth = before.growth_mb_per_1k_batches if before is not None else 0.0
    if before is not None and before.leak_suspected and now.growth_mb_per_1k_batches <= before_growth * (1 + threshold):
        return None
    return Regression(
        "memory growth",
        now.worker,
        before_growth,
        now.growth_mb_per_1k_batches,
        f"{now.growth_mb_per_1k_batches:,.0f} MB per 1,000 batches after warm-up vs "
        f"{before_growth:,.0f} MB in the baseline (leak suspected: {memory_trend.RULE})",
    )


class BadThreshold(Refused, ValueError):
    """A ``--threshold`` that cannot be meant: refused (exit 2) before anything is read."""


def check_threshold(threshold: float) -> None:
    """Raises on a threshold given as a percentage, which would silence every latency regression."""
    if not 0 <= threshold < 10:
        raise BadThreshold(f"--threshold is a fraction of the baseline median, e.g. 0.1 for 10%; got {threshold}")


def fmt(value) -> str:
    """A number as the report shows it, in regression details and on the page alike."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return "—" if value is None else str(value)
    if not np.isfinite(value):
        return "—"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"

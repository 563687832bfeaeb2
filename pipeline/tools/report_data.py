"""The data side of ``docbeam report``: a run's outputs loaded into plain structures, and the figures the
page and ``--baseline`` are built from. Nothing here draws or imports matplotlib, so comparing runs (and the
CLI's ``--help``) stays cheap; pipeline/tools/report_charts.py and pipeline/tools/report_html.py render what this returns.

A committed run lists its files in ``_manifest.json``; only those are read, since the output folder may also
hold ``_staging/`` and shards of other runs. Older runs without a manifest are read by glob.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

import numpy as np
from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems

from pipeline.telemetry import memory_trend
from pipeline.telemetry.observe import fallback_key
from pipeline.store.output import MANIFEST, MANIFEST_FORMAT

_NUMERIC = ("bucket_len", "rows", "real_rows", "real_tokens", "padded_tokens", "compute_ms", "total_ms",
            "memory_in_use_bytes", "memory_peak_bytes")
_TEXT = ("batch_id", "attention_backend", "attention_requested", "fallback_reason", "device", "worker",
         "memory_source")


@dataclasses.dataclass(frozen=True)
class Run:
    """A run's outputs as plain structures. ``batches`` holds aligned numpy columns (one entry per timing
    record, sorted by start time; numbers are float with NaN where a record lacks the key) plus ``t_s``,
    seconds since the first batch started."""
    path: str
    summary: dict[str, Any]
    batches: dict[str, np.ndarray]
    errors: list[dict[str, Any]]

    @property
    def batch_count(self) -> int:
        return len(self.batches["compiled"])


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


# ---------------------------------------------------------------- loading

def load_run(output: str) -> Run:
    summary = _read_json(FileSystems.join(output, "summary.json"))
    timing = _read_jsonl(run_files(output, "timing"))
    if summary is None and not timing:
        staged = _match(FileSystems.join(output, "_staging", "*", "summary.json"))
        hint = (f"; it holds uncommitted runs, e.g. {staged[-1].rsplit('/', 1)[0]} (pass that folder to see one)"
                if staged else "; pass the output path of a docbeam run")
        raise FileNotFoundError(f"{output} has neither summary.json nor timing/*.jsonl shards{hint}")
    errors = _read_jsonl(run_files(output, "errors"))
    return Run(path=output, summary=summary or {}, batches=batch_columns(timing), errors=errors)


def run_files(output: str, part: str) -> list[str]:
    """Paths of the run's ``part`` shards (``timing`` or ``errors``): those the manifest lists when the
    output has one, else whatever ``part/*.jsonl*`` matches."""
    manifest_path = FileSystems.join(output, MANIFEST)
    manifest = _read_json(manifest_path)
    if manifest is None:
        return _match(FileSystems.join(output, part, "*.jsonl*"))
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), list):
        raise ValueError(f"{manifest_path}: expected format {MANIFEST_FORMAT!r} with a 'files' list; got format "
                         f"{manifest.get('format')!r}")
    paths = sorted(FileSystems.join(output, *f["path"].split("/")) for f in manifest["files"]
                   if str(f.get("path", "")).startswith(f"{part}/"))
    for path in paths:
        if not FileSystems.exists(path):
            raise FileNotFoundError(f"{path} is listed in {manifest_path} but missing")
    return paths


def _match(pattern: str) -> list[str]:
    try:
        return sorted(m.path for m in FileSystems.match([pattern])[0].metadata_list)
    except BeamIOError:  # some filesystems raise rather than match nothing, e.g. for a missing directory
        return []


def _read_json(path: str) -> dict | None:
    if not FileSystems.exists(path):
        return None
    with FileSystems.open(path) as f:
        try:
            return json.loads(f.read().decode("utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None


def _read_jsonl(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        with FileSystems.open(path) as f:
            for number, line in enumerate(f.read().decode("utf-8").splitlines(), 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path} line {number} is not JSON ({e})") from None
    return records


def batch_columns(records: list[dict]) -> dict[str, np.ndarray]:
    start_s = np.array([_epoch_seconds(r.get("started_at")) for r in records], dtype=float)
    columns = {name: np.array([_number(r.get(name)) for r in records], dtype=float) for name in _NUMERIC}
    columns |= {name: np.array([_text(r.get(name)) for r in records], dtype=object) for name in _TEXT}
    columns["compiled"] = np.array([r.get("compiled") is True for r in records], dtype=bool)
    columns["t_s"] = start_s - np.nanmin(start_s) if np.isfinite(start_s).any() else start_s
    order = np.argsort(start_s, kind="stable")
    return {name: column[order] for name, column in columns.items()}


def _epoch_seconds(value) -> float:
    try:
        moment = datetime.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return np.nan
    return (moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)).timestamp()


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else np.nan


def _text(value) -> str:
    return "" if value is None else str(value)


# ---------------------------------------------------------------- analysis

def groups(batches: dict[str, np.ndarray]) -> list[tuple[tuple[float, str], np.ndarray]]:
    """((bucket_len, backend), row mask) for every pair present, by bucket then backend."""
    keys = sorted(set(zip(batches["bucket_len"].tolist(), batches["attention_backend"].tolist())),
                  key=lambda k: (np.nan_to_num(k[0], nan=np.inf), k[1]))
    return [((bucket, backend), (_same(batches["bucket_len"], bucket)) & (batches["attention_backend"] == backend))
            for bucket, backend in keys]


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
        stats.append(BucketStats(
            bucket_len=bucket, backend=backend, batches=int(mask.sum()),
            compiles=int((mask & batches["compiled"]).sum()),
            median_ms=float(np.median(compute_ms)) if compute_ms.size else np.nan,
            p90_ms=float(np.percentile(compute_ms, 90)) if compute_ms.size else np.nan,
            tokens_per_s=ratio(batches["real_tokens"][steady_rows], compute_ms / 1e3),
            padding_efficiency=ratio(batches["real_tokens"][mask], batches["padded_tokens"][mask])))
    return stats


def padding_by_bucket(batches: dict[str, np.ndarray]) -> list[tuple[float, float, int]]:
    """(bucket_len, real ÷ padded tokens, batches) per bucket."""
    return [(k, ratio(batches["real_tokens"][m], batches["padded_tokens"][m]), int(m.sum()))
            for k in buckets(batches) for m in [batches["bucket_len"] == k]]


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
        shape = tuple(str(batches[name][i]) for name in ("worker", "device", "bucket_len", "rows",
                                                          "attention_backend"))
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
    fell_back = (b["fallback_reason"] != "") | ((b["attention_requested"] != "")
                                                & (b["attention_requested"] != b["attention_backend"]))
    for i in np.flatnonzero(fell_back):
        key = fallback_key(b["attention_requested"][i], b["attention_backend"][i], b["fallback_reason"][i])
        counts[key] = counts.get(key, 0) + 1
    return counts


def latency_changes(run: Run, baseline: Run) -> list[tuple[BucketStats, BucketStats]]:
    """(baseline, current) stats for every (bucket, backend) present with steady batches in both runs."""
    before = {(s.bucket_len, s.backend): s for s in bucket_stats(baseline.batches)}
    return [(before[(s.bucket_len, s.backend)], s) for s in bucket_stats(run.batches)
            if (s.bucket_len, s.backend) in before and np.isfinite(before[(s.bucket_len, s.backend)].median_ms)
            and np.isfinite(s.median_ms)]


def compare(run: Run, baseline: Run, threshold: float = 0.10) -> list[Regression]:
    """Regressions of ``run`` against ``baseline``: a (bucket, backend) whose median compute_ms grew by more
    than ``threshold`` (a fraction), a suspected memory leak (memory_regression), and any increase in rejected
    documents or fallback batches."""
    check_threshold(threshold)
    found = []
    for before, now in latency_changes(run, baseline):
        if now.median_ms > before.median_ms * (1 + threshold):
            found.append(Regression(
                "latency", f"bucket {fmt(now.bucket_len)} / {now.backend or '?'}", before.median_ms, now.median_ms,
                f"median compute {now.median_ms:.2f} ms vs {before.median_ms:.2f} ms "
                f"({now.median_ms / before.median_ms - 1:+.1%}, threshold {threshold:.0%})"))
    memory = memory_regression(run, baseline, threshold)
    if memory is not None:
        found.append(memory)
    for what, count in (("rejected documents", rejected_by_kind), ("fallbacks", fallbacks)):
        before, now = count(baseline), count(run)
        if sum(now.values()) > sum(before.values()):
            grew = [f"{key} {now[key] - before.get(key, 0):+d}" for key in now if now[key] > before.get(key, 0)]
            found.append(Regression(what, "all", sum(before.values()), sum(now.values()),
                                    f"{sum(now.values())} vs {sum(before.values())} ({'; '.join(grew)})"))
    return found


def memory_trends(run: Run) -> list[memory_trend.Trend]:
    """Each worker's memory trend from the timing records (batches are sorted by start time), so a run
    whose summary predates the ``memory`` block gets one too."""
    b = run.batches
    keys = [memory_trend.worker_key({"worker": w, "device": d}) for w, d in zip(b["worker"], b["device"])]
    trends = []
    for key in sorted(set(keys)):
        rows = [i for i, k in enumerate(keys) if k == key]
        trends.append(memory_trend.trend(key, list(b["memory_in_use_bytes"][rows]), list(b["memory_peak_bytes"][rows])))
    return trends


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
    return Regression("memory growth", now.worker, before_growth, now.growth_mb_per_1k_batches,
                      f"{now.growth_mb_per_1k_batches:,.0f} MB per 1,000 batches after warm-up vs "
                      f"{before_growth:,.0f} MB in the baseline (leak suspected: {memory_trend.RULE})")


def check_threshold(threshold: float) -> None:
    """Raises on a threshold given as a percentage, which would silence every latency regression."""
    if not 0 <= threshold < 10:
        raise ValueError(f"threshold is a fraction of the baseline median, e.g. 0.1 for 10%; got {threshold}")


def fmt(value) -> str:
    """A number as the report shows it, in regression details and on the page alike."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return "—" if value is None else str(value)
    if not np.isfinite(value):
        return "—"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"

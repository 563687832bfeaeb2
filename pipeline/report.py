"""One self-contained HTML page about a docbeam run: latency, throughput, padding, memory, compiles, rejects.

    docbeam report OUTPUT [--baseline BASELINE_OUTPUT] [--out FILE] [--threshold 0.1]

Everything is read and written through Beam's ``FileSystems``, so OUTPUT may be a local directory or a
gs:// prefix. Charts are inline PNGs and the page has no scripts or external assets, so it can be attached
to a CI run, mailed, or opened straight from a bucket.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from typing import Any

import numpy as np
from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems

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
    what: str  # "latency", "rejected documents" or "fallbacks"
    where: str
    baseline: float
    current: float
    detail: str

    def __str__(self) -> str:
        return f"{self.what} ({self.where}): {self.detail}"


@dataclasses.dataclass(frozen=True)
class ReportResult:
    path: str
    regressions: list[Regression]


# ---------------------------------------------------------------- loading

def load_run(output: str) -> Run:
    summary = _read_json(FileSystems.join(output, "summary.json"))
    timing = _read_jsonl(FileSystems.join(output, "timing", "*.jsonl*"))
    if summary is None and not timing:
        raise FileNotFoundError(f"{output} has neither summary.json nor timing/*.jsonl shards; "
                                "pass the output path of a docbeam run")
    errors = _read_jsonl(FileSystems.join(output, "errors", "*.jsonl*"))
    return Run(path=output, summary=summary or {}, batches=batch_columns(timing), errors=errors)


def _read_json(path: str) -> dict | None:
    if not FileSystems.exists(path):
        return None
    with FileSystems.open(path) as f:
        try:
            return json.loads(f.read().decode("utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None


def _read_jsonl(pattern: str) -> list[dict]:
    try:
        matches = FileSystems.match([pattern])[0].metadata_list
    except BeamIOError:  # some filesystems raise rather than match nothing, e.g. for a missing directory
        return []
    records = []
    for metadata in sorted(matches, key=lambda m: m.path):
        with FileSystems.open(metadata.path) as f:
            for number, line in enumerate(f.read().decode("utf-8").splitlines(), 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{metadata.path} line {number} is not JSON ({e})") from None
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

def _groups(batches: dict[str, np.ndarray]) -> list[tuple[tuple[float, str], np.ndarray]]:
    keys = sorted(set(zip(batches["bucket_len"].tolist(), batches["attention_backend"].tolist())),
                  key=lambda k: (np.nan_to_num(k[0], nan=np.inf), k[1]))
    return [((bucket, backend), (_same(batches["bucket_len"], bucket)) & (batches["attention_backend"] == backend))
            for bucket, backend in keys]


def _same(column: np.ndarray, value: float) -> np.ndarray:
    return np.isnan(column) if np.isnan(value) else column == value


def bucket_stats(batches: dict[str, np.ndarray]) -> list[BucketStats]:
    stats = []
    for (bucket, backend), mask in _groups(batches):
        steady = mask & ~batches["compiled"] & np.isfinite(batches["compute_ms"])
        compute_ms = batches["compute_ms"][steady]
        stats.append(BucketStats(
            bucket_len=bucket, backend=backend, batches=int(mask.sum()),
            compiles=int((mask & batches["compiled"]).sum()),
            median_ms=float(np.median(compute_ms)) if compute_ms.size else np.nan,
            p90_ms=float(np.percentile(compute_ms, 90)) if compute_ms.size else np.nan,
            tokens_per_s=_ratio(batches["real_tokens"][steady], compute_ms / 1e3),
            padding_efficiency=_ratio(batches["real_tokens"][mask], batches["padded_tokens"][mask])))
    return stats


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> float:
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
        key = f"{b['attention_requested'][i]}->{b['attention_backend'][i]}: {b['fallback_reason'][i]}"
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
    than ``threshold`` (a fraction), and any increase in rejected documents or fallback batches."""
    if not 0 <= threshold < 10:
        raise ValueError(f"threshold is a fraction of the baseline median, e.g. 0.1 for 10%; got {threshold}")
    found = []
    for before, now in latency_changes(run, baseline):
        if now.median_ms > before.median_ms * (1 + threshold):
            found.append(Regression(
                "latency", f"bucket {_fmt(now.bucket_len)} / {now.backend or '?'}", before.median_ms, now.median_ms,
                f"median compute {now.median_ms:.2f} ms vs {before.median_ms:.2f} ms "
                f"({now.median_ms / before.median_ms - 1:+.1%}, threshold {threshold:.0%})"))
    for what, count in (("rejected documents", rejected_by_kind), ("fallbacks", fallbacks)):
        before, now = count(baseline), count(run)
        if sum(now.values()) > sum(before.values()):
            grew = [f"{key} {now[key] - before.get(key, 0):+d}" for key in now if now[key] > before.get(key, 0)]
            found.append(Regression(what, "all", sum(before.values()), sum(now.values()),
                                    f"{sum(now.values())} vs {sum(before.values())} ({'; '.join(grew)})"))
    return found


def _fmt(value) -> str:
    """A number as the report shows it, in regression details and on the page alike."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return "—" if value is None else str(value)
    if not np.isfinite(value):
        return "—"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


# ---------------------------------------------------------------- entry points

def report(output: str, *, baseline: str | None = None, dest: str | None = None,
           threshold: float = 0.10) -> ReportResult:
    """Writes the report of the run at ``output`` to ``dest`` (default ``<output>/report.html``)."""
    # Imported here because report_html imports this module, and so that loading and comparing runs
    # does not import matplotlib.
    from pipeline.report_html import render_html

    run = load_run(output)
    base = load_run(baseline) if baseline else None
    regressions = compare(run, base, threshold) if base is not None else []
    page = render_html(run, base, regressions, threshold)
    dest = dest or FileSystems.join(output, "report.html")
    with FileSystems.create(dest, mime_type="text/html") as f:
        f.write(page.encode("utf-8"))
    return ReportResult(path=dest, regressions=regressions)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Write a self-contained HTML report of a docbeam run (local path or gs:// prefix)."
    parser.epilog = ("Exit status: 0 when the report was written and no regression was found, 1 when "
                     "--baseline was given and at least one regression was found, 2 when a run cannot be read.")
    parser.add_argument("output", help="the run's output path (holds timing/, errors/, summary.json)")
    parser.add_argument("--baseline", help="output path of an earlier run to compare against; regressions "
                        "make the command exit with status 1")
    parser.add_argument("--out", help="where to write the HTML (default: OUTPUT/report.html)")
    parser.add_argument("--threshold", type=float, default=0.10,
                        help="flag a (bucket, backend) whose median compute_ms grew by more than this fraction "
                             "(default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    """Runs ``docbeam report``; returns the exit status (1 when regressions were found, 2 when a run
    cannot be read), so a scheduler can tell a regression from a missing run."""
    from apache_beam.io.filesystem import BeamIOError

    from pipeline import storage

    storage.pipeline_options([])  # gs:// against an emulator without the credential-lookup stall
    try:
        result = report(args.output, baseline=args.baseline, dest=args.out, threshold=args.threshold)
    except (FileNotFoundError, ValueError, BeamIOError) as e:
        print(f"docbeam report: cannot read the run: {e}", file=sys.stderr)
        return 2
    print(f"wrote {result.path}")
    for regression in result.regressions:
        print(f"REGRESSION {regression}", file=sys.stderr)
    return 1 if result.regressions else 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="docbeam report")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))

"""One self-contained HTML page about a docbeam run: latency, throughput, padding, memory, compiles, rejects.

    docbeam report OUTPUT [--baseline BASELINE_OUTPUT] [--out FILE] [--threshold 0.1]

Everything is read and written through Beam's ``FileSystems``, so OUTPUT may be a local directory or a
gs:// prefix. Charts are inline PNGs and the page has no scripts or external assets, so it can be attached
to a CI run, mailed, or opened straight from a bucket.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime
import html
import io
import json
import sys
from typing import Any

import matplotlib
import numpy as np
from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, MaxNLocator

_NUMERIC = ("bucket_len", "rows", "real_rows", "real_tokens", "padded_tokens", "compute_ms", "total_ms",
            "memory_in_use_bytes", "memory_peak_bytes")
_TEXT = ("batch_id", "attention_backend", "attention_requested", "fallback_reason", "device", "worker",
         "memory_source")
_STYLE = {"font.size": 11, "axes.titlesize": 12, "axes.titleweight": "bold", "axes.grid": True,
          "grid.alpha": 0.3, "legend.fontsize": 9, "legend.framealpha": 0.85}


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


# ---------------------------------------------------------------- charts

def _figure(title: str) -> tuple[Figure, Any]:
    fig = Figure(figsize=(8, 4.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    return fig, ax


def _time_axis(ax, batches) -> np.ndarray | None:
    if not np.isfinite(batches["t_s"]).any():
        ax.text(0.5, 0.5, "no started_at timestamps in timing records", ha="center", transform=ax.transAxes)
        return None
    ax.set_xlabel("time since first batch started (s)")
    return batches["t_s"]


def _backend_colors(batches) -> dict[str, Any]:
    palette = matplotlib.colormaps["tab10"]
    return {name: palette(i % 10) for i, name in enumerate(sorted(set(batches["attention_backend"])))}


def latency_chart(b) -> Figure:
    fig, ax = _figure("Batch latency by bucket and backend")
    groups, colors = _groups(b), _backend_colors(b)
    positions = np.arange(1, len(groups) + 1)
    steady = [b["compute_ms"][mask & ~b["compiled"] & np.isfinite(b["compute_ms"])] for _, mask in groups]
    boxes = ax.boxplot(steady, positions=positions, widths=0.6, patch_artist=True,
                       medianprops={"color": "black"}, flierprops={"markersize": 3, "alpha": 0.5})
    for box, ((_, backend), _) in zip(boxes["boxes"], groups):
        box.set(facecolor=colors[backend], alpha=0.7)
    for position, (_, mask) in zip(positions, groups):
        compiling = b["compute_ms"][mask & b["compiled"]]
        ax.scatter(np.full(compiling.size, position), compiling, marker="x", color="crimson", zorder=3)
    finite = b["compute_ms"][np.isfinite(b["compute_ms"]) & (b["compute_ms"] > 0)]
    log = finite.size and finite.max() / finite.min() > 30
    if log:
        ax.set_yscale("log")
    ax.set_xticks(positions, [f"{_fmt(k[0])}\n{k[1] or '?'}" for k, _ in groups],
                  fontsize=9 if len(groups) > 8 else None)
    ax.set_xlabel("bucket length (tokens) / attention backend")
    ax.set_ylabel("compute time per batch (ms" + (", log scale)" if log else ")"))
    handles = [Patch(facecolor=c, alpha=0.7, label=f"{n or '?'} (steady batches)") for n, c in colors.items()]
    handles.append(Line2D([], [], marker="x", color="crimson", ls="", label="compiling call"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
    return fig


def throughput_chart(b) -> Figure:
    fig, ax = _figure("Throughput over the run")
    t = _time_axis(ax, b)
    if t is None:
        return fig
    palette = matplotlib.colormaps["viridis"]
    buckets = sorted({v for v in b["bucket_len"].tolist() if np.isfinite(v)})
    per_batch = b["real_tokens"] / (b["compute_ms"] / 1e3)
    for i, bucket in enumerate(buckets):
        mask = b["bucket_len"] == bucket
        ax.scatter(t[mask], per_batch[mask], s=10, alpha=0.5, color=palette(i / max(1, len(buckets) - 1) * 0.9),
                   label=f"one batch, bucket {_fmt(bucket)}")
    ok = np.isfinite(t) & np.isfinite(b["real_tokens"])
    bins = int(np.clip(ok.sum() // 10, 5, 60))
    edges = np.linspace(0, max(t[ok].max(), 1e-3), bins + 1)
    tokens, _ = np.histogram(t[ok], bins=edges, weights=b["real_tokens"][ok])
    ax.stairs(tokens / np.diff(edges), edges, color="black", lw=2, label="whole run (all workers)")
    ax.set_ylabel("real tokens per second")
    ax.yaxis.set_major_formatter(EngFormatter())
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", ncols=2)
    return fig


def padding_chart(b) -> Figure:
    fig, ax = _figure("Padding efficiency per bucket")
    buckets = sorted({v for v in b["bucket_len"].tolist() if np.isfinite(v)})
    efficiency = [100 * _ratio(b["real_tokens"][b["bucket_len"] == k], b["padded_tokens"][b["bucket_len"] == k])
                  for k in buckets]
    labels = [_fmt(k) for k in buckets]
    bars = ax.bar(labels, efficiency, color="steelblue")
    ax.bar_label(bars, [f"{e:.0f}%\n{int((b['bucket_len'] == k).sum())} batches" for e, k in zip(efficiency, buckets)],
                 label_type="center", color="white", fontweight="bold")
    overall = 100 * _ratio(b["real_tokens"], b["padded_tokens"])
    if np.isfinite(overall):
        ax.axhline(overall, color="darkorange", ls="--", label=f"whole run: {overall:.0f}%")
        ax.legend(loc="lower right")
    ax.set_ylim(0, 118)
    ax.set_xlabel("bucket length (tokens)")
    ax.set_ylabel("real / padded tokens (%)")
    return fig


def memory_chart(b) -> Figure:
    sources = sorted(set(b["memory_source"]) - {""})
    fig, ax = _figure("Memory over the run" + (f" ({', '.join(sources)})" if sources else ""))
    t = _time_axis(ax, b)
    if t is None:
        return fig
    peak = np.nanmax(np.append(b["memory_peak_bytes"], b["memory_in_use_bytes"]), initial=0)
    unit, scale = ("GiB", 2.0 ** 30) if peak >= 2 * 2 ** 30 else ("MiB", 2.0 ** 20)
    series = sorted(set(zip(b["worker"], b["device"])))
    palette = matplotlib.colormaps["tab10"]
    for i, (worker, device) in enumerate(series):
        mask = (b["worker"] == worker) & (b["device"] == device)
        name = f"{worker or '?'} {device.split(' ')[0]}" if len(series) <= 4 else None
        ax.plot(t[mask], b["memory_in_use_bytes"][mask] / scale, color=palette(i % 10), lw=0.6, alpha=0.6,
                marker=".", ms=4, label=name and f"in use after batch, {name}")
        ax.plot(t[mask], b["memory_peak_bytes"][mask] / scale, color=palette(i % 10), lw=2, ls="--",
                drawstyle="steps-post", label=name and f"peak, {name}")
    if len(series) > 4:
        ax.legend(handles=[Line2D([], [], color="gray", marker=".", label="in use after batch"),
                           Line2D([], [], color="gray", ls="--", label="peak")], loc="lower right")
    else:
        ax.legend(loc="lower right")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    return fig


def compile_chart(b) -> Figure:
    again = recompilations(b)
    fig, ax = _figure(f"XLA compile events: {_count(int(b['compiled'].sum()), 'compile')}, "
                          f"{_count(again.size, 'recompilation')}")
    t = _time_axis(ax, b)
    if t is None:
        return fig
    buckets = sorted({v for v in b["bucket_len"].tolist() if np.isfinite(v)})
    y = np.array([buckets.index(v) if v in buckets else -1 for v in b["bucket_len"].tolist()], dtype=float)
    first = b["compiled"].copy()
    first[again] = False
    ax.scatter(t, y, s=6, color="lightgray", label="batch")
    ax.scatter(t[first], y[first], s=60, marker="^", color="royalblue", label="first compile of a shape")
    ax.scatter(t[again], y[again], s=120, marker="X", color="crimson", label="recompilation")
    ax.set_yticks(range(len(buckets)), [_fmt(k) for k in buckets])
    ax.set_ylim(-0.6, len(buckets) - 0.4 + 0.8)
    ax.set_ylabel("bucket length (tokens)")
    ax.legend(loc="upper right", ncols=3)
    return fig


def rejects_chart(run: Run) -> Figure | None:
    counts = rejected_by_kind(run)
    if not counts:
        return None
    fig, ax = _figure(f"Rejected documents by kind ({sum(counts.values())} in all)")
    kinds = sorted(counts, key=counts.get)
    bars = ax.barh(kinds, [counts[k] for k in kinds], color="indianred")
    ax.bar_label(bars, padding=3)
    ax.set_xlabel("documents")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, max(counts.values()) * 1.15)
    ax.grid(axis="y", visible=False)
    return fig


def _img(fig: Figure | None, alt: str) -> str:
    if fig is None:
        return f"<p class=note>{html.escape(alt)}: none.</p>"
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


# ---------------------------------------------------------------- html

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
main{max-width:1360px;margin:auto;padding:16px 24px}
h1{margin:.2em 0}h2{margin:1.4em 0 .5em;border-bottom:1px solid #ddd}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 14px}
.card b{display:block;font-size:20px}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:14px}
.charts figure{margin:0;background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px}
img{width:100%;height:auto;display:block}
table{border-collapse:collapse;background:#fff;margin:6px 0}
th,td{border:1px solid #ddd;padding:3px 9px;text-align:left;vertical-align:top}
td.n{text-align:right;font-variant-numeric:tabular-nums}
th{background:#f0f0f0}
.regressions{border-radius:6px;padding:4px 16px 12px;margin-top:12px}
.bad{background:#fdecea;border:2px solid #c62828}.ok{background:#e8f5e9;border:2px solid #2e7d32}
tr.flag td{background:#ffcdd2;font-weight:bold}.warn{background:#fff8e1;border:2px solid #f9a825;padding:4px 12px}
.note{color:#666}
"""

_SUMMARY_FIELDS = {
    "model": "model", "config_digest": "config digest", "started_at": "started", "finished_at": "finished",
    "wall_seconds": "wall time (s)", "docs_read": "documents read", "docs_embedded": "documents embedded",
    "docs_rejected": "documents rejected", "windows": "windows", "batches": "batches",
    "real_tokens": "real tokens", "padded_tokens": "padded tokens", "padding_efficiency": "padding efficiency",
    "docs_per_second": "documents/s", "tokens_per_second": "tokens/s",
    "attention_backends": "batches by attention backend", "fallbacks": "attention fallbacks (batches)",
    "rejected_by_kind": "rejected documents by kind", "versions": "versions"}


def _fmt(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return "—" if value is None else str(value)
    if not np.isfinite(value):
        return "—"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _pct(value) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) and np.isfinite(value) else "—"


def _table(header: list[str], rows: list[list], flags: list[bool] | None = None) -> str:
    def cell(v):
        numeric = isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
        return f"<td class=n>{_fmt(v)}</td>" if numeric else f"<td>{html.escape(str(v))}</td>"
    body = "".join(f"<tr{' class=flag' if flags and flags[i] else ''}>{''.join(cell(v) for v in row)}</tr>"
                   for i, row in enumerate(rows))
    return f"<table><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in header)}</tr>{body}</table>"


def _summary_value(key: str, value) -> str:
    if key == "padding_efficiency":
        return _pct(value)
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) or "none"
    return _fmt(value)


def _regressions_section(run: Run, baseline: Run, regressions: list[Regression], threshold: float) -> str:
    changes = latency_changes(run, baseline)
    limit = 1 + threshold
    rows = [[_fmt(b.bucket_len), now.backend or "?", b.median_ms, now.median_ms,
             f"{now.median_ms / b.median_ms - 1:+.1%}"] for b, now in changes]
    verdict = (f"<p><b>{len(regressions)} regression(s) found.</b></p>" +
               _table(["what", "where", "baseline", "current", "detail"],
                      [[r.what, r.where, r.baseline, r.current, r.detail] for r in regressions])
               if regressions else "<p><b>No regressions.</b></p>")
    return (f"<section class='regressions {'bad' if regressions else 'ok'}'><h2>Regressions vs baseline</h2>"
            f"<p>Baseline: <code>{html.escape(baseline.path)}</code>. Flagged: a (bucket, backend) whose median "
            f"compute_ms grew by more than {threshold:.0%}, and any increase in rejected documents or fallbacks."
            f"</p>{verdict}<h3>Median compute_ms per bucket and backend</h3>"
            + _table(["bucket", "backend", "baseline median (ms)", "current median (ms)", "change"], rows,
                     [now.median_ms > b.median_ms * limit for b, now in changes]) + "</section>")


def render_html(run: Run, baseline: Run | None = None, regressions: list[Regression] = (),
                threshold: float = 0.10) -> str:
    s, b = run.summary, run.batches
    with matplotlib.rc_context(_STYLE):
        charts = [_img(latency_chart(b), "batch latency by bucket and backend"),
                  _img(throughput_chart(b), "throughput over the run"),
                  _img(padding_chart(b), "padding efficiency per bucket"),
                  _img(memory_chart(b), "memory over the run"),
                  _img(compile_chart(b), "XLA compile events"),
                  _img(rejects_chart(run), "rejected documents by kind")]
    cards = [("documents embedded", _fmt(s.get("docs_embedded"))), ("rejected", _fmt(s.get("docs_rejected"))),
             ("batches", _fmt(s.get("batches", len(b["compiled"])))), ("wall time (s)", _fmt(s.get("wall_seconds"))),
             ("documents/s", _fmt(s.get("docs_per_second"))), ("tokens/s", _fmt(s.get("tokens_per_second"))),
             ("padding efficiency", _pct(s.get("padding_efficiency"))),
             ("fallback batches", _fmt(sum(fallbacks(run).values())))]
    again = recompilations(b)
    recompile_html = ("<div class=warn><b>⚠ Recompilations after a shape's first batch</b>" + _table(
        ["batch", "time (s)", "worker", "device", "bucket", "rows", "backend", "compute_ms"],
        [[b["batch_id"][i], b["t_s"][i], b["worker"][i], b["device"][i], _fmt(b["bucket_len"][i]), b["rows"][i],
          b["attention_backend"][i], b["compute_ms"][i]] for i in again]) + "</div>") if again.size else ""
    stats = bucket_stats(b)
    bucket_table = _table(
        ["bucket", "backend", "batches", "compiles", "median compute_ms", "p90 compute_ms", "tokens/s",
         "padding efficiency"],
        [[_fmt(x.bucket_len), x.backend or "?", x.batches, x.compiles, x.median_ms, x.p90_ms, x.tokens_per_s,
          _pct(x.padding_efficiency)] for x in stats])
    summary_rows = [[label, _summary_value(key, s[key])] for key, label in _SUMMARY_FIELDS.items() if key in s]
    summary_rows += [[key, _summary_value(key, v)] for key, v in s.items()
                     if key not in _SUMMARY_FIELDS and key != "metrics"]
    metrics = s.get("metrics") or {}
    rejected_sample = _table(["source", "line", "id", "kind", "reason"],
                             [[e.get("source", ""), _fmt(e.get("line")), _fmt(e.get("id")), e.get("kind", ""),
                               e.get("reason", "")] for e in run.errors[:25]])
    return f"""<!DOCTYPE html>
<html lang=en><head><meta charset=utf-8><title>docbeam report: {html.escape(run.path)}</title>
<style>{_CSS}</style></head><body><main>
<h1>docbeam run report</h1>
<p>Run: <code>{html.escape(run.path)}</code> · model: {html.escape(str(s.get("model", "—")))} ·
started {html.escape(str(s.get("started_at", "—")))}</p>
<div class=cards>{"".join(f"<div class=card>{html.escape(k)}<b>{html.escape(v)}</b></div>" for k, v in cards)}</div>
{_regressions_section(run, baseline, list(regressions), threshold) if baseline is not None else ""}
<h2>Per bucket</h2>
<p class=note>Latency and tokens/s count steady batches only (compiling calls left out); tokens/s is real tokens
per second of compute on one device.</p>{bucket_table}
<h2>Charts</h2>
<div class=charts>{"".join(f"<figure>{c}</figure>" for c in charts)}</div>
{recompile_html}
<h2>Rejected documents</h2>
{rejected_sample if run.errors else "<p class=note>No error records.</p>"}
{f"<p class=note>First 25 of {len(run.errors)} shown.</p>" if len(run.errors) > 25 else ""}
<h2>Summary</h2>{_table(["field", "value"], summary_rows)}
<h2>Metrics</h2>
{_table(["counter", "value"], [[k, v] for k, v in (metrics.get("counters") or {}).items()])}
{_table(["distribution", "count", "sum", "min", "max", "mean"],
        [[k] + [d.get(f, "—") for f in ("count", "sum", "min", "max", "mean")]
         for k, d in (metrics.get("distributions") or {}).items()])}
</main></body></html>
"""


# ---------------------------------------------------------------- entry points

def report(output: str, *, baseline: str | None = None, dest: str | None = None,
           threshold: float = 0.10) -> ReportResult:
    """Writes the report of the run at ``output`` to ``dest`` (default ``<output>/report.html``)."""
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
                     "--baseline was given and at least one regression was found.")
    parser.add_argument("output", help="the run's output path (holds timing/, errors/, summary.json)")
    parser.add_argument("--baseline", help="output path of an earlier run to compare against; regressions "
                        "make the command exit with status 1")
    parser.add_argument("--out", help="where to write the HTML (default: OUTPUT/report.html)")
    parser.add_argument("--threshold", type=float, default=0.10,
                        help="flag a (bucket, backend) whose median compute_ms grew by more than this fraction "
                             "(default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    """Runs ``docbeam report``; returns the exit status (1 when regressions were found)."""
    result = report(args.output, baseline=args.baseline, dest=args.out, threshold=args.threshold)
    print(f"wrote {result.path}")
    for regression in result.regressions:
        print(f"REGRESSION {regression}", file=sys.stderr)
    return 1 if result.regressions else 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="docbeam report")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))

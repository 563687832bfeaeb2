"""The charts and the HTML page of ``docbeam report``; pipeline/report.py loads and analyses the run.

Charts are matplotlib figures drawn off-screen and inlined as PNGs; the page has no scripts or external assets.
"""
from __future__ import annotations

import base64
import html
import io
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, MaxNLocator

from pipeline.report import (Regression, Run, _fmt, _groups, _ratio, bucket_stats, fallbacks, latency_changes,
                             recompilations, rejected_by_kind)

_STYLE = {"font.size": 11, "axes.titlesize": 12, "axes.titleweight": "bold", "axes.grid": True,
          "grid.alpha": 0.3, "legend.fontsize": 9, "legend.framealpha": 0.85}


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

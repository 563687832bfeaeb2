"""The charts of ``docbeam report``, drawn off-screen with matplotlib from data.py's structures (beside it).

A chart with nothing to show (no batches, no memory figures, no rejects) is ``None`` rather than an empty
frame, so the page can say so in words; matplotlib itself fails on some empty inputs (a boxplot of nothing).
"""

from __future__ import annotations

import io
import textwrap
from typing import Any, Callable

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, MaxNLocator

from docbeam.pipeline.tools.report.data import (
    buckets,
    fmt,
    groups,
    memory_series,
    padding_by_bucket,
    ratio,
    recompilations,
    rejected_by_kind,
    steady,
)
from docbeam.pipeline.tools.report.load import Run

TITLE_CHARACTERS = 72  # a line of the bold 12-point title that fits the 8-inch figure
_STYLE = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.titleweight": "bold",
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.fontsize": 9,
    "legend.framealpha": 0.85,
}


def _figure(title: str) -> tuple[Figure, Any]:
    fig = Figure(figsize=(8, 4.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(textwrap.fill(title, TITLE_CHARACTERS))  # a long title wraps instead of running off the figure
    return fig, ax


def _time_axis(ax, batches) -> np.ndarray | None:
    if not np.isfinite(batches["t_s"]).any():
        ax.text(0.5, 0.5, "no started_at timestamps in timing records", ha="center", transform=ax.transAxes)
        return None
    ax.set_xlabel("time since first batch started (s)")
    return batches["t_s"]


def _fit_xticklabels(ax) -> None:
    """Turns the x tick labels upright, on one line each, when drawn level neighbours would overlap (many
    buckets or long backend names); upright labels need only a line's height of width each."""
    ax.figure.canvas.draw()
    labels = [t for t in ax.get_xticklabels() if t.get_text()]
    boxes = [t.get_window_extent() for t in labels]
    if any(a.x1 + 2 > b.x0 for a, b in zip(boxes, boxes[1:])):
        ax.set_xticks(ax.get_xticks(), [t.get_text().replace("\n", " · ") for t in ax.get_xticklabels()], rotation=90)


def _backend_colors(batches) -> dict[str, Any]:
    palette = matplotlib.colormaps["tab10"]
    return {name: palette(i % 10) for i, name in enumerate(sorted(set(batches["attention_backend"])))}


def latency_chart(run: Run) -> Figure | None:
    b = run.batches
    if not run.batch_count:
        return None
    fig, ax = _figure("Batch latency by bucket and backend")
    pairs, colors = groups(b), _backend_colors(b)
    positions = np.arange(1, len(pairs) + 1)
    boxes = ax.boxplot(
        [b["compute_ms"][steady(b, mask)] for _, mask in pairs],
        positions=positions,
        widths=0.6,
        patch_artist=True,
        medianprops={"color": "black"},
        flierprops={"markersize": 3, "alpha": 0.5},
    )
    for box, ((_, backend), _) in zip(boxes["boxes"], pairs):
        box.set(facecolor=colors[backend], alpha=0.7)
    for position, (_, mask) in zip(positions, pairs):
        compiling = b["compute_ms"][mask & b["compiled"]]
        ax.scatter(np.full(compiling.size, position), compiling, marker="x", color="crimson", zorder=3)
    finite = b["compute_ms"][np.isfinite(b["compute_ms"]) & (b["compute_ms"] > 0)]
    log = finite.size and finite.max() / finite.min() > 30
    if log:
        ax.set_yscale("log")
    ax.set_xticks(positions, [f"{fmt(k[0])}\n{k[1] or '?'}" for k, _ in pairs], fontsize=9 if len(pairs) > 8 else None)
    ax.set_xlabel("bucket length (tokens) / attention backend")
    ax.set_ylabel("compute time per batch (ms" + (", log scale)" if log else ")"))
    handles = [Patch(facecolor=c, alpha=0.7, label=f"{n or '?'} (steady batches)") for n, c in colors.items()]
    handles.append(Line2D([], [], marker="x", color="crimson", ls="", label="compiling call"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4))
    _fit_xticklabels(ax)
    return fig


def throughput_chart(run: Run) -> Figure | None:
    b = run.batches
    if not run.batch_count:
        return None
    fig, ax = _figure("Throughput over the run")
    t = _time_axis(ax, b)
    if t is None:
        return fig
    palette = matplotlib.colormaps["viridis"]
    lengths = buckets(b)
    per_batch = b["real_tokens"] / (b["compute_ms"] / 1e3)
    for i, bucket in enumerate(lengths):
        mask = b["bucket_len"] == bucket
        ax.scatter(
            t[mask],
            per_batch[mask],
            s=10,
            alpha=0.5,
            color=palette(i / max(1, len(lengths) - 1) * 0.9),
            label=f"one batch, bucket {fmt(bucket)}",
        )
    ok = np.isfinite(t) & np.isfinite(b["real_tokens"])
    if ok.any():
        bins = int(np.clip(ok.sum() // 10, 5, 60))
        edges = np.linspace(0, max(t[ok].max(), 1e-3), bins + 1)
        tokens, _ = np.histogram(t[ok], bins=edges, weights=b["real_tokens"][ok])
        ax.stairs(tokens / np.diff(edges), edges, color="black", lw=2, label="whole run (all workers)")
    ax.set_ylabel("real tokens per second")
    ax.yaxis.set_major_formatter(EngFormatter())
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", ncols=2 if len(lengths) < 6 else 3, fontsize=8 if len(lengths) >= 6 else None)
    return fig


def padding_chart(run: Run) -> Figure | None:
    """Bars per bucket with the efficiency above each bar and the batch count under its tick, so no label has
    to fit inside a bar (a low-efficiency bar is too short, and with many buckets too narrow, to hold one)."""
    per_bucket = padding_by_bucket(run.batches)
    if not per_bucket:
        return None
    fig, ax = _figure("Padding efficiency per bucket")
    small = len(per_bucket) > 8
    ticks = [f"{fmt(k)}\n{fmt(n)}" for k, _, n in per_bucket]
    efficiency = [100 * e for _, e, _ in per_bucket]
    bars = ax.bar(range(len(per_bucket)), np.nan_to_num(efficiency), color="steelblue")
    ax.bar_label(
        bars, [f"{e:.0f}%" if np.isfinite(e) else "—" for e in efficiency], padding=2, fontsize=8 if small else 10
    )
    ax.set_xticks(range(len(per_bucket)), ticks, fontsize=8 if small else 10)
    overall = 100 * ratio(run.batches["real_tokens"], run.batches["padded_tokens"])
    if np.isfinite(overall):
        ax.axhline(overall, color="darkorange", ls="--", label=f"whole run: {overall:.0f}%")
        ax.legend(loc="lower right")
    ax.set_ylim(0, 118)
    ax.set_xlabel("bucket length (tokens) / batches")
    ax.set_ylabel("real / padded tokens (%)")
    ax.grid(axis="x", visible=False)
    _fit_xticklabels(ax)
    return fig


def memory_chart(run: Run) -> Figure | None:
    b = run.batches
    known = np.isfinite(np.append(b["memory_peak_bytes"], b["memory_in_use_bytes"]))
    if not known.any():
        return None
    sources = sorted(set(b["memory_source"]) - {""})
    fig, ax = _figure("Memory over the run" + (f" ({', '.join(sources)})" if sources else ""))
    t = _time_axis(ax, b)
    if t is None:
        return fig
    series = memory_series(run)
    peak = np.nanmax(np.concatenate([np.append(s.peak, s.in_use) for s in series]))
    unit, scale = ("GiB", 2.0**30) if peak >= 2 * 2**30 else ("MiB", 2.0**20)
    palette = matplotlib.colormaps["tab10"]
    for i, s in enumerate(series):  # a worker's chip: on a mesh, each of its chips
        name = f"{s.worker or '?'} {s.device.split(' ')[0]}" if len(series) <= 4 else None
        ax.plot(
            t[s.rows],
            s.in_use / scale,
            color=palette(i % 10),
            lw=0.6,
            alpha=0.6,
            marker=".",
            ms=4,
            label=name and f"in use after batch, {name}",
        )
        if np.isfinite(s.peak).any():
            ax.plot(
                t[s.rows],
                s.peak / scale,
                color=palette(i % 10),
                lw=2,
                ls="--",
                drawstyle="steps-post",
                label=name and f"peak, {name}",
            )
    if len(series) > 4:
        ax.legend(
            handles=[
                Line2D([], [], color="gray", marker=".", label="in use after batch"),
                Line2D([], [], color="gray", ls="--", label="peak"),
            ],
            loc="lower right",
        )
    else:
        ax.legend(loc="lower right")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    return fig


def compile_title(summary: dict, in_batches: int, recompiled: int) -> str:
    """Every compilation the run made: those ahead of the first batch (summary.json's ``compiles_ahead``, no
    batch marks them) and those a batch made itself (the markers)."""
    ahead = summary.get("compiles_ahead") or 0
    total = summary.get("compiles", ahead + in_batches)
    return (
        f"XLA compilations: {count(total, 'compilation')} ({ahead} ahead of time, {in_batches} in a batch), "
        f"{count(recompiled, 'recompilation')}"
    )


def compile_chart(run: Run) -> Figure | None:
    b = run.batches
    if not run.batch_count:
        return None
    again = recompilations(b)
    fig, ax = _figure(compile_title(run.summary, int(b["compiled"].sum()), again.size))
    t = _time_axis(ax, b)
    if t is None:
        return fig
    lengths = buckets(b)
    y = np.array([lengths.index(v) if v in lengths else -1 for v in b["bucket_len"].tolist()], dtype=float)
    first = b["compiled"].copy()
    first[again] = False
    ax.scatter(t, y, s=6, color="lightgray", label="batch")
    ax.scatter(t[first], y[first], s=60, marker="^", color="royalblue", label="first compile of a shape")
    ax.scatter(t[again], y[again], s=120, marker="X", color="crimson", label="recompilation")
    ax.set_yticks(range(len(lengths)), [fmt(k) for k in lengths])
    ax.set_ylim(-0.6, len(lengths) - 0.4 + 0.8)
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


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


CHARTS: dict[str, Callable[[Run], Figure | None]] = {
    "batch latency by bucket and backend": latency_chart,
    "throughput over the run": throughput_chart,
    "padding efficiency per bucket": padding_chart,
    "memory over the run": memory_chart,
    "XLA compile events": compile_chart,
    "rejected documents by kind": rejects_chart,
}


def draw(run: Run) -> dict[str, bytes | None]:
    """Every chart of ``run`` as PNG bytes, keyed by its description; ``None`` for a chart with no data."""
    with matplotlib.rc_context(_STYLE):
        return {name: _png(chart(run)) for name, chart in CHARTS.items()}


def _png(fig: Figure | None) -> bytes | None:
    if fig is None:
        return None
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()

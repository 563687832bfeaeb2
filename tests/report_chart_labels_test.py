"""The report's charts keep their labels readable: padding labels fit their bars, latency ticks never collide, and compilations made ahead of time are counted."""

from __future__ import annotations

import pytest

from docbeam.pipeline.tools.report import charts as report_charts
from docbeam.pipeline.tools.report import load as report_load


def _records(efficiency: dict[int, float], backends=("native",)) -> list[dict]:
    return [
        {
            "batch_id": f"{bucket}/{backend}/{i}",
            "bucket_len": bucket,
            "rows": 8,
            "padded_tokens": 8 * bucket,
            "real_tokens": int(8 * bucket * e),
            "compute_ms": 5.0 + i,
            "compiled": i == 0,
            "attention_backend": backend,
            "started_at": f"2026-05-01T12:00:{i:02d}+00:00",
        }
        for bucket, e in efficiency.items()
        for backend in backends
        for i in range(1234 if bucket == 48 else 3)
    ]


def _inside(inner, outer, slack=1.0) -> bool:
    return (
        inner.x0 >= outer.x0 - slack
        and inner.x1 <= outer.x1 + slack
        and inner.y0 >= outer.y0 - slack
        and inner.y1 <= outer.y1 + slack
    )


@pytest.mark.parametrize("count", [4, 8, 12])
def test_padding_chart_labels_fit(count):
    """Each bar's label sits within its bar's width and inside the plot, and no two tick labels collide,
    for as many buckets as a config has, a bar of 5% and one of 1,234 batches."""
    lengths = [48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 512][:count]
    efficiency = {k: 0.05 if k == 64 else 0.5 + 0.04 * i for i, k in enumerate(lengths)}
    run = report_load.Run("r", {}, report_load.batch_columns(_records(efficiency)), [])
    fig = report_charts.padding_chart(run)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    bars = [p.get_window_extent(renderer) for p in ax.patches]
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(bars) == len(labels) == count
    for bar, label in zip(bars, labels):
        assert bar.x0 <= label.x0 and label.x1 <= bar.x1, (bar, label)
        assert _inside(label, ax.get_window_extent(renderer)), label
    ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    assert not any(a.overlaps(b) for i, a in enumerate(ticks) for b in ticks[i + 1 :])
    assert all(_inside(t, fig.bbox) for t in ticks)


def test_latency_chart_tick_labels_do_not_collide_with_many_buckets():
    efficiency = {k: 0.8 for k in (48, 64, 80, 96, 128, 160, 192, 224, 256)}
    run = report_load.Run("r", {}, report_load.batch_columns(_records(efficiency, ("native", "chunked"))), [])
    fig = report_charts.latency_chart(run)
    fig.canvas.draw()
    ticks = [t.get_window_extent() for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert len(ticks) == 18
    assert not any(a.overlaps(b) for i, a in enumerate(ticks) for b in ticks[i + 1 :])


def test_the_compile_chart_counts_compilations_made_ahead_of_the_first_batch():
    """The command says "2 compilations" when both shapes compiled in the background before any batch; the
    chart must not say 0."""
    from docbeam.pipeline.tools.report.charts import compile_title

    assert compile_title({"compiles": 2, "compiles_ahead": 2}, in_batches=0, recompiled=0).startswith(
        "XLA compilations: 2 compilations (2 ahead of time, 0 in a batch)"
    )
    assert (
        compile_title({}, in_batches=3, recompiled=1)
        == "XLA compilations: 3 compilations (0 ahead of time, 3 in a batch), 1 recompilation"
    )

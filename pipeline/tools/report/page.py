"""The HTML page of ``docbeam report``, from pipeline/tools/report/data.py's structures and
pipeline/tools/report/charts.py's PNGs. The page inlines its charts and has no scripts or external assets.
"""

from __future__ import annotations

import base64
import html

from docbeam.models.heads.registry import described
from docbeam.pipeline.telemetry import memory_trend
from docbeam.pipeline.tools.report import charts
from docbeam.pipeline.tools.report.data import (
    Regression,
    bucket_stats,
    fallbacks,
    fmt,
    latency_changes,
    memory_trends,
    recompilations,
    rejected_by_kind,
)
from docbeam.pipeline.tools.report.load import Run
from docbeam.pipeline.tools.report.tables import costs, nested, pct, summary_tables, table

# .w (a cell with a long unbroken value: a gs:// path, a digest) and code wrap anywhere rather than widen
# the page; other cells keep whole words.
_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
main{max-width:1360px;margin:auto;padding:16px 24px}
h1{margin:.2em 0}h2{margin:1.4em 0 .5em;border-bottom:1px solid #ddd}
code,td.w{overflow-wrap:anywhere}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 14px}
.card b{display:block;font-size:20px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(560px,100%),1fr));gap:14px}
.charts figure{margin:0;background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px}
img{width:100%;height:auto;display:block}
table{border-collapse:collapse;background:#fff;margin:6px 0;max-width:100%}
th,td{border:1px solid #ddd;padding:3px 9px;text-align:left;vertical-align:top}
td.n{text-align:right;font-variant-numeric:tabular-nums}
th{background:#f0f0f0}
.regressions{border-radius:6px;padding:4px 16px 12px;margin-top:12px}
.bad{background:#fdecea;border:2px solid #c62828}.ok{background:#e8f5e9;border:2px solid #2e7d32}
.amber{background:#fff8e1;border:2px solid #ef8f00}
tr.flag td{background:#ffcdd2;font-weight:bold}.warn{background:#fff8e1;border:2px solid #f9a825;padding:4px 12px}
.empty{background:#fff8e1;border:2px solid #f9a825;border-radius:6px;padding:8px 14px;margin-top:12px}
.note{color:#666}
"""

_SUMMARY_FIELDS = {
    "model": "model",
    "config_digest": "config digest",
    "started_at": "started",
    "finished_at": "finished",
    "wall_seconds": "wall time (s)",
    "docs_read": "documents read",
    "docs_embedded": "documents embedded",
    "docs_rejected": "documents rejected",
    "docs_reused": "documents reused from an earlier run",
    "docs_encoded": "documents encoded",
    "reused_token_share": "share of tokens not encoded (reused)",
    "reuse": "reused from",
    "windows": "windows encoded",
    "batches": "batches",
    "real_tokens": "real tokens",
    "padded_tokens": "padded tokens",
    "padding_efficiency": "padding efficiency",
    "docs_per_second": "documents/s",
    "tokens_per_second": "tokens/s",
    "attention_backends": "batches by attention backend",
    "fallbacks": "attention fallbacks (batches)",
    "rejected_by_kind": "rejected documents by kind",
}
_OWN_TABLES = (
    "attention_plan",
    "buckets",
    "versions",
    "metrics",
    "startup",
    "stages",
    "memory",
    "cost",
)  # shown as tables of their own


def _summary_value(key: str, value) -> str:
    if key in ("padding_efficiency", "reused_token_share"):
        return pct(value)
    if isinstance(value, dict):  # nested ones (summary.json's representations) read "name (key: value, ...)"
        shown = {k: v for k, v in value.items() if v not in (None, "", {}, [], ())}  # an empty field says nothing
        return (
            "; ".join(f"{k} {nested(v)}" if isinstance(v, dict) else f"{k}: {nested(v)}" for k, v in shown.items())
            or "none"
        )
    if isinstance(value, (list, tuple)):
        return "; ".join(nested(v) for v in value) or "none"
    return fmt(value)


def _status_notes(run: Run) -> str:
    """What a reader must know before the numbers: the run was not committed, or no batch ran (and so there
    are no latency, throughput, padding or compile charts)."""
    s, notes = run.summary, []
    if s.get("failed"):
        failed = s["failed"] if isinstance(s["failed"], list) else [s["failed"]]
        notes.append(f"This run failed and was not committed: {'; '.join(map(str, failed))}.")
    if not (run.batch_count or s.get("batches")):
        notes.append(_no_batches(run))
    return "".join(f"<p class=empty><b>{html.escape(note)}</b></p>" for note in notes)


def _no_batches(run: Run) -> str:
    s = run.summary
    rejected = s.get("docs_rejected", sum(rejected_by_kind(run).values()))
    note = f"No batches ran: {fmt(s.get('docs_embedded', 0))} documents embedded, {fmt(rejected)} rejected"
    if rejected:
        note += " — see rejected documents by kind below."
    elif s.get("docs_read") == 0:
        note += " — the input held no documents; check input.path."
    else:
        note += "."
    return note


def _charts(run: Run) -> str:
    pngs = charts.draw(run)
    figures = "".join(
        f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode("ascii")}"></figure>'
        for alt, png in pngs.items()
        if png
    )
    missing = [alt for alt, png in pngs.items() if png is None]
    return (f"<div class=charts>{figures}</div>" if figures else "") + (
        f"<p class=note>No data to draw: {html.escape(', '.join(missing))}.</p>" if missing else ""
    )


def _regressions_section(run: Run, baseline: Run, regressions: list[Regression], threshold: float) -> str:
    changes = latency_changes(run, baseline)
    limit = 1 + threshold
    rows = [
        [fmt(b.bucket_len), now.backend or "?", b.median_ms, now.median_ms, f"{now.median_ms / b.median_ms - 1:+.1%}"]
        for b, now in changes
    ]
    if regressions:
        verdict = f"<p><b>{len(regressions)} regression(s) found.</b></p>" + table(
            ["what", "where", "baseline", "current", "detail"],
            [[r.what, r.where, r.baseline, r.current, r.detail] for r in regressions],
        )
    elif not changes:
        verdict = (
            "<p><b>Nothing compared:</b> no (bucket, backend) has steady batches in both runs, so no "
            "latency could be compared (different backends or buckets?).</p>"
        )
    else:
        verdict = "<p><b>No regressions.</b></p>"
    status = "bad" if regressions else "ok" if changes else "amber"
    latency = (
        table(
            ["bucket", "backend", "baseline median (ms)", "current median (ms)", "change"],
            rows,
            [now.median_ms > b.median_ms * limit for b, now in changes],
        )
        if changes
        else "<p class=note>No (bucket, backend) has steady batches in both runs.</p>"
    )
    return (
        f"<section class='regressions {status}'><h2>Regressions vs baseline</h2>"
        f"<p>Baseline: <code>{html.escape(baseline.path)}</code>. Flagged: a (bucket, backend) whose median "
        f"compute_ms grew by more than {threshold:.0%}, any increase in rejected documents or fallbacks, and a "
        f"suspected memory leak the baseline did not have (or one growing {threshold:.0%} faster), and a cost per "
        f"million tokens {threshold:.0%} above the baseline's."
        f"</p>{verdict}<h3>Median compute_ms per bucket and backend</h3>{latency}{costs(run, baseline)}</section>"
    )


def _memory_trend(run: Run) -> str:
    """Beside the memory chart: each worker's growth after warm-up and where it would be at 10x the batches."""
    trends = memory_trends(run)
    if not trends:
        return ""
    suspected = [t for t in trends if t.leak_suspected]
    head = (
        "<div class=warn><b>⚠ Memory leak suspected</b> on "
        + html.escape(", ".join(t.worker for t in suspected))
        + "</div>"
        if suspected
        else ""
    )
    rows = [
        [
            t.worker,
            t.batches,
            fmt(t.peak_bytes / 2**20),
            fmt(t.growth_mb_per_1k_batches),
            fmt(None if t.projected_bytes() is None else t.projected_bytes() / 2**20),
            "yes" if t.leak_suspected else "no",
        ]
        for t in trends
    ]
    return (
        f"<h3>Memory growth per worker</h3>{head}"
        + table(
            [
                "worker",
                "batches",
                "peak (MB)",
                "growth after warm-up (MB per 1,000 batches)",
                "projected at 10x the batches (MB)",
                "leak suspected",
            ],
            rows,
            [t.leak_suspected for t in trends],
        )
        + f"<p class=note>Rule: {html.escape(memory_trend.RULE)}.</p>"
    )


def _recompilations(b) -> str:
    again = recompilations(b)
    if not again.size:
        return ""
    return (
        "<div class=warn><b>⚠ Recompilations after a shape's first batch</b>"
        + table(
            ["batch", "time (s)", "worker", "device", "bucket", "rows", "backend", "compute_ms"],
            [
                [
                    b["batch_id"][i],
                    b["t_s"][i],
                    b["worker"][i],
                    b["device"][i],
                    fmt(b["bucket_len"][i]),
                    b["rows"][i],
                    b["attention_backend"][i],
                    b["compute_ms"][i],
                ]
                for i in again
            ],
        )
        + "</div>"
    )


def _sink_sections(s: dict) -> dict[str, str]:
    """Each sink's tables of its record in the summary (pipeline/sinks/: Sink.report_tables), by its key."""
    from docbeam.pipeline import sinks

    sections = {}
    for key, sink in sinks.SINKS.items():
        try:
            tables = sink.report_tables(s[key]) if isinstance(s.get(key), dict) else []
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # a garbled summary.json
            sections[key] = (
                f"<p class=warn>summary.json's {html.escape(key)} record cannot be read ({html.escape(repr(e))})</p>"
            )
            continue
        if tables:
            sections[key] = "".join(
                f"<h2>{html.escape(title)}</h2>"
                + (f"<p class=note>{html.escape(note)}</p>" if note else "")
                + table(headers, rows)
                for title, headers, rows, note in tables
            )
    return sections


def _top_labels(labels: dict) -> str:
    """The label distribution of a classifier's run, most frequent first: ``pos 60% · neg 40%``."""
    total = sum(labels.values()) or 1
    return " · ".join(f"{name} {count / total:.0%}" for name, count in list(labels.items())[:4])


def render_html(
    run: Run, baseline: Run | None = None, regressions: list[Regression] = (), threshold: float = 0.10
) -> str:
    s, b = run.summary, run.batches
    head = described(s.get("head") or {})
    cards = [
        (f"documents {head.get('verb', 'embedded')}", fmt(s.get("docs_embedded"))),
        *([("head", head["line"])] if head.get("line") else []),  # the head's own line, where it is worth one
        ("rejected", fmt(s.get("docs_rejected"))),
        *([("top label", _top_labels(s["labels"]))] if s.get("labels") else []),
        *([("reused", fmt(s["docs_reused"]))] if s.get("docs_reused") else []),
        ("batches", fmt(s.get("batches", run.batch_count))),
        ("wall time (s)", fmt(s.get("wall_seconds"))),
        ("documents/s", fmt(s.get("docs_per_second"))),
        ("tokens/s", fmt(s.get("tokens_per_second"))),
        ("padding efficiency", pct(s.get("padding_efficiency"))),
        ("fallback batches", fmt(sum(fallbacks(run).values()))),
    ]
    stats = bucket_stats(b)
    bucket_table = (
        table(
            [
                "bucket",
                "backend",
                "batches",
                "compiles",
                "median compute_ms",
                "p90 compute_ms",
                "tokens/s",
                "padding efficiency",
            ],
            [
                [
                    fmt(x.bucket_len),
                    x.backend or "?",
                    x.batches,
                    x.compiles,
                    x.median_ms,
                    x.p90_ms,
                    x.tokens_per_s,
                    pct(x.padding_efficiency),
                ]
                for x in stats
            ],
        )
        if stats
        else "<p class=note>No batches.</p>"
    )
    sink_sections = _sink_sections(s)
    summary_rows = [[label, _summary_value(key, s[key])] for key, label in _SUMMARY_FIELDS.items() if key in s]
    summary_rows += [
        [key, _summary_value(key, v)]
        for key, v in s.items()
        if key not in _SUMMARY_FIELDS and key not in _OWN_TABLES and key not in sink_sections
    ]
    metrics = s.get("metrics") or {}
    rejected_sample = table(
        ["source", "line", "id", "kind", "reason"],
        [
            [e.get("source", ""), e.get("line"), fmt(e.get("id")), e.get("kind", ""), e.get("reason", "")]
            for e in run.errors[:25]
        ],
    )
    return f"""<!DOCTYPE html>
<html lang=en><head><meta charset=utf-8><title>docbeam report: {html.escape(run.path)}</title>
<style>{_CSS}</style></head><body><main>
<h1>docbeam run report</h1>
<p>Run: <code>{html.escape(run.path)}</code> · model: {html.escape(str(s.get("model", "—")))} ·
started {html.escape(str(s.get("started_at", "—")))}</p>
{_status_notes(run)}
<div class=cards>{"".join(f"<div class=card>{html.escape(k)}<b>{html.escape(v)}</b></div>" for k, v in cards)}</div>
{_regressions_section(run, baseline, list(regressions), threshold) if baseline is not None else ""}
<h2>Per bucket</h2>
<p class=note>Latency and tokens/s count steady batches only (compiling calls left out); tokens/s is real tokens
per second of compute on one device.</p>{bucket_table}
<h2>Charts</h2>
{_charts(run)}
{_memory_trend(run)}
{_recompilations(b)}
{"".join(sink_sections.values())}
<h2>Rejected documents</h2>
{rejected_sample if run.errors else "<p class=note>No error records.</p>"}
{f"<p class=note>First 25 of {len(run.errors)} shown.</p>" if len(run.errors) > 25 else ""}
<h2>Summary</h2>{table(["field", "value"], summary_rows)}{summary_tables(s)}
<h2>Metrics</h2>
{table(["counter", "value"], [[k, v] for k, v in (metrics.get("counters") or {}).items()])}
{
        table(
            ["distribution", "count", "sum", "min", "max", "mean"],
            [
                [k] + [d.get(f, "—") for f in ("count", "sum", "min", "max", "mean")]
                for k, d in (metrics.get("distributions") or {}).items()
            ],
        )
    }
</main></body></html>
"""

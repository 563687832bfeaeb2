"""The report's tables: how a table is drawn, and the summary's nested fields (attention plan and auto's
measurements, per-bucket totals, start-up, stages, cost, versions) as tables of their own."""

from __future__ import annotations

import html

import numpy as np

from docbeam.pipeline.tools.report.data import fmt
from docbeam.pipeline.tools.report.load import Run

STARTUP_GROUPS = {
    "steps_s": "driver (s)",
    "encoder_s": "encoder (s)",
    "compiles_s": "compile (s)",
    "since_process_start_s": "since the process started (s)",
    "steady_state": "steady state",
}


def pct(value) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) and np.isfinite(value) else "—"


def table(header: list[str], rows: list[list], flags: list[bool] | None = None) -> str:
    def cell(v):
        if isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
            return f"<td class=n>{fmt(v)}</td>"
        text = fmt(v)
        return f"<td{' class=w' if max(map(len, text.split()), default=0) > 30 else ''}>{html.escape(text)}</td>"

    body = "".join(
        f"<tr{' class=flag' if flags and flags[i] else ''}>{''.join(cell(v) for v in row)}</tr>"
        for i, row in enumerate(rows)
    )
    return f"<table><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in header)}</tr>{body}</table>"


def nested(value) -> str:
    """A value inside a summary value (the head's columns, a list of mappings) in words, never Python's repr."""
    if isinstance(value, dict):
        return f"({', '.join(f'{k}: {nested(v)}' for k, v in value.items())})"
    if isinstance(value, (list, tuple)):
        return ", ".join(nested(v) for v in value) or "none"
    return fmt(value)


def bucket_key(key) -> tuple:
    return (0, int(key), "") if str(key).isdigit() else (1, 0, str(key))


def summary_tables(s: dict) -> str:
    """The summary's nested fields (attention plan, per-bucket totals, versions) as tables of their own."""
    out = []
    plan = s.get("attention_plan") or {}
    if isinstance(plan, dict) and plan:
        out.append(
            "<h3>Attention plan per bucket</h3>"
            + table(
                ["bucket", "backend", "kernel", "fallback reason"],
                [
                    [
                        k,
                        (v or {}).get("backend"),
                        (v or {}).get("kernel") or "—",
                        (v or {}).get("fallback_reason") or "—",
                    ]
                    for k, v in sorted(plan.items(), key=lambda kv: bucket_key(kv[0]))
                ],
            )
        )
    measured = measured_rows(plan) if isinstance(plan, dict) else []
    if measured:
        out.append(
            "<h3>Attention measured per bucket (attention.backend: auto)</h3>"
            + table(["bucket", "candidate", "verdict", "median ms", "± ms", "error vs native", "reason"], measured)
        )
    spent = s.get("cost")
    if isinstance(spent, dict):
        out.append(
            "<h3>Cost</h3>"
            + table(
                ["what", "value"],
                [[k, spent.get(k)] for k in ("usd", "usd_per_million_tokens", "usd_per_million_documents")]
                + [[k, spent.get(k)] for k in ("price_per_hour", "hours", "workers", "source", "leaves_out")],
            )
        )
    totals = s.get("buckets") or {}
    if isinstance(totals, dict) and totals:
        rows = []
        for k, v in sorted(totals.items(), key=lambda kv: bucket_key(kv[0])):
            v = v or {}
            real, padded = v.get("real_tokens"), v.get("padded_tokens")
            known = all(isinstance(n, (int, float)) for n in (real, padded)) and padded > 0
            engines = v.get("engines") if isinstance(v.get("engines"), dict) else {}
            ran = "; ".join(f"{why} ({n} batches)" for why, n in sorted(engines.items())) or "xla"
            rows.append([k, v.get("batches"), real, padded, pct(real / padded if known else None), ran])
        out.append(
            "<h3>Batches per bucket</h3>"
            + table(["bucket", "batches", "real tokens", "padded tokens", "padding efficiency", "engine: why"], rows)
        )
    startup = s.get("startup") or {}
    if isinstance(startup, dict) and startup:
        rows = [
            [f"{STARTUP_GROUPS.get(group, group)}: {k}", v]
            for group, values in startup.items()
            if isinstance(values, dict)
            for k, v in values.items()
        ]
        out.append("<h3>Start-up</h3>" + table(["step", "value"], rows))
    stages = s.get("stages") or {}
    if isinstance(stages, dict) and isinstance(stages.get("share_of_wall"), dict):
        seconds = stages.get("seconds") or {}
        out.append(
            f"<h3>Stages (of {fmt(stages.get('wall_s'))} s of pipeline wall time)</h3>"
            + table(
                ["stage", "seconds in its own code", "share of wall time"],
                [[k, seconds.get(k), pct(v)] for k, v in stages["share_of_wall"].items()],
            )
        )
    versions = s.get("versions") or {}
    if isinstance(versions, dict) and versions:
        out.append("<h3>Versions</h3>" + table(["package", "version"], [[k, str(v)] for k, v in versions.items()]))
    return "".join(out)


def measured_rows(plan: dict) -> list[list]:
    """One row per candidate of each bucket auto measured (attention/measure.py), the chosen one first."""
    rows = []
    for bucket, line in sorted(plan.items(), key=lambda kv: bucket_key(kv[0])):
        m = (line or {}).get("measurement") if isinstance(line, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("candidates"), dict):
            continue
        trials = sorted(m["candidates"].items(), key=lambda kv: (kv[0] != m.get("chosen"), kv[0]))
        for name, t in trials:
            t = t if isinstance(t, dict) else {}
            rows.append(
                [
                    bucket,
                    name,
                    t.get("verdict"),
                    t.get("time_ms", "—"),
                    t.get("spread_ms", "—"),
                    t.get("error", "—"),
                    t.get("reason") or (m.get("why") if name == m.get("chosen") else "") or "—",
                ]
            )
    return rows


def costs(run: Run, baseline: Run) -> str:
    """Both runs' cost side by side (summary.json's cost)."""
    costs = [r.summary.get("cost") if isinstance(r.summary.get("cost"), dict) else {} for r in (baseline, run)]
    if not any(costs):
        return ""
    keys = ("usd", "usd_per_million_tokens", "usd_per_million_documents", "price_per_hour", "hours", "workers")
    return "<h3>Cost</h3>" + table(
        ["what", "baseline", "current"], [[k, costs[0].get(k, "—"), costs[1].get(k, "—")] for k in keys]
    )

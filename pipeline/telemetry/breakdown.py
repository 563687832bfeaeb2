"""Where a run's time went, for summary.json's ``startup`` and ``stages``: from the process's start to the
first batch (plan, lock and checks, Beam graph, then the encoder's checkpoint, probes and compilations),
the steady state after the first batch, and each stage's share of the pipeline's wall time.

The driver adds both after a run it waited for: they combine its own clock (``marks``), the Beam metrics
the workers reported (pipeline/telemetry/observe.py, pipeline/stages/encode.py) and the timing records.
"""

from __future__ import annotations

import datetime

from docbeam.pipeline.telemetry.observe import (
    COMPILE_MS,
    STAGE_US,
    STAGES,
    STARTUP_MS,
    STARTUP_PARTS,
    labelled,
    shape_label,
)

# The driver's marks (epoch seconds), in the order the driver passes them.
MARKS = ("process", "run_job", "plan", "checks", "graph", "pipeline", "finished")


def _epoch(iso: str) -> float:
    return datetime.datetime.fromisoformat(iso).timestamp()


def startup_breakdown(marks: dict[str, float], timing: list[dict], metrics: dict) -> dict:
    """Seconds of each start-up step, and seconds from the process's start (``since_start``) to the end of
    the driver's steps and to the first batch; the encoder's own costs as the workers reported them
    (the slowest worker's, since they load in parallel); then the steady state."""
    missing = [m for m in MARKS if m not in marks]
    if missing:
        raise ValueError(f"startup_breakdown: marks {missing} missing; expected {MARKS}")
    t0 = marks["process"]
    steps = {
        "imports": marks["run_job"] - t0,
        "plan": marks["plan"] - marks["run_job"],
        "lock_and_checks": marks["checks"] - marks["plan"],
        "graph": marks["graph"] - marks["checks"],
    }
    distributions = metrics.get("distributions", {})
    startup = labelled(distributions, STARTUP_MS)
    encoder = {part: startup[part]["max"] / 1e3 for part in STARTUP_PARTS if part in startup}
    compiles = {shape: d["max"] / 1e3 for shape, d in sorted(labelled(distributions, COMPILE_MS).items())}
    batches = sorted(timing, key=lambda t: _epoch(t["started_at"]))
    # Shapes that compiled at their first batch rather than ahead.
    compiles |= {
        shape_label(t["rows"], t["bucket_len"], t["attention_backend"]) + " (at its batch)": t["compile_ms"] / 1e3
        for t in batches
        if t["compiled"]
    }
    since_start = {"plan_done": marks["plan"] - t0, "pipeline_started": marks["pipeline"] - t0}
    steady = None
    if batches:
        first = batches[0]
        first_start = _epoch(first["started_at"])
        first_end = first_start + first["total_ms"] / 1e3
        since_start |= {"first_batch_started": first_start - t0, "first_batch_done": first_end - t0}
        rest = batches[1:]
        last_end = max((_epoch(t["started_at"]) + t["total_ms"] / 1e3 for t in rest), default=first_end)
        tokens = sum(t["real_tokens"] for t in rest)
        span = last_end - first_end
        steady = {
            "batches": len(rest),
            "seconds": round(span, 3),
            "encode_seconds": round(sum(t["total_ms"] for t in rest) / 1e3, 3),
            "real_tokens": tokens,
            "tokens_per_second": round(tokens / span, 1) if span > 0 else None,
        }
    rounded = {k: round(v, 3) for k, v in steps.items()}
    return {
        "steps_s": rounded,
        "encoder_s": {k: round(v, 3) for k, v in encoder.items()},
        "compiles_s": {k: round(v, 3) for k, v in compiles.items()},
        "since_process_start_s": {k: round(v, 3) for k, v in since_start.items()},
        "steady_state": steady,
    }


def stage_shares(metrics: dict, wall_seconds: float) -> dict:
    """Seconds inside each stage's own code and its share of the pipeline's wall time; ``other`` is the
    rest (Beam's bucketing, grouping, sinks and hand-overs). With several workers the stages run side by
    side, so the shares may add up to more than 1."""
    counters = metrics.get("counters", {})
    spent_us = labelled(counters, STAGE_US)
    seconds = {stage: spent_us.get(stage, 0) / 1e6 for stage in STAGES}
    wall = max(wall_seconds, 1e-9)
    shares = {stage: round(s / wall, 4) for stage, s in seconds.items()}
    shares["other"] = round(max(0.0, 1 - sum(seconds.values()) / wall), 4)
    return {
        "wall_s": round(wall_seconds, 3),
        # to the microsecond, as counted: a stage of a small run can take under a millisecond
        "seconds": {k: round(v, 6) for k, v in seconds.items()},
        "share_of_wall": shares,
    }

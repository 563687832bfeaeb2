"""The sinks in the job's graph (their registry, checks and steps after the commit: pipeline/sinks/): ``sink_files``,
the active sinks' files, written into the staging folder so they are committed with the run or not at all."""

from __future__ import annotations

import apache_beam as beam

from docbeam.pipeline.sinks import active
from docbeam.pipeline.sinks.removed import RemovedIds


def sink_files(plan, staging: str, run_id: str, read, encoded, reused) -> tuple:
    """Every active sink's files, for the commit to wait on; the removed ids computed once for those needing them."""
    on = active(plan.config)
    if not on:
        return ()
    rows = (encoded, reused) | "SinkRows" >> beam.Flatten()
    removed = None
    if plan.reuse.source is not None and any(sink.needs_removed for sink, _ in on):
        removed = {
            "documents": read["documents"],
            "rejected": read["rejected"],
        } | "RemovedIds" >> RemovedIds(plan.reuse.source.files)
    return tuple(f for sink, section in on for f in sink.files(section, rows, removed, staging, run_id, plan))

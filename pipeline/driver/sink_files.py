"""The sinks in the job's graph (their registry, checks and steps after the commit: pipeline/sinks/): the curating
sinks' marks first, then every active sink's files, written into the staging folder so they are committed with the
run or not at all."""

from __future__ import annotations

import dataclasses

import apache_beam as beam

from docbeam.pipeline.sinks import SinkInputs, active
from docbeam.pipeline.sinks.removed import RemovedIds


@dataclasses.dataclass(frozen=True)
class SinkOutputs:
    """The sinks' part of the graph: ``written`` (file-name PCollections for the commit), ``stats`` (dict
    PCollections summed into the run's statistics) and ``marked`` ((id, kind) of marked documents, or None)."""

    written: tuple = ()
    stats: tuple = ()
    marked: object = None


def sink_files(plan, staging: str, run_id: str, read, encoded, reused) -> SinkOutputs:
    """Every active sink's files, for the commit to wait on; the removed ids computed once for those needing them,
    the curating sinks' marks (output.select and every sink read them) before the others' files."""
    on = active(plan.config)
    if not on:
        return SinkOutputs()
    rows = (encoded, reused) | "SinkRows" >> beam.Flatten()
    removed = None
    if plan.reuse.source is not None and any(sink.needs_removed for sink, _ in on):
        removed = {
            "documents": read["documents"],
            "rejected": read["rejected"],
        } | "RemovedIds" >> RemovedIds(plan.reuse.source.files)
    inputs = SinkInputs(rows=rows, documents=read["documents"], removed=removed)
    curated = [c for sink, section in on if (c := sink.curate(section, inputs, staging, run_id, plan)) is not None]
    if curated:
        marked = tuple(c.marked for c in curated)
        inputs = dataclasses.replace(
            inputs, marked=marked[0] if len(marked) == 1 else marked | "AllMarked" >> beam.Flatten()
        )
    files = tuple(f for sink, section in on for f in sink.files(section, inputs, staging, run_id, plan))
    return SinkOutputs(
        written=tuple(w for c in curated for w in c.written) + files,
        stats=tuple(c.stats for c in curated),
        marked=inputs.marked,
    )

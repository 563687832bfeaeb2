"""selected/ (pipeline/stages/select_documents.py), written beside the head's rows into the run's staging folder for the
commit to wait on (the sinks' files: pipeline/driver/sink_files.py)."""

from __future__ import annotations

import apache_beam as beam

from docbeam.pipeline import sinks
from docbeam.pipeline.driver.plan import JobPlan
from docbeam.pipeline.stages.select_documents import SelectDocuments


def select_documents(plan: JobPlan, staging: str, run_id: str, read, encoded, reused, marked=None) -> dict:
    """selected/ (output.select): ``{"written": (its files,), "selected": the selected ids}``; {} without it.
    ``marked``: (id, kind) of the documents a curating sink marked, read as the columns it declares
    (pipeline/sinks/registry.py: Sink.select_columns, Sink.mark_values)."""
    select = plan.config.output.select
    if select is None:
        return {}
    rows = (encoded, reused) | "SelectableRows" >> beam.Flatten()
    if marked is not None:
        curating = tuple(sink for sink, _ in sinks.active(plan.config) if sink.select_columns)
        rows = (
            {"row": rows | "KeyRows" >> beam.Map(lambda r: (r["id"], r)), "marked": marked}
            | "JoinMarks" >> beam.CoGroupByKey()
            | "WithMarks" >> beam.FlatMap(with_marks, curating)
        )
    selected = {"rows": rows, "documents": read["documents"]} | "SelectDocuments" >> SelectDocuments(
        staging,
        run_id,
        select.where,
        labels=tuple(plan.head.labels),
        with_text=select.with_text,
        num_shards=plan.config.output.num_shards,
        json_fields=tuple(c.name for c in plan.kept.columns if c.arrow is None),
    )
    return {"written": (selected["written"],), "selected": selected["selected"]}


def with_marks(item, curating: tuple):
    """``(id, {"row": [row], "marked": [kind, ...]})`` → the row with each curating sink's columns, as it declares
    their values (Sink.mark_values)."""
    _, grouped = item
    kinds = sorted(grouped["marked"])
    values = {k: v for sink in curating for k, v in sink.mark_values(kinds).items()}
    for row in grouped["row"]:
        yield {**row, **values}

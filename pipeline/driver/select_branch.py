"""selected/ (pipeline/stages/select_documents.py), written beside the head's rows into the run's staging folder for the
commit to wait on (the sinks' files: pipeline/driver/sink_files.py)."""

from __future__ import annotations

import apache_beam as beam

from docbeam.pipeline.driver.plan import JobPlan
from docbeam.pipeline.stages.select_documents import SelectDocuments


def select_documents(plan: JobPlan, staging: str, run_id: str, read, encoded, reused) -> dict:
    """selected/ (output.select): ``{"written": (its files,), "selected": the selected ids}``; {} without it."""
    select = plan.config.output.select
    if select is None:
        return {}
    rows = (encoded, reused) | "SelectableRows" >> beam.Flatten()
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

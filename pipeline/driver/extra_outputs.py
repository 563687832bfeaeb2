"""The outputs a run writes beside the head's rows, each into the run's staging folder for the commit to wait
on: the sinks' files (pipeline/stages/sinks.py) and selected/ (pipeline/stages/selected.py)."""
from __future__ import annotations

import apache_beam as beam

from docbeam.pipeline.driver.plan import JobPlan
from docbeam.pipeline.stages.selected import SelectDocuments
from docbeam.pipeline.stages.sinks import RemovedIds, WriteSinks


def sink_files(plan: JobPlan, staging: str, run_id: str, read, encoded, reused) -> tuple:
    """The files of the sinks beside Parquet (pipeline/stages/sinks.py), for the commit to wait on."""
    out = plan.config.output
    if out.vertex_ai is None and out.pgvector is None:
        return ()
    inputs = {"embeddings": (encoded, reused) | "SinkEmbeddings" >> beam.Flatten()}
    if plan.reuse.source is not None:
        inputs["removed"] = ({"documents": read["documents"], "rejected": read["rejected"]}
                             | "RemovedIds" >> RemovedIds(plan.reuse.source.files))
    restricts = out.vertex_ai.restricts if out.vertex_ai is not None else None
    return (inputs
            | "WriteSinks" >> WriteSinks(staging, run_id, restricts, out.pgvector is not None, out.num_shards,
                                         json_fields=tuple(c.name for c in plan.kept.columns if c.arrow is None)))


def select_documents(plan: JobPlan, staging: str, run_id: str, read, encoded, reused) -> dict:
    """selected/ (output.select): ``{"written": (its files,), "selected": the selected ids}``; {} without it."""
    select = plan.config.output.select
    if select is None:
        return {}
    rows = (encoded, reused) | "SelectableRows" >> beam.Flatten()
    selected = ({"rows": rows, "documents": read["documents"]}
                | "SelectDocuments" >> SelectDocuments(staging, run_id, select.where,
                                                       labels=tuple(getattr(plan.head, "labels", ())),
                                                       with_text=select.with_text,
                                                       num_shards=plan.config.output.num_shards))
    return {"written": (selected["written"],), "selected": selected["selected"]}

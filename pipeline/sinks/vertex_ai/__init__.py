"""output.vertex_ai: Vertex AI Vector Search's batch layout beside Parquet (``vertex_ai/``, and ``vertex_ai/delete/``
for the ids an incremental run removed), written into the staging folder so it is committed with the run or not
at all (the writer: writer.py). ``true`` in YAML turns it on without restricts."""

from __future__ import annotations

import pydantic

from docbeam.errors import ConfigError
from docbeam.pipeline.sinks.registry import Sink, SinkSection, float_vectors, needs_marks, register

VERTEX_VECTORS = {"embedding", "sparse_embedding"}  # the row columns a Vector Search datapoint carries


class VertexAIConfig(SinkSection):
    """Vector Search's batch layout beside Parquet; ``true`` in YAML is this with no restricts."""

    restricts: tuple[str, ...] = ()  # kept fields whose values become `restricts` (namespace = field name)
    # only the documents output.dedup kept: a marked one is left out, and deleted from the index if it was there
    skip_duplicates: bool = pydantic.Field(False, strict=True)

    @classmethod
    def from_yaml(cls, value):
        return {} if value is True else None if value is False else value

    def fits(self, job) -> None:
        """Restricts name kept fields, and vectors are floats: checked with the config (the head's part at plan)."""
        float_vectors("vertex_ai", job.output.vector_dtype)
        if self.skip_duplicates:
            needs_marks("vertex_ai", job.output)
        if job.input.keep_fields != "*":
            missing = [f for f in self.restricts if f not in job.input.keep_fields]
            if missing:
                raise ValueError(
                    f"output.vertex_ai.restricts names {missing}, which input.keep_fields "
                    f"{list(job.input.keep_fields)} does not keep; add them to input.keep_fields"
                )


def check_head(head) -> None:
    """What Vector Search takes of the head's rows: a dense or a sparse vector per document (the one place this
    sink reads the head)."""
    if not {c.name for c in head.columns()} & VERTEX_VECTORS:
        raise ConfigError(
            f"output.vertex_ai: model.head resolved to {head.name} ({head.carried}), whose "
            f"{head.folder}/ rows hold neither embedding nor sparse_embedding, and Vector Search loads "
            "vectors, a dense or a sparse one per document; remove output.vertex_ai, or set "
            "model.head: embedding or sparse"
        )


@register("vertex_ai")
class VertexAI(Sink):
    section = VertexAIConfig
    needs_removed = True

    def check(self, cfg, head, kept) -> None:
        """At plan, against the resolved head and the typed kept fields (the section's ``fits`` ran with the config)."""
        check_head(head)
        # With keep_fields "*" the kept fields are known once the sample is typed (a dry run has none yet).
        names = {c.name for c in kept.columns}
        missing = [f for f in cfg.output.vertex_ai.restricts if f not in names]
        if cfg.input.keep_fields == "*" and kept.columns and missing:
            raise ConfigError(
                f"output.vertex_ai.restricts names {missing}, which no sampled document of the input has "
                f'(input.keep_fields: "*" keeps {sorted(names)}); check the spelling'
            )

    def files(self, section, inputs, staging: str, run_id: str, plan) -> tuple:
        from docbeam.pipeline.sinks.vertex_ai.writer import WriteVertexAI  # Beam's: once the graph is built

        json_fields = tuple(c.name for c in plan.kept.columns if c.arrow is None)
        rows, removed = inputs.rows, inputs.removed
        if section.skip_duplicates and inputs.marked is not None:
            rows, removed = without_marked(rows, removed, inputs.marked)
        return {
            "rows": rows,
            **({"removed": removed} if removed is not None else {}),
        } | "WriteVertexAI" >> WriteVertexAI(
            staging, run_id, section.restricts, plan.config.output.num_shards, json_fields
        )


def without_marked(rows, removed, marked):
    """The rows no curating sink marked, and the removed ids with the marked ones added: a document loaded by an
    earlier run and marked today leaves the index."""
    import apache_beam as beam

    joined = {
        "row": rows | "VertexKeyRows" >> beam.Map(lambda r: (r["id"], r)),
        "marked": marked,
    } | "VertexJoinMarks" >> beam.CoGroupByKey()
    kept = joined | "VertexUnmarked" >> beam.FlatMap(lambda item: [] if list(item[1]["marked"]) else item[1]["row"])
    marked_ids = marked | "VertexMarkedIds" >> beam.Map(lambda m: m[0])
    gone = marked_ids if removed is None else (removed, marked_ids) | "VertexRemovedOrMarked" >> beam.Flatten()
    return kept, gone

"""The sinks beside the head's rows, one registry: each names its typed section of ``output`` (config_io.py), what
it refuses at start, the files it adds to the run's commit, and an optional step after the commit.

The driver asks only this registry (``active``): the plan runs every active sink's ``check``, ``run`` its
``preflight`` before anything is touched, the graph its ``files`` (written into the staging folder, so they are
committed with the run or not at all), and after the commit its ``after_commit``, whose record summary.json keeps
under the sink's key. Adding a sink is its section in config_io.py, its writer or loader, and one entry here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import apache_beam as beam

from docbeam.config import ConfigError, JobConfig
from docbeam.pipeline.stages import sinks as sink_writers
from docbeam.pipeline.store import pgvector


@dataclasses.dataclass(frozen=True)
class Sink:
    key: str  # its section, output.<key>
    check: Callable[[JobConfig, Any, Any], None]  # (config, head, kept fields): refuse at start, naming the key
    files: Callable[..., tuple]  # (section, rows, removed, staging, run_id, plan) → PCollections of file names
    needs_removed: bool = False  # it is handed the ids an incremental run removed
    preflight: Callable[[Any, bool], None] = lambda section, wait: None  # (section, the driver waits)
    after_commit: Callable[[str, dict, Any], dict] | None = None  # (output, manifest, section) → its record


SINKS: dict[str, Sink] = {}


def register(sink: Sink) -> Sink:
    if sink.key in SINKS:
        raise ValueError(f"a sink named {sink.key!r} is registered already")
    SINKS[sink.key] = sink
    return sink


def active(cfg) -> list[tuple[Sink, Any]]:
    """(sink, its typed section) for every sink the job's output section turns on, in registry order."""
    output = getattr(cfg, "output", None)
    return [
        (sink, getattr(output, key))
        for key, sink in SINKS.items()
        if output is not None and getattr(output, key) is not None
    ]


VERTEX_VECTORS = {"embedding", "sparse_embedding"}  # the row columns a Vector Search datapoint carries


def _check_vertex_ai(cfg: JobConfig, head, kept) -> None:
    """At plan, against the resolved head and the typed kept fields (the section's ``fits`` ran with the config)."""
    if not {c.name for c in head.columns()} & VERTEX_VECTORS:
        raise ConfigError(
            f"output.vertex_ai: model.head resolved to {head.name} ({head.carried}), whose "
            f"{head.folder}/ rows hold neither embedding nor sparse_embedding, and Vector Search loads "
            "vectors, a dense or a sparse one per document; remove output.vertex_ai, or set "
            "model.head: embedding or sparse"
        )
    # With keep_fields "*" the kept fields are known once the sample is typed (a dry run has none yet).
    names = {c.name for c in kept.columns}
    missing = [f for f in cfg.output.vertex_ai.restricts if f not in names]
    if cfg.input.keep_fields == "*" and kept.columns and missing:
        raise ConfigError(
            f"output.vertex_ai.restricts names {missing}, which no sampled document of the input has "
            f'(input.keep_fields: "*" keeps {sorted(names)}); check the spelling'
        )


def _vertex_files(section, rows, removed, staging: str, run_id: str, plan) -> tuple:
    json_fields = tuple(c.name for c in plan.kept.columns if c.arrow is None)
    return {
        "rows": rows,
        **({"removed": removed} if removed is not None else {}),
    } | "WriteVertexAI" >> sink_writers.WriteVertexAI(
        staging, run_id, section.restricts, plan.config.output.num_shards, json_fields
    )


def _pgvector_load(output: str, manifest: dict, section) -> dict:
    return pgvector.load_committed(output, manifest, section.dsn, section.table)


def _check_pgvector(cfg: JobConfig, head, kept) -> None:
    if head.name == "multi_vector":  # its loader writes a vector or a score per row, not a list of vectors
        raise ConfigError(
            f"output.pgvector: model.head resolved to multi_vector, whose {head.folder}/ rows hold a "
            "list of token vectors per document, which the pgvector sink does not load; remove "
            "output.pgvector"
        )


register(Sink("vertex_ai", _check_vertex_ai, _vertex_files, needs_removed=True))
# pgvector adds no files: its load sweeps the output's rows that the committed run no longer holds.
register(
    Sink(
        "pgvector",
        _check_pgvector,
        lambda *inputs: (),
        preflight=lambda section, wait: pgvector.check_can_load(wait),
        after_commit=_pgvector_load,
    )
)


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
        } | "RemovedIds" >> sink_writers.RemovedIds(plan.reuse.source.files)
    return tuple(f for sink, section in on for f in sink.files(section, rows, removed, staging, run_id, plan))

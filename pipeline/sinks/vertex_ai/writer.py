"""Vertex AI Vector Search's batch layout beside Parquet, and the ids an incremental run removed.

Written through Beam sinks into the run's staging folder, like embeddings/, so they are committed with the run
(listed in its manifest) or not at all. Vector Search reads a batch root of ``*.json`` files of JSON lines
(``{"id", "embedding", "sparse_embedding", "restricts"}``) and a ``delete/`` folder beside them, one id a line; docbeam's batch root
is the output's ``vertex_ai/``.

The removed ids (pipeline/sinks/removed.py, a rejected document's id never among them) go to ``delete/``; an
id holding a line break is never written there (it would read back as two ids): its datapoint stays.
"""

from __future__ import annotations

import json

import apache_beam as beam
import numpy as np

from docbeam.pipeline.store.output import part_prefix

# Vector Search's batch root in the output, whose ``delete/`` lists the ids an incremental run removed.
VERTEX_AI = "vertex_ai"
VERTEX_DELETE = "vertex_ai/delete"


def restrict_values(value) -> list[str]:
    """A kept field's value as Vector Search's ``allow`` strings: a list gives one token per element, a string
    itself, any other JSON value its JSON spelling (``true``, ``3``); null or an empty list gives none."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    return [v if isinstance(v, str) else json.dumps(v, sort_keys=True) for v in values if v is not None]


def vertex_record(row: dict, restricts: tuple[str, ...], json_fields: tuple[str, ...] = ()) -> dict:
    """One JSON line of Vector Search's input: the id, the vector (each float32 in its shortest decimal
    spelling, which reads back as the same float32) and a restrict per chosen field that has a value.
    A row's columns decide its vectors, not its head's name: ``embedding`` gives the dense one,
    ``sparse_embedding`` the sparse one (``{"values", "dimensions"}``), a row with both a hybrid datapoint.
    ``json_fields``: kept fields whose column holds JSON text (pipeline/stages/keep.py), read as that JSON."""

    def value(field):
        raw = row.get(field)
        return json.loads(raw) if field in json_fields and raw is not None else raw

    record = {"id": row["id"]}
    if row.get("embedding") is not None:
        record["embedding"] = shortest_floats(row["embedding"])
    if row.get("sparse_embedding") is not None:
        sparse = row["sparse_embedding"]
        record["sparse_embedding"] = {
            "values": shortest_floats(sparse["values"]),
            "dimensions": [int(i) for i in sparse["indices"]],
        }
    namespaces = [{"namespace": f, "allow": restrict_values(value(f))} for f in restricts]
    namespaces = [n for n in namespaces if n["allow"]]
    if namespaces:
        record["restricts"] = namespaces
    return record


def shortest_floats(values) -> list[float]:
    """float32 values in their shortest decimal spelling, which reads back as the same float32."""
    return [float(str(x)) for x in np.asarray(values, np.float32)]


LINE_BREAKS = ("\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


def one_line(doc_id: str) -> bool:
    """Whether an id can be one line of a delete list: any line break in it (what ``splitlines`` splits on) would
    make it two ids, each deleting another document."""
    return not any(c in doc_id for c in LINE_BREAKS)


def write_ids(staging_path: str, run_id: str, folder: str, num_shards: int = 0) -> beam.io.WriteToText:
    """One id a line into ``folder`` of the run's staging folder (``vertex_ai/delete/``)."""
    return beam.io.WriteToText(
        part_prefix(staging_path.rstrip("/"), folder, run_id), file_name_suffix=".txt", num_shards=num_shards
    )


class WriteVertexAI(beam.PTransform):
    """Input ``{"rows": the run's document rows, "removed": ids (an incremental run) or None}``; output: the
    written files' names (a tuple of PCollections): Vector Search's batch root under ``vertex_ai/`` and, for the
    removed ids, its ``delete/`` folder."""

    def __init__(
        self,
        staging_path: str,
        run_id: str,
        restricts: tuple[str, ...],
        num_shards: int = 0,
        json_fields: tuple[str, ...] = (),
    ):
        super().__init__()
        self._out, self._run_id, self._shards = staging_path.rstrip("/"), run_id, num_shards
        self._restricts, self._json_fields = restricts, json_fields

    def expand(self, inputs):
        restricts, json_fields = self._restricts, self._json_fields
        written = [
            inputs["rows"]
            | "VertexJson" >> beam.Map(lambda r: json.dumps(vertex_record(r, restricts, json_fields)))
            | "WriteVertexJson"
            >> beam.io.WriteToText(
                part_prefix(self._out, VERTEX_AI, self._run_id), file_name_suffix=".json", num_shards=self._shards
            )
        ]
        if inputs.get("removed") is not None:  # an id with a line break stays in the index (never a wrong delete)
            written.append(
                inputs["removed"]
                | "OneLineIds" >> beam.Filter(one_line)
                | "WriteVertexDelete" >> write_ids(self._out, self._run_id, VERTEX_DELETE, self._shards)
            )
        return tuple(written)

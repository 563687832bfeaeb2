"""SelectDocuments: ``selected/``, the documents whose row meets ``output.select.where`` (a curation job's kept
set), one JSON line each (``{"id"}``, with ``"text"`` under ``with_text``), written through a Beam sink into the
run's staging folder and committed with it or not at all."""

from __future__ import annotations

import json

import apache_beam as beam

from docbeam.pipeline.store.output import SELECTED, part_prefix
from docbeam.selection import evaluate, parse


def _meets(row: dict, tree: tuple, labels: tuple[str, ...], json_fields: tuple[str, ...] = ()) -> bool:
    """A kept field written as JSON text (its sampled values had no one Arrow type) is compared as the value the text
    holds, not as the text: ``lang == en`` meets the row whose lang is ``"en"``, written ``'"en"'``."""
    if json_fields:
        row = {**row, **{name: _decoded(row.get(name)) for name in json_fields}}
    return evaluate(tree, row, labels)


def _decoded(text):
    try:
        return json.loads(text) if isinstance(text, str) else text
    except (ValueError, RecursionError):
        return None


def _line(item) -> list[str]:
    """From ``(id, {"selected": [...], "text": [...]})``: the selected document's line with its text."""
    doc_id, grouped = item
    if not list(grouped["selected"]):
        return []
    (text,) = list(grouped["text"])[:1] or [None]
    return [json.dumps({"id": doc_id, "text": text}, ensure_ascii=False)]


class SelectDocuments(beam.PTransform):
    """Input ``{"rows": the head's rows (encoded and reused), "documents": Documents (read only with_text)}``;
    outputs ``written`` (the files) and ``selected`` (one element per selected document, for the count)."""

    def __init__(
        self,
        staging_path: str,
        run_id: str,
        where: str,
        *,
        labels: tuple[str, ...] = (),
        with_text: bool = False,
        num_shards: int = 0,
        json_fields: tuple[str, ...] = (),
    ):
        super().__init__()
        self._out, self._run_id, self._shards = staging_path.rstrip("/"), run_id, num_shards
        self._tree, self._labels, self._with_text = parse(where), labels, with_text
        self._json_fields = json_fields

    def expand(self, inputs):
        selected = inputs["rows"] | "Where" >> beam.Filter(_meets, self._tree, self._labels, self._json_fields)
        ids = selected | "SelectedIds" >> beam.Map(lambda row: row["id"])
        if self._with_text:
            texts = inputs["documents"] | "Texts" >> beam.Map(lambda d: (d.id, d.text))
            lines = (
                {"selected": ids | "KeyIds" >> beam.Map(lambda i: (i, None)), "text": texts}
                | "JoinTexts" >> beam.CoGroupByKey()
                | "WithText" >> beam.FlatMap(_line)
            )
        else:
            lines = ids | "IdLines" >> beam.Map(lambda i: json.dumps({"id": i}, ensure_ascii=False))
        written = lines | "WriteSelected" >> beam.io.WriteToText(
            part_prefix(self._out, SELECTED, self._run_id), file_name_suffix=".jsonl", num_shards=self._shards
        )
        return {"written": written, "selected": ids}

"""The ids an incremental run removed, for the sinks that delete them (a sink's ``needs_removed``): the ids of
the reuse source (``input.reuse_from``) that this run did not read at all. A document read but rejected this run
is not removed: its previous vector stays where it was loaded until a later run embeds it or it leaves the input,
since a rejection (a line too long, a non-finite vector) says nothing about whether the document still exists; a
run that rejected a record without an id removes nothing at all."""

from __future__ import annotations

import apache_beam as beam


def removed_ids(item, unnamed_rejections: int = 0) -> list[str]:
    """From ``(id, {"previous": [...], "present": [...]})``: the id when the source had it and this run read
    nothing under it. None at all when the run rejected a record without an id (a malformed line, one too long):
    that record may be any of the documents, and a removal is never a guess."""
    doc_id, grouped = item
    return [doc_id] if list(grouped["previous"]) and not list(grouped["present"]) and not unnamed_rejections else []


class RemovedIds(beam.PTransform):
    """Input ``{"documents": Documents read, "rejected": Rejected records}``; output: the ids of the source run's
    embeddings files (``previous_files``) that no document of this run carries, each once."""

    def __init__(self, previous_files: tuple[str, ...]):
        super().__init__()
        self._files = previous_files

    def expand(self, inputs):
        from apache_beam.io.parquetio import ReadAllFromParquet

        previous = (
            inputs["documents"].pipeline
            | "PreviousIdFiles" >> beam.Create(self._files)
            | "ReadPreviousIds" >> ReadAllFromParquet(columns=["id"])
            | "KeyPreviousIds" >> beam.Map(lambda row: (row["id"], None))
        )
        present = (
            (
                inputs["documents"] | "ReadIds" >> beam.Map(lambda d: d.id),
                inputs["rejected"] | "RejectedIds" >> beam.FlatMap(lambda r: [r.id] if r.id is not None else []),
            )
            | "PresentIds" >> beam.Flatten()
            | "KeyPresentIds" >> beam.Map(lambda i: (i, None))
        )
        unnamed = (
            inputs["rejected"]
            | "UnnamedRejections" >> beam.Filter(lambda r: r.id is None)
            | "CountUnnamed" >> beam.combiners.Count.Globally()
        )
        return (
            {"previous": previous, "present": present}
            | "JoinIds" >> beam.CoGroupByKey()
            | "Removed" >> beam.FlatMap(removed_ids, beam.pvalue.AsSingleton(unnamed))
        )

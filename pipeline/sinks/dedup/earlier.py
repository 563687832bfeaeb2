"""What output.dedup reads of committed runs: the earlier run's ``dedup_index/`` an incremental run compares against,
and a run's marked ids (``duplicates/``) for the sinks asked to ``skip_duplicates``."""

from __future__ import annotations

import logging

from docbeam.pipeline.sinks.dedup.settings import DUPLICATES, INDEX
from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage

log = logging.getLogger(__name__)


class EarlierIndex:
    """The earlier run's ``dedup_index/`` files this run deduplicates against, or why there are none."""

    def __init__(self, run_id: str | None, files: tuple[str, ...], reason: str):
        self.run_id, self.files, self.reason = run_id, files, reason

    def describe(self) -> dict:
        return {"run_id": self.run_id, "files": len(self.files), "reason": self.reason}


def earlier_index(plan) -> EarlierIndex:
    """Read only where the run reuses an earlier output (its vectors are this model's): that run's index, its
    files held to the sizes and checksums its manifest lists."""
    source = plan.reuse.source
    if source is None:
        return EarlierIndex(None, (), "input.reuse_from is not set or not reused: deduplicated within this run")
    try:
        manifest = output_lib.read_manifest(source.path)
    except (output_lib.OutputRefused, ValueError) as e:
        return EarlierIndex(None, (), f"{source.path}: its manifest cannot be read ({e})")
    if manifest is None or manifest["run_id"] != source.run_id:
        return EarlierIndex(None, (), f"{source.path} no longer holds run {source.run_id}")
    files = tuple(
        storage.join(source.path, f["path"]) for f in manifest["files"] if output_lib.in_folder(f["path"], INDEX)
    )
    if not files:
        return EarlierIndex(source.run_id, (), f"run {source.run_id} was not deduplicated (no {INDEX}/)")
    problem = output_lib.damaged(source.path, manifest, INDEX)
    if problem:
        log.warning("output.dedup: not deduplicating against %s: %s", source.path, problem)
        return EarlierIndex(source.run_id, (), f"{source.path}: {problem}")
    return EarlierIndex(source.run_id, files, "")


def marked_ids(output: str, manifest: dict) -> frozenset[str]:
    """The ids a committed run's duplicates/ marks (none when it was not deduplicated): what a sink asked to
    ``skip_duplicates`` leaves out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids: set[str] = set()
    for f in manifest["files"]:
        if output_lib.in_folder(f["path"], DUPLICATES):
            data = storage.read_bytes(storage.join(output, f["path"]))
            ids.update(pq.read_table(pa.BufferReader(data), columns=["id"]).column("id").to_pylist())
    return frozenset(ids)

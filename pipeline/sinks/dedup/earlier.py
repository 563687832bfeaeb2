"""What output.dedup reads of committed runs: the earlier run's ``dedup_index/`` an incremental run compares against,
and a run's marked ids (``duplicates/``) for the sinks asked to ``skip_duplicates``."""

from __future__ import annotations

import dataclasses
import json
import logging

from docbeam.pipeline.sinks.dedup.settings import DUPLICATES, INDEX
from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EarlierIndex:
    """The earlier run's ``dedup_index/`` files this run deduplicates against (none: ``reason`` says why), and
    whether its vectors are this run's model's (its reuse key is this run's)."""

    run_id: str | None
    files: tuple[str, ...]
    reason: str
    vectors: bool = False

    def describe(self) -> dict:
        return {"run_id": self.run_id, "files": len(self.files), "vectors": self.vectors, "reason": self.reason}


_CHECKED: dict[tuple[str, str], EarlierIndex] = {}  # (folder, run id) → its index, checked once per process


def earlier_index(plan) -> EarlierIndex:
    """``input.reuse_from``'s index, on checks of its own (the manifest, and its files' sizes and checksums), so a
    run whose vectors are not reused (another model, ``output.granularity: both``, a damaged embeddings file)
    still compares exact keys and signatures, which no model changes; its vectors only where its reuse key is
    this run's. Checked once per process and run (the plan's summary and the graph ask for it)."""
    path = plan.config.input.reuse_from
    if not path:
        return EarlierIndex(None, (), "input.reuse_from is not set: deduplicated within this run")
    try:
        manifest = output_lib.read_manifest(path)
    except (output_lib.OutputRefused, ValueError) as e:
        return EarlierIndex(None, (), f"{path}: its manifest cannot be read ({e})")
    if manifest is None:
        return EarlierIndex(None, (), f"{path} holds no committed run")
    key = (path, manifest["run_id"])
    if key not in _CHECKED:
        _CHECKED[key] = _checked(path, manifest, plan.reuse_key)
    return _CHECKED[key]


def _checked(path: str, manifest: dict, reuse_key: dict) -> EarlierIndex:
    run_id = manifest["run_id"]
    files = tuple(storage.join(path, f["path"]) for f in manifest["files"] if output_lib.in_folder(f["path"], INDEX))
    if not files:
        return EarlierIndex(
            run_id, (), f"run {run_id} was not deduplicated (no {INDEX}/): deduplicated within this run"
        )
    problem = output_lib.damaged(path, manifest, INDEX)
    if problem:
        log.warning("output.dedup: not deduplicating against %s: %s", path, problem)
        return EarlierIndex(run_id, (), f"{path}: {problem}")
    vectors = manifest.get("reuse_key") == json.loads(json.dumps(reuse_key))  # as the manifest wrote it
    reason = "" if vectors else f"run {run_id} used another model or settings: its vectors are not compared"
    return EarlierIndex(run_id, files, reason, vectors)


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

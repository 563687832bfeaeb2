"""What crash_test.py's walks share: a run driven step by step (lock, recover, mark the staging folder, the
sinks' files, commit, release), the folders it writes into, what a folder must hold after a kill, and which
crash points a walk visits."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

from docbeam.pipeline.store import output, storage, transaction
from docbeam.pipeline.store.faults import FaultPlan, injected
from docbeam.pipeline.store.lock import OutputLock

POINTERS = ("_manifest.json", "summary.json", "_SUCCESS")


@dataclasses.dataclass
class Outputs:
    """Fresh output folders, one per crash point, in one place (local disk or the emulator's bucket)."""

    fresh: Callable[[], str]
    sampled: bool  # walk a sample of the points (the emulator's, unless `make test-all`): see walked_points
    _old_run: dict[str, bytes] | None = None

    def __call__(self) -> str:
        return self.fresh()

    def with_old_run(self) -> str:
        """A fresh folder holding the committed run "old": run once, then copied byte for byte (only its
        manifest's ``committed_at`` would differ between two real runs), since on the emulator a run's few
        dozen requests per crash point were most of the walk's time."""
        out = self.fresh()
        if self._old_run is None:
            a_run(out, "old")
            self._old_run = every_file(out)
            assert holds_exactly(out, "old")
            return out
        for rel, data in self._old_run.items():
            _put(storage.join(out, rel), data)
        return out


def run_files(run_id: str) -> dict[str, bytes]:
    return {
        f"embeddings/part-{run_id}-00000-of-00002.parquet": f"rows of {run_id}, shard 0".encode(),
        f"embeddings/part-{run_id}-00001-of-00002.parquet": f"rows of {run_id}, shard 1".encode(),
        f"errors/part-{run_id}-00000-of-00001.jsonl": b"",
        # output.dedup's marks and index (pipeline/sinks/dedup/): committed with the rows they mark, or not at all
        f"duplicates/part-{run_id}-00000-of-00001.parquet": f"marks of {run_id}".encode(),
        f"dedup_index/part-{run_id}-00000-of-00001.parquet": f"index of {run_id}".encode(),
    }


def summary(run_id: str) -> dict:
    return {"run_id": run_id, "docs_embedded": 2}


def start(out: str, run_id: str, **acquire) -> OutputLock:
    """A run's start: take the lock, recover what earlier runs left, mark the staging folder."""
    held = OutputLock.acquire(out, run_id, heartbeat=False, **acquire)
    with held.fence.failing_as_lost():  # as run_job does
        transaction.recover(out, held)
        held.fence.prove()
        output.mark_staging(out, run_id, held.fence.token)
    return held


def finish(out: str, held: OutputLock) -> dict:
    """The sinks' files, then the commit and the release."""
    run_id = held.fence.run_id
    written = [f"{output.staging_dir(out, run_id)}/{rel}" for rel in run_files(run_id)]
    try:
        with held.fence.failing_as_lost():
            for path, data in zip(written, run_files(run_id).values()):
                storage.write_bytes(path, data)
            return transaction.commit(out, held.fence, written, summary(run_id), {})
    finally:
        held.release()


def a_run(out: str, run_id: str, **acquire) -> dict:
    return finish(out, start(out, run_id, **acquire))


def every_file(out: str) -> dict[str, bytes]:
    """Every file under ``out`` with its stored bytes. On gs:// one listing and one plain download per object
    through google-cloud-storage: the same objects Beam's FileSystems would list and read, without the
    GcsIO set-up and metadata request it adds per call (those made the checks most of a walk's time)."""
    if not storage.is_gcs(out):
        return {output.relative(out, p): storage.read_bytes(p) for p in storage.list_files(out)}
    return {output.relative(out, path): blob.download_as_bytes(raw_download=True) for path, blob in _blobs(out)}


def _blobs(out: str) -> list:
    """``(gs:// path, blob)`` for every object under the gs:// folder ``out``, in one listing request."""
    bucket, name = storage.split_gcs(out.rstrip("/"))
    return [(f"gs://{bucket}/{blob.name}", blob) for blob in storage.gcs_client().list_blobs(bucket, prefix=f"{name}/")]


def _put(path: str, data: bytes) -> None:
    """Store ``data`` at ``path`` as a test's set-up: on gs:// one upload request (Beam's writes, which the
    runs under test use, cost a resumable upload's two requests and a GcsIO each); locally the atomic write."""
    if not storage.is_gcs(path):
        storage.write_bytes(path, data)
        return
    storage.gcs_blob(path).upload_from_string(data)


def readers_view(out: str) -> dict[str, bytes]:
    """What a reader sees: everything outside the staging folder, less the lock."""
    return {
        rel: data
        for rel, data in every_file(out).items()
        if not rel.startswith(f"{output.STAGING}/") and rel != output.LOCK
    }


def holds_exactly(out: str, run_id: str, ignore: str | None = None) -> bool:
    """The folder holds run ``run_id`` and nothing else: its bytes, its manifest (with sizes and checksums),
    its summary.json and its _SUCCESS, no staging folder, no lock, no temporary file."""
    files = {rel: data for rel, data in every_file(out).items() if not (ignore and rel.startswith(ignore))}
    if set(files) != set(run_files(run_id)) | set(POINTERS):
        return False
    manifest = json.loads(files["_manifest.json"])
    listed = {f["path"]: (f["size"], f["checksum"]) for f in manifest["files"]}
    return (
        all(files[rel] == data for rel, data in run_files(run_id).items())
        and manifest["run_id"] == run_id
        and listed
        == {rel: (len(data), storage.checksum(storage.join(out, rel))) for rel, data in run_files(run_id).items()}
        and json.loads(files["summary.json"]) == summary(run_id)
        and files["_SUCCESS"] == f"{run_id}\n".encode()
    )


def assert_a_reader_sees_a_whole_run(out: str, old: str, new: str) -> None:
    """Right after a kill, before any recovery: the manifest names the old or the new run and every file it
    lists is there with that run's bytes; summary.json is the new run's only once the manifest is; _SUCCESS
    never names a run whose files are gone."""
    view = readers_view(out)
    committed = json.loads(view["_manifest.json"])["run_id"]
    assert committed in (old, new)
    assert all(view.get(rel) == data for rel, data in run_files(committed).items())
    assert json.loads(view["summary.json"])["run_id"] in ({old, new} if committed == new else {old})
    named = view["_SUCCESS"].decode().strip()
    assert named in (old, new) and all(view.get(rel) == data for rel, data in run_files(named).items())


def changes_of_a_clean_run(new_output: Outputs) -> list[tuple[str, str]]:
    out = new_output.with_old_run()
    with injected(FaultPlan()) as plan:
        a_run(out, "new")
    return [(op, output.relative(out, path)) for op, path in plan.changes]


def step_kind(op: str, rel: str) -> tuple[str, str]:
    """What a change does: its op (write, rename, copy, delete) and what it touches (the lock, the staging
    folder, a pointer file, a data file; a temporary file of one apart)."""
    name, temporary = rel.split(".tmp-")[0], ".tmp-" in rel
    touches = (
        "lock"
        if name == output.LOCK
        else "staging"
        if name.startswith(output.STAGING)
        else "pointer"
        if name in POINTERS
        else "data"
    )
    return op, touches + (" (temporary)" if temporary else "")


def walked_points(changes: list[tuple[str, str]], sampled: bool, must: set[int] = frozenset()) -> list[int]:
    """Every point; or, sampled, the first change of each kind (``step_kind``), so that every kind of step is
    still walked, the last change (the lock's release), and the points ``must`` names (the boundaries a test
    asserts about)."""
    if not sampled:
        return list(range(len(changes)))
    first = {}
    for n, change in enumerate(changes):
        first.setdefault(step_kind(*change), n)
    return sorted({*first.values(), len(changes) - 1, *(n for n in must if 0 <= n < len(changes))})


def clear(out: str) -> None:
    """Keep the emulator's bucket small: it lists by scanning every object."""
    storage.delete_files([path for path, _ in _blobs(out)] if storage.is_gcs(out) else list(storage.list_files(out)))


def holds_exactly_but_staging_of(out: str, run_id: str, overtaken: str) -> bool:
    """``holds_exactly``, but for the overtaken run's staging folder: while that run may live it can still
    write there, so the folder keeps its marker (docbeam's, for the next run to remove)."""
    prefix = f"{output.STAGING}/{overtaken}/"
    rest = {rel for rel in every_file(out) if rel.startswith(prefix)}
    return (not rest or f"{prefix}{output.MARKER}" in rest) and holds_exactly(out, run_id, ignore=prefix)

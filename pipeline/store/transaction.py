"""The fenced commit, and the recovery that finishes or undoes what a dead or overtaken run left.

A commit (1) proves the lock names it, writes its intent (``_staging/<run_id>/_commit.json``: the files the
pipeline wrote, with sizes and checksums, the manifest and summary it will write, the previous run's files
it replaces), (2) moves each file into place, proving the lock before each, (3) passes the commit point:
a conditional write of the lock (state ``committed``) from the version that named this run, (4) writes
``_manifest.json``, ``summary.json`` and ``_SUCCESS``, each only if it is still the version read before
the commit point, and (5) deletes the previous run's files and its own staging folder.

A run that takes the lock over finishes a commit that passed (3) (the lock carries it as ``pending``) and
undoes any other. A run whose lock was taken fails its next proof or conditional write (LockLost, exit 1),
so it changes nothing its successor wrote: whatever it would still move or delete carries its own run id,
or belongs to the run it replaced.
"""

from __future__ import annotations

import datetime
import json
import logging

from docbeam.pipeline.store import storage, versioned
from docbeam.pipeline.store.lock import Fence, LockLost, OutputLock
from docbeam.pipeline.store.output import (
    INTENT,
    INTENT_FORMAT,
    MANIFEST,
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    MARKER,
    STAGING,
    SUCCESS,
    SUMMARY,
    carries_run,
    delete_inside,
    inspect,
    parse_manifest,
    plain_relative,
    read_intent,
    read_manifest,
    relative,
    staging_dir,
)

POINTERS = (MANIFEST, SUMMARY, SUCCESS)
log = logging.getLogger(__name__)


def commit(output: str, fence: Fence, written: list[str], summary: dict, manifest_extra: dict) -> dict:
    """Commit the files the pipeline wrote (``written``: their staged paths) as run ``fence.run_id``."""
    output = output.rstrip("/")
    run_id = fence.run_id
    fence.prove()
    versions = {name: versioned.read_versioned(storage.join(output, name)) for name in POINTERS}
    intent = read_intent(output, run_id)  # a retried commit goes on with the intent it wrote
    if intent is None:
        previous = parse_manifest(versions[MANIFEST][0], storage.join(output, MANIFEST))
        intent = _intent(output, run_id, written, summary, manifest_extra, previous)
        fence.prove()
        storage.write_bytes(f"{staging_dir(output, run_id)}/{INTENT}", json.dumps(intent, indent=1).encode())
    folder = staging_dir(output, run_id)
    for rel in intent["files"]:
        source, target = f"{folder}/{rel}", storage.join(output, rel)
        fence.prove()
        if storage.exists(source) or not storage.exists(target):  # a retried commit may have moved it
            storage.rename(source, target)
    fence.commit_point()
    for name in POINTERS:
        fence.prove()
        if not versioned.write_if(storage.join(output, name), _pointer(intent, name), versions[name][1]):
            raise LockLost(
                f"run {run_id}: {name} changed under its commit (another run took the output over "
                "and finished this commit or its own); leaving the output to it"
            )
    _clean_after(output, intent, keep_marker=False)
    return intent["manifest"]


def _intent(output: str, run_id: str, written: list[str], summary: dict, extra: dict, previous: dict | None) -> dict:
    folder = staging_dir(output, run_id)
    files = sorted({relative(folder, p) for p in written})
    wrong = [rel for rel in files if not (plain_relative(rel) and carries_run(rel, run_id))]
    if wrong:
        raise RuntimeError(f"run {run_id} wrote {wrong[:3]}: not files of its own staging folder {folder}")
    sizes = storage.list_files(folder)
    missing = [rel for rel in files if f"{folder}/{rel}" not in sizes]
    if missing:
        raise RuntimeError(f"run {run_id}: files the pipeline wrote are missing from {folder}: {missing[:3]}")
    entries = [
        {"path": rel, "size": sizes[f"{folder}/{rel}"], "checksum": storage.checksum(f"{folder}/{rel}")}
        for rel in files
    ]
    manifest = {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "run_id": run_id,
        "previous_run_id": previous and previous["run_id"],
        "committed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "files": entries,
        **extra,
    }
    replaces = sorted(f["path"] for f in (previous or {}).get("files", []) if f["path"] not in set(files))
    return {
        "format": INTENT_FORMAT,
        "run_id": run_id,
        "files": files,
        "replaces": replaces,
        "manifest": manifest,
        "summary": summary,
    }


def _pointer(intent: dict, name: str) -> bytes:
    if name == MANIFEST:
        return json.dumps(intent["manifest"], indent=1, sort_keys=True).encode()
    if name == SUMMARY:
        return json.dumps(intent["summary"], indent=2, sort_keys=True).encode()
    return f"{intent['run_id']}\n".encode()


def _clean_after(output: str, intent: dict, keep_marker: bool) -> None:
    """Delete the previous run's files (never one the committed manifest lists) and the staging folder."""
    placed = set(intent["files"])
    replaced = [rel for rel in intent["replaces"] if plain_relative(rel) and rel not in placed]
    delete_inside(output, [storage.join(output, rel) for rel in replaced])
    _delete_staging(output, intent["run_id"], keep_marker)


def _delete_staging(output: str, run_id: str, keep_marker: bool) -> None:
    """A staged run's folder, its intent and then its marker last, so a kill halfway leaves a folder that
    is still recognisably docbeam's."""
    folder = staging_dir(output, run_id)
    present = set(storage.list_files(folder))
    last = [f"{folder}/{INTENT}"] + ([] if keep_marker else [f"{folder}/{MARKER}"])
    delete_inside(output, sorted(present - {f"{folder}/{INTENT}", f"{folder}/{MARKER}"}))
    delete_inside(output, [p for p in last if p in present])
    # Only this run's folder, then _staging/ if that left it empty: an empty folder of the user's under
    # _staging/ is not docbeam's to delete.
    storage.prune_empty_folders(folder)
    storage.remove_folder_if_empty(f"{output}/{STAGING}")


def recover(output: str, lock: OutputLock) -> list[str]:
    """Under a freshly taken lock: finish the commit the lock carries as pending (or one whose manifest is
    already written), undo every other staged run, remove temporary files of killed writes. A run taken
    over with --force or for a silent heartbeat may still be alive: its staging marker stays, so what it
    writes there later is still docbeam's and the next run removes it. Returns the run ids cleaned."""
    output = output.rstrip("/")
    fence = lock.fence
    state = inspect(output)
    pending = lock.owner.pending
    committed = state.manifest["run_id"] if state.manifest else None
    others = [run for run in state.staged_runs if run != fence.run_id]
    for run in sorted(others, key=lambda r: r not in (pending, committed)):  # finish before undoing
        intent = read_intent(output, run)
        alive = lock.taken_from is not None and lock.taken_from.run_id == run and not lock.owner_dead
        fence.prove()
        if intent is not None and run in (pending, committed):
            _finish(output, intent, fence, keep_marker=alive)
            log.warning("finished the commit of run %s", run)
        elif intent is not None:
            current = read_manifest(output)
            listed = {f["path"] for f in (current or {}).get("files", [])}
            undo = [
                rel for rel in intent["files"] if plain_relative(rel) and carries_run(rel, run) and rel not in listed
            ]
            delete_inside(output, [storage.join(output, rel) for rel in undo])
        _delete_staging(output, run, keep_marker=alive)
        log.warning("cleaned up the staging folder of dead run %s", run)
    if pending is not None:
        fence.settled()
    if state.leftovers:
        fence.prove()
        delete_inside(output, list(state.leftovers))
    storage.remove_folder_if_empty(f"{output}/{STAGING}")  # only docbeam's own folders: a user's empty one stays
    return others


def _finish(output: str, intent: dict, fence: Fence, keep_marker: bool) -> None:
    """Roll a commit that passed its commit point forward: the same writes, from whatever is there now."""
    run_id = intent["run_id"]
    folder = staging_dir(output, run_id)
    for rel in intent["files"]:
        if plain_relative(rel) and carries_run(rel, run_id) and storage.exists(f"{folder}/{rel}"):
            fence.prove()
            storage.rename(f"{folder}/{rel}", storage.join(output, rel))
    for name in POINTERS:
        path, wanted = storage.join(output, name), _pointer(intent, name)
        data, version = versioned.read_versioned(path)
        if data == wanted:
            continue
        fence.prove()
        if not versioned.write_if(path, wanted, version) and versioned.read_versioned(path)[0] != wanted:
            raise LockLost(f"{path} changed while run {fence.run_id} finished the commit of run {run_id}")
    _clean_after(output, intent, keep_marker)


def rewrite_summary(output: str, fence: Fence, summary: dict) -> bool:
    """The waiting driver adds what only it knows (metrics, start-up) to the committed summary.json, only
    while the lock and summary.json are still this run's; False when another run has taken over."""
    path = storage.join(output, SUMMARY)
    fence.prove()
    data, version = versioned.read_versioned(path)
    if data is None or json.loads(data).get("run_id") != fence.run_id:
        return False
    return versioned.write_if(path, json.dumps(summary, indent=2, sort_keys=True).encode(), version)

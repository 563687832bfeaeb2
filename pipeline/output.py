"""The output as a transaction: stage, then commit; delete only what a docbeam manifest lists.

A run writes everything under ``<output>/_staging/<run_id>/``. Its commit moves the staged files to
their places (every name carries the run id, so nothing of the previous run is overwritten), replaces
``summary.json``, writes ``_manifest.json`` (the commit point: the manifest is the truth about which
files form the output) and ``_SUCCESS`` last, then deletes the previous run's files and the staging
folder. On local disk each of these steps is a rename; GCS has no atomic rename (a move is a copy and a
delete), so there readers must take the file list from ``_manifest.json`` rather than from a glob.

Before it moves anything, a commit writes its intent (``_staging/<run_id>/_commit.json``: the files it
will place and those of the run it replaces), so a commit killed halfway can be finished or undone by the
next run, which only ever deletes files that a manifest or an intent lists.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import secrets

from pipeline import storage
from pipeline.errors import Refused

STAGING = "_staging"
MANIFEST = "_manifest.json"
SUCCESS = "_SUCCESS"
SUMMARY = "summary.json"
INTENT = "_commit.json"
MANIFEST_FORMAT = "docbeam.manifest/1"
OWN_NAMES = (MANIFEST, SUCCESS, SUMMARY, "_lock.json")
log = logging.getLogger(__name__)


class OutputRefused(Refused):
    """The output folder cannot be written safely: refuse at start, touching nothing."""


def new_run_id() -> str:
    """Sortable by start time, unique across hosts: ``20261130T114500Z-3f9a1c``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def run_date() -> str:
    """The UTC date that ``{run_date}`` in a path becomes: ``2026-11-30``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def staging_dir(output: str, run_id: str) -> str:
    return f"{output.rstrip('/')}/{STAGING}/{run_id}"


def relative(output: str, path: str) -> str:
    return path[len(output.rstrip("/")) + 1:]


def inside(output: str, path: str) -> bool:
    """Whether ``path`` lies strictly under the folder ``output`` (no ``..`` tricks)."""
    base = output.rstrip("/") + "/"
    if not storage.is_gcs(path):
        path = os.path.normpath(path)
    return path.startswith(base) and ".." not in path[len(base):].split("/")


def read_manifest(output: str) -> dict | None:
    path = storage.join(output, MANIFEST)
    if not storage.exists(path):
        return None
    manifest = json.loads(storage.read_bytes(path))
    if manifest.get("format") != MANIFEST_FORMAT:
        raise OutputRefused(f"{path} is not a docbeam manifest (format {manifest.get('format')!r}, expected "
                            f"{MANIFEST_FORMAT!r}); choose another output.path")
    return manifest


def manifest_paths(output: str, manifest: dict | None) -> set[str]:
    return {storage.join(output, f["path"]) for f in (manifest or {}).get("files", [])}


def _read_intent(folder: str) -> dict | None:
    path = f"{folder}/{INTENT}"
    return json.loads(storage.read_bytes(path)) if storage.exists(path) else None


@dataclasses.dataclass(frozen=True)
class OutputState:
    """What an output folder holds, sorted by who wrote it."""

    manifest: dict | None
    staged_runs: tuple[str, ...]  # run ids with a folder under _staging/
    intent_paths: frozenset[str]  # final paths a staged run's (interrupted) commit meant to place
    foreign: tuple[str, ...]  # files no docbeam manifest or intent lists


def inspect(output: str) -> OutputState:
    files = storage.list_files(output)
    manifest = read_manifest(output)
    staging_root = f"{output.rstrip('/')}/{STAGING}/"
    staged_runs = storage.list_folders(staging_root)
    intents = [_read_intent(staging_root + run) for run in staged_runs]
    intent_paths = {storage.join(output, rel) for i in intents if i for rel in i["files"]}
    known = manifest_paths(output, manifest) | intent_paths | {storage.join(output, n) for n in OWN_NAMES}
    foreign = sorted(p for p in files if p not in known and not p.startswith(staging_root))
    return OutputState(manifest, tuple(staged_runs), frozenset(intent_paths), tuple(foreign))


def check_writable(output: str, state: OutputState, mode: str) -> None:
    """Refuse an output that holds files docbeam did not write, or (fail_if_exists) a committed run."""
    if state.manifest is None and state.foreign:
        shown = ", ".join(relative(output, p) for p in state.foreign[:3])
        raise OutputRefused(
            f"output.path {output} holds {len(state.foreign)} file(s) that no docbeam run wrote (e.g. {shown}) "
            "and no docbeam manifest; docbeam only replaces its own runs. Choose a new or empty folder")
    if state.manifest is not None and mode == "fail_if_exists":
        raise OutputRefused(f"output.path {output} already holds run {state.manifest['run_id']} and output.mode "
                            "is fail_if_exists; choose another folder or set output.mode: replace")
    if state.manifest is not None and state.foreign:
        log.warning("output %s holds %d file(s) no docbeam manifest lists (e.g. %s); they are left alone, but "
                    "readers that glob the output will see them", output, len(state.foreign), state.foreign[0])


def clean_dead_staging(output: str, keep_run_id: str) -> list[str]:
    """Finish or undo what dead runs left under _staging/ (the caller holds the lock, so every staged
    run but ours is dead). Returns the run ids cleaned."""
    state = inspect(output)
    cleaned = []
    for run in state.staged_runs:
        if run == keep_run_id:
            continue
        folder = staging_dir(output, run)
        intent = _read_intent(folder)
        if intent is not None:
            committed = manifest_paths(output, state.manifest)
            if state.manifest is not None and state.manifest["run_id"] == run:
                leftovers = [storage.join(output, rel) for rel in intent["replaces"]]  # committed: finish it
            else:
                leftovers = [storage.join(output, rel) for rel in intent["files"]]  # never committed: undo it
            _delete_inside(output, [p for p in leftovers if p not in committed])
        _delete_inside(output, list(storage.list_files(folder)))
        storage.prune_empty_folders(folder)
        storage.prune_empty_folders(f"{output.rstrip('/')}/{STAGING}")
        log.warning("cleaned up the staging folder of dead run %s", run)
        cleaned.append(run)
    return cleaned


def _delete_inside(output: str, paths: list[str]) -> None:
    """The one place docbeam deletes output files: never anything outside the output folder."""
    outside = [p for p in paths if not inside(output, p)]
    if outside:
        raise RuntimeError(f"refusing to delete {outside[:3]}: outside the output folder {output}")
    storage.delete_files(paths, within=output)


def commit(output: str, run_id: str, summary: dict, manifest_extra: dict) -> dict:
    """Place the staged files, then the summary, the manifest and ``_SUCCESS``; then delete what the
    previous run wrote. Each step can be repeated, so a retried commit finishes the same way."""
    folder = staging_dir(output, run_id)
    intent = _read_intent(folder)
    if intent is None:
        staged = sorted(relative(folder, p) for p in storage.list_files(folder))
        previous = read_manifest(output)
        intent = {"run_id": run_id, "files": staged,
                  "replaces": sorted(relative(output, p) for p in manifest_paths(output, previous)),
                  "previous_run_id": previous and previous["run_id"]}
        storage.write_bytes(f"{folder}/{INTENT}", json.dumps(intent, indent=1).encode())
    for rel in intent["files"]:
        source, target = f"{folder}/{rel}", storage.join(output, rel)
        if storage.exists(source):
            storage.rename(source, target)
    sizes = storage.list_files(output)
    files = [{"path": rel, "size": sizes.get(storage.join(output, rel))} for rel in intent["files"]]
    missing = [f["path"] for f in files if f["size"] is None]
    if missing:
        raise RuntimeError(f"commit of run {run_id}: staged files vanished before they were placed: {missing[:3]}")
    storage.write_bytes(storage.join(output, SUMMARY), json.dumps(summary, indent=2, sort_keys=True).encode())
    manifest = {"format": MANIFEST_FORMAT, "run_id": run_id, "previous_run_id": intent["previous_run_id"],
                "committed_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "files": files, **manifest_extra}
    storage.write_bytes(storage.join(output, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())
    storage.write_bytes(storage.join(output, SUCCESS), f"{run_id}\n".encode())
    placed = manifest_paths(output, manifest)
    _delete_inside(output, [p for p in (storage.join(output, rel) for rel in intent["replaces"]) if p not in placed])
    _delete_inside(output, list(storage.list_files(folder)))
    storage.prune_empty_folders(f"{output.rstrip('/')}/{STAGING}")
    return manifest

"""What an output folder holds and which of it docbeam may touch.

An output folder holds one committed run: the files its ``_manifest.json`` lists, ``summary.json`` and
``_SUCCESS``. A run stages its files under ``_staging/<run_id>/`` (marked docbeam's by
``_staging/<run_id>/_run.json``) and commits them with pipeline/store/transaction.py. docbeam trusts only what it
provably wrote: a manifest, intent or staging marker of its own format naming its own run; every other file
is foreign, left alone, and makes a folder without a manifest refused at start.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import logging
import os
import posixpath
import re
import secrets

from docbeam.errors import Refused
from docbeam.pipeline.store import storage, versioned
from docbeam.pipeline.store.paths import normalize_folder

STAGING = "_staging"
MANIFEST = "_manifest.json"
SUCCESS = "_SUCCESS"
SUMMARY = "summary.json"
INTENT = "_commit.json"
MARKER = "_run.json"
LOCK = "_lock.json"
# The folders of a committed run, each of part files named part-<run_id>-…; a run's JAX profiles are staged
# under _staging/<run_id>/profiles/<run_id>/ and committed as profiles/<run_id>/.
EMBEDDINGS = "embeddings"
SCORES = "scores"  # a classifier head's rows (models/heads/classifier.py)
SELECTED = "selected"  # output.select: the documents whose row meets its where (pipeline/stages/select_documents.py)
CHUNKS = "chunks"  # output.granularity chunk or both: one row per window (pipeline/stages/window_chunks.py)
ERRORS = "errors"
TIMING = "timing"
PROFILES = "profiles"
MANIFEST_FORMAT = "docbeam.manifest/1"  # what marks a manifest as docbeam's; format_version says which form
# The form of the manifests this code writes. A manifest without format_version is version 1 (every output written
# before the field existed); read_manifest upgrades each older form to this one in memory, so no reader guesses a
# run's age from which fields it has. A change to what a manifest holds raises this and adds its upgrade step.
MANIFEST_VERSION = 2
INTENT_FORMAT = "docbeam.intent/1"
STAGING_FORMAT = "docbeam.staging/1"
TEMP_SUFFIX = re.compile(r"\.tmp-[0-9a-f]{32}$")  # pipeline/store/storage.temp_name: a write a kill interrupted
log = logging.getLogger(__name__)


class OutputRefused(Refused):
    """The output folder cannot be written safely: refuse at start, touching nothing."""


class ManifestTooNew(OutputRefused):
    """A manifest of a format_version newer than this code reads: written by a newer docbeam."""


def new_run_id() -> str:
    """Sortable by start time to the microsecond, unique across hosts: ``20261130T114500.123456Z-3f9a1c``. The
    runs of one output are ordered by their ids (a sink's table never applies an older run over a newer), so
    two runs a second apart must not sort by their random tails (check_runs_in_order holds the rest)."""
    global _last_run_start
    now = datetime.datetime.now(datetime.timezone.utc)
    if _last_run_start is not None and now <= _last_run_start:  # two ids in one microsecond of one process
        now = _last_run_start + datetime.timedelta(microseconds=1)
    _last_run_start = now
    return f"{now:%Y%m%dT%H%M%S.%fZ}-{secrets.token_hex(3)}"


_last_run_start: datetime.datetime | None = None


def check_runs_in_order(output: str, manifest: dict | None, run_id: str) -> None:
    """Under the lock: refuse a run whose id does not sort after the run the output holds (one that committed
    after this one was planned, or a driver whose clock is behind), or its rows would later read as older."""
    held = (manifest or {}).get("run_id")
    if held is not None and str(held) >= run_id:
        raise OutputRefused(
            f"output.path {output} holds run {held}, which does not sort before this run's id {run_id} (it "
            "committed after this run started, or this machine's clock is behind the one that wrote it); runs "
            "of an output are ordered by their ids, so nothing was written: start the run again"
        )


def run_date() -> str:
    """The UTC date that ``{run_date}`` in a path becomes: ``2026-11-30``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def staging_dir(output: str, run_id: str) -> str:
    return f"{output.rstrip('/')}/{STAGING}/{run_id}"


def profiles_dir(staging: str, run_id: str) -> str:
    """Where a run's workers write their JAX profiles, under its staging folder."""
    return f"{staging.rstrip('/')}/{PROFILES}/{run_id}"


def part_prefix(output: str, folder: str, run_id: str) -> str:
    """The prefix of every part file a run writes into ``folder``: its name carries the run (carries_run)."""
    return f"{output.rstrip('/')}/{folder}/part-{run_id}"


def in_folder(rel: str, folder: str) -> bool:
    """Whether a manifest's relative path ``rel`` is a file of the output's ``folder`` (e.g. EMBEDDINGS)."""
    return rel.startswith(f"{folder}/")


def relative(output: str, path: str) -> str:
    return path[len(output.rstrip("/")) + 1 :]


def inside(output: str, path: str) -> bool:
    """Whether ``path`` lies strictly under the folder ``output`` (no ``..`` tricks)."""
    base = normalize_folder(output) + "/"
    path = path if storage.is_remote(path) else os.path.normpath(path)
    return path.startswith(base) and ".." not in path[len(base) :].split("/")


def carries_run(rel: str, run_id: str) -> bool:
    """Whether a file of the output is provably one of ``run_id``'s: every file a run writes carries its id
    (``part-<run_id>-…`` or a ``<run_id>/`` folder)."""
    return bool(run_id) and (f"part-{run_id}-" in posixpath.basename(rel) or f"/{run_id}/" in f"/{rel}")


def plain_relative(rel: object) -> bool:
    """A file path as a manifest or intent may list it: relative, one spelling, not a folder."""
    return (
        isinstance(rel, str)
        and rel != ""
        and not rel.startswith("/")
        and not rel.endswith("/")
        and posixpath.normpath(rel) == rel
        and not rel.startswith("..")
        and not storage.is_remote(rel)
    )


# The fields a reader takes from a manifest, and the JSON type each must have where present: a garbled or foreign
# manifest is refused here, naming the field, instead of failing as a TypeError in whichever reader meets it.
MANIFEST_FIELD_TYPES = {
    "run_id": str,
    "files": list,
    "reuse_key": dict,
    "granularity": str,
    "head": dict,
    "embedding": dict,
    "kept_fields": dict,
    "counts": dict,
}
FILE_FIELD_TYPES = {"path": str, "size": int, "checksum": str}


def parse_manifest(data: bytes | None, path: str) -> dict | None:
    """A manifest's bytes → the manifest in the current form, None for no manifest; anything that is not one (not
    JSON, another format, a field of the wrong type, a file entry that is no relative path) is OutputRefused, exit
    2, naming the file and the field."""
    if data is None:
        return None
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise OutputRefused(
            f"{path} is not JSON ({type(e).__name__}: {e}); move the folder aside or choose another output.path"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise OutputRefused(
            f"{path} is not a docbeam manifest (format {found!r}, expected {MANIFEST_FORMAT!r}); "
            "choose another output.path"
        )
    wrong = [
        f"{key}: {json.dumps(manifest[key])[:60]} (expected {kind.__name__})"
        for key, kind in MANIFEST_FIELD_TYPES.items()
        if key in manifest and not isinstance(manifest[key], kind)
    ]
    wrong += [
        f"files[{i}].{key}: {json.dumps(f[key])[:60]} (expected {kind.__name__})"
        for i, f in enumerate(manifest.get("files") if isinstance(manifest.get("files"), list) else [])
        if isinstance(f, dict)
        for key, kind in FILE_FIELD_TYPES.items()
        if key in f and (not isinstance(f[key], kind) or isinstance(f[key], bool) or kind is int and f[key] < 0)
    ]
    if wrong:
        raise OutputRefused(
            f"{path} is garbled: {'; '.join(wrong[:3])}; move the folder aside or choose another output.path"
        )
    bad = [f for f in manifest.get("files", []) if not (isinstance(f, dict) and plain_relative(f.get("path")))]
    if bad or not isinstance(manifest.get("run_id"), str):
        raise OutputRefused(
            f"{path} lists {bad[:1] or 'no run id'}: not a file path of a docbeam run (relative, "
            "no '..', no trailing '/'); move the folder aside or choose another output.path"
        )
    return upgrade_manifest(manifest, path)


def damaged(output: str, manifest: dict, folder: str, require_checksums: bool = True) -> str | None:
    """Why the committed files of ``folder`` cannot be read back as the manifest lists them (missing, another size,
    no checksum recorded, or a checksum that does not match: sha256 locally, the object's CRC32C on gs://), or None.
    What reuse and ReadBeamChunks hold a committed run to before they read a row of it; the report, which also
    reads runs from before checksums were recorded, checks the ones there are (``require_checksums=False``)."""
    sizes = storage.list_files(output)
    for f in manifest["files"]:
        if not in_folder(f["path"], folder):
            continue
        path = storage.join(output, f["path"])
        if path not in sizes or sizes[path] != f.get("size"):
            return f"its file {f['path']} is missing or not the size its manifest says ({f.get('size')} bytes)"
        if "checksum" not in f and not require_checksums:
            continue
        if "checksum" not in f:
            return (
                f"run {manifest.get('run_id')} recorded no checksums (written before they were), so its files "
                "cannot be checked"
            )
        if storage.checksum(path) != f["checksum"]:
            return f"its file {f['path']} does not match the checksum its manifest lists ({f['checksum']}): damaged"
    return None


def read_manifest(output: str) -> dict | None:
    """The committed run's manifest in the current form (upgrade_manifest), None when there is none."""
    path = storage.join(output, MANIFEST)
    return parse_manifest(versioned.read_versioned(path)[0], path)


# What a version-1 run that predates a field did, field by field: a run before heads embedded into embeddings/,
# one before output.granularity wrote document rows, one before input.keep_fields kept nothing. Its reuse key:
# one before prompts, Hub ids, truncate_dim, sentence-transformers' Dense modules and model.task used none of them
# (None), one before output.vector_dtype wrote float32, one before heads embedded.
V1_DEFAULTS = {
    "head": {"name": "embedding", "folder": EMBEDDINGS},
    "granularity": "document",
    "kept_fields": {},
}
V1_KEY_DEFAULTS = {
    "prompt": None,
    "model_revision": None,
    "truncate_dim": None,
    "dense_digest": None,
    "vector_dtype": "float32",
    "head": "embedding",
    "task": None,
}


def upgrade_manifest(manifest: dict, path: str) -> dict:
    """``manifest`` (read from ``path``) in the form MANIFEST_VERSION describes, in memory: the one place that
    knows what an older form left out. A version newer than this code knows is refused (ManifestTooNew)."""
    version = manifest.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise OutputRefused(
            f"{path} has format_version {version!r}, which no docbeam writes (an integer from 1); "
            "move the folder aside or choose another output.path"
        )
    if version > MANIFEST_VERSION:
        raise ManifestTooNew(
            f"{path} has format_version {version}, and this docbeam reads manifests up to format_version "
            f"{MANIFEST_VERSION}: a newer docbeam wrote it. Upgrade docbeam (here and in the worker image) to "
            "read, reuse or replace this output"
        )
    upgraded = dict(manifest)
    if version == 1:
        upgraded = {**copy.deepcopy(V1_DEFAULTS), **upgraded}
        if "reuse_key" in upgraded:  # a run before incremental runs recorded none, and cannot be reused
            upgraded["reuse_key"] = {**V1_KEY_DEFAULTS, **upgraded["reuse_key"]}
    upgraded["format_version"] = MANIFEST_VERSION
    return upgraded


def manifest_paths(output: str, manifest: dict | None) -> set[str]:
    return {storage.join(output, f["path"]) for f in (manifest or {}).get("files", [])}


def _read_json(path: str) -> dict | None:
    data = versioned.read_versioned(path)[0]
    try:
        record = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_intent(output: str, run_id: str) -> dict | None:
    """A staged run's commit intent, only if it is docbeam's and names that run."""
    intent = _read_json(f"{staging_dir(output, run_id)}/{INTENT}")
    if intent is None or intent.get("format") != INTENT_FORMAT or intent.get("run_id") != run_id:
        return None
    return intent


def mark_staging(output: str, run_id: str, token: int) -> None:
    """Mark ``_staging/<run_id>/`` as this run's before anything is written there."""
    record = {"format": STAGING_FORMAT, "run_id": run_id, "token": token}
    storage.write_bytes(f"{staging_dir(output, run_id)}/{MARKER}", json.dumps(record).encode())


def _docbeam_staging(output: str, run_id: str, paths: list[str]) -> bool:
    folder = staging_dir(output, run_id)
    if all(p.startswith(f"{folder}/{MARKER}.tmp-") and TEMP_SUFFIX.search(p) for p in paths):
        return True  # killed while writing its marker
    marker = _read_json(f"{folder}/{MARKER}") if f"{folder}/{MARKER}" in paths else None
    return marker is not None and marker.get("format") == STAGING_FORMAT and marker.get("run_id") == run_id


@dataclasses.dataclass(frozen=True)
class OutputState:
    """What an output folder holds, sorted by who wrote it."""

    manifest: dict | None
    staged_runs: tuple[str, ...]  # run ids with a docbeam staging folder under _staging/
    intent_paths: frozenset[str]  # final paths a staged run's (interrupted) commit meant to place
    leftovers: tuple[str, ...]  # temporary files of docbeam's own writes that a kill interrupted
    foreign: tuple[str, ...]  # files no docbeam manifest, intent or staging marker accounts for


def inspect(output: str) -> OutputState:
    output = output.rstrip("/")
    files = storage.list_files(output)
    manifest = read_manifest(output)
    staging_root = f"{output}/{STAGING}/"
    by_run: dict[str, list[str]] = {}
    for path in files:
        if path.startswith(staging_root) and "/" in path[len(staging_root) :]:
            by_run.setdefault(path[len(staging_root) :].split("/")[0], []).append(path)
    staged = sorted(run for run, paths in by_run.items() if _docbeam_staging(output, run, paths))
    intent_paths = set()
    for run in staged:
        intent = read_intent(output, run) or {}
        intent_paths |= {
            storage.join(output, rel)
            for rel in intent.get("files", [])
            if plain_relative(rel) and carries_run(rel, run)
        }
    own = {storage.join(output, n) for n in ((MANIFEST, SUMMARY, SUCCESS, LOCK) if manifest else (LOCK,))}
    leftovers = sorted(
        p
        for p in files
        if TEMP_SUFFIX.sub("", p) in {storage.join(output, n) for n in (MANIFEST, SUMMARY, SUCCESS, LOCK)}
        and TEMP_SUFFIX.search(p)
    )
    known = manifest_paths(output, manifest) | intent_paths | own | set(leftovers)
    known |= {p for run in staged for p in by_run[run]}
    foreign = sorted(p for p in files if p not in known)
    return OutputState(manifest, tuple(staged), frozenset(intent_paths), tuple(leftovers), tuple(foreign))


def check_writable(output: str, state: OutputState, mode: str) -> None:
    """Refuse an output that holds files docbeam did not write, or (fail_if_exists) a committed run."""
    if state.manifest is None and state.foreign:
        shown = ", ".join(relative(output, p) for p in state.foreign[:3])
        raise OutputRefused(
            f"output.path {output} holds {len(state.foreign)} file(s) that no docbeam run wrote (e.g. {shown}) "
            "and no docbeam manifest; docbeam only replaces its own runs. Choose a new or empty folder"
        )
    if state.manifest is not None and mode == "fail_if_exists":
        raise OutputRefused(
            f"output.path {output} already holds run {state.manifest['run_id']} and output.mode "
            "is fail_if_exists; choose another folder or set output.mode: replace"
        )
    if state.manifest is not None and state.foreign:
        log.warning(
            "output %s holds %d file(s) no docbeam manifest lists (e.g. %s); they are left alone, but "
            "readers that glob the output will see them",
            output,
            len(state.foreign),
            state.foreign[0],
        )


def delete_inside(output: str, paths: list[str]) -> None:
    """The one place docbeam deletes output files: never anything outside the output folder, never a folder."""
    outside = [p for p in paths if not inside(output, p)]
    if outside:
        raise RuntimeError(f"refusing to delete {outside[:3]}: outside the output folder {output}")
    storage.delete_files(paths, within=output)

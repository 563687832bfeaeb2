"""Reading and writing local paths and gs:// alike, through Beam's ``FileSystems``.

Call ``pipeline_options(argv)`` once per process before touching gs:// (inside or outside a pipeline): it
sets the options ``FileSystems`` uses and, for ``--no_auth``, skips Beam's credential lookup. That lookup
otherwise costs ~20 s on any machine without Google credentials (a laptop, CI, a test against the emulator).
"""
from __future__ import annotations

import os
import uuid
from typing import Sequence

from apache_beam.internal.gcp import auth
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
NO_AUTH_FLAG = "--no_auth"


def gcs_flags() -> list[str]:
    """``["--no_auth"]`` while ``STORAGE_EMULATOR_HOST`` is set: the emulator ignores credentials."""
    return [NO_AUTH_FLAG] if os.environ.get(EMULATOR_ENV) else []


def pipeline_options(argv: Sequence[str] | None = None) -> PipelineOptions:
    """Beam options from ``argv`` plus ``gcs_flags()``, made current for ``FileSystems`` in this process.

    Use the result for ``beam.Pipeline(options=...)``; outside a pipeline, calling this is what makes
    ``read_bytes``/``glob``/... on gs:// start without the credential stall.
    """
    argv = list(argv or [])
    argv += [flag for flag in gcs_flags() if flag not in argv]
    options = PipelineOptions(argv)
    if options.view_as(GoogleCloudOptions).no_auth:
        skip_beam_credential_lookup()
    # Pipeline.__init__ does this too; doing it here covers FileSystems calls made before or without one.
    FileSystems.set_options(options)
    return options


def skip_credential_lookup_for_emulator() -> None:
    """In a worker process: against the emulator, skip Beam's credential lookup as the driver does (the
    workers receive --no_auth, but gcsio ignores it; see skip_beam_credential_lookup)."""
    if os.environ.get(EMULATOR_ENV):
        skip_beam_credential_lookup()


def skip_beam_credential_lookup() -> None:
    """Make every Beam GCP client in this process anonymous, as ``--no_auth`` promises.

    Needed since Beam 2.77's gcsio ignores ``--no_auth``: ``GcsIO.__init__`` calls
    ``create_storage_client(options)`` with ``use_credentials=True``, which calls
    ``auth.get_service_credentials`` -> ``google.auth.default`` under ``retry.with_exponential_backoff(
    num_retries=4, initial_delay_secs=2)``; with no credentials that sleeps ~15-30 s and then returns None,
    and gcsio falls back to ``storage.Client.create_anonymous_client()`` (which honours
    ``STORAGE_EMULATOR_HOST``). Beam caches that result per process in ``auth._Credentials``; recording
    "looked up, found none" there gives the same anonymous client without the wait.
    """
    credentials = auth._Credentials
    if not all(hasattr(credentials, name) for name in ("_credentials_lock", "_credentials_init", "_credentials")):
        raise RuntimeError("apache_beam.internal.gcp.auth._Credentials changed (written for Beam 2.77); "
                           "update pipeline/storage.skip_beam_credential_lookup for this Beam version")
    with credentials._credentials_lock:
        credentials._credentials = None
        credentials._credentials_init = True


def join(base: str, *parts: str) -> str:
    return FileSystems.join(base, *parts)


def exists(path: str) -> bool:
    return FileSystems.exists(path)


def read_bytes(path: str) -> bytes:
    """The stored bytes: no decompression by file suffix (FileSystems' default is to guess from it)."""
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` so readers see the old file or the new one, never a partial one.

    An object in gs:// only appears once its upload completes, so it is written in place; a local file is
    written next to the target and renamed over it (atomic on POSIX within one filesystem).
    """
    if FileSystems.get_scheme(path) is not None:
        _write(path, data)
        return
    temp_path = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        _write(temp_path, data)
        FileSystems.rename([temp_path], [path])
    finally:
        if FileSystems.exists(temp_path):
            FileSystems.delete([temp_path])


def _write(path: str, data: bytes) -> None:
    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(data)


def is_gcs(path: str) -> bool:
    return path.startswith("gs://")


def list_files(prefix: str) -> dict[str, int]:
    """Every file under the folder ``prefix`` (recursively), path → size; {} for a missing folder."""
    (match,) = FileSystems.match([f"{prefix.rstrip('/')}/**"])
    return {m.path: m.size_in_bytes for m in match.metadata_list}


def list_folders(prefix: str) -> list[str]:
    """Names of the folders directly under ``prefix``; on gs:// those holding at least one object."""
    prefix = prefix.rstrip("/")
    if is_gcs(prefix):
        return sorted({p[len(prefix) + 1:].split("/")[0] for p in list_files(prefix) if "/" in p[len(prefix) + 1:]})
    return sorted(e.name for e in os.scandir(prefix) if e.is_dir()) if os.path.isdir(prefix) else []


def rename(source: str, destination: str) -> None:
    """Move one file (on gs:// a copy and a delete: readers may briefly see both)."""
    if not is_gcs(destination):
        os.makedirs(os.path.dirname(destination), exist_ok=True)
    FileSystems.rename([source], [destination])


def delete_files(paths: Sequence[str], within: str | None = None) -> None:
    """Delete the files that exist; local folders left empty by it are removed too, up to (not including)
    the folder ``within``."""
    present = [p for p in paths if FileSystems.exists(p)]
    if present:
        FileSystems.delete(present)
    if within is not None:
        for folder in sorted({os.path.dirname(p) for p in paths if not is_gcs(p)}, key=len, reverse=True):
            _remove_empty_folders(folder, stop=within)


def prune_empty_folders(root: str) -> None:
    """Remove the empty folders under a local ``root``, and ``root`` itself if it ends up empty (gs:// has
    no folders: nothing to do)."""
    if is_gcs(root) or not os.path.isdir(root):
        return
    for folder, _, _ in sorted(os.walk(root), key=lambda entry: len(entry[0]), reverse=True):
        if not os.listdir(folder):
            os.rmdir(folder)


def _remove_empty_folders(folder: str, stop: str) -> None:
    stop = os.path.normpath(stop)
    while folder.startswith(stop + os.sep) and os.path.isdir(folder) and not os.listdir(folder):
        os.rmdir(folder)
        folder = os.path.dirname(folder)


def create_exclusive(path: str, data: bytes) -> bool:
    """Create ``path`` with ``data`` unless it exists; True when this call created it.

    Needed for the output lock: two runs starting together must not both believe they own it. Local disk
    uses O_EXCL; gs:// uses a generation precondition (the object must not exist yet).
    """
    if is_gcs(path):
        from google.api_core import exceptions as gexc

        bucket, _, name = path[len("gs://"):].partition("/")
        try:
            gcs_client().bucket(bucket).blob(name).upload_from_string(data, if_generation_match=0)
        except gexc.PreconditionFailed:
            return False
        return True
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def gcs_client():
    """A google-cloud-storage client: anonymous against the emulator, the environment's credentials else."""
    from google.cloud import storage as gcs

    host = os.environ.get(EMULATOR_ENV)
    if host:
        from google.auth.credentials import AnonymousCredentials

        return gcs.Client(project="docbeam-emulator", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": host})
    return gcs.Client()


def copy_tree(local_dir: str, dest: str) -> None:
    """Profiles are written locally by JAX, then copied byte for byte to the output (local or gs://)."""
    for root, _, files in os.walk(local_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), local_dir)
            target = join(dest, *rel.split(os.sep))
            if "://" not in target:
                os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(os.path.join(root, name), "rb") as src:
                write_bytes(target, src.read())

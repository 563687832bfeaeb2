"""Reading and writing local paths and gs:// alike, through Beam's ``FileSystems``.

Call ``pipeline_options(argv)`` once per process before touching gs:// (inside or outside a pipeline): it
sets the options ``FileSystems`` uses and, for ``--no_auth``, skips Beam's credential lookup. That lookup
otherwise costs ~20 s on any machine without Google credentials (a laptop, CI, a test against the emulator).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import uuid
from typing import Sequence

from apache_beam.internal.gcp import auth
from apache_beam.io.filesystem import BeamIOError, CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions
from apache_beam.options.value_provider import RuntimeValueProvider

from docbeam.pipeline.store import faults
from docbeam.pipeline.store.paths import is_gcs, is_remote, split_gcs  # noqa: F401  (storage.is_gcs for callers)

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

    Needed since Beam 2.77's gcsio (2.78's too) ignores ``--no_auth``: ``GcsIO.__init__`` calls
    ``create_storage_client(options)`` with ``use_credentials=True``, which calls
    ``auth.get_service_credentials`` -> ``google.auth.default`` under ``retry.with_exponential_backoff(
    num_retries=4, initial_delay_secs=2)``; with no credentials that sleeps ~15-30 s and then returns None,
    and gcsio falls back to ``storage.Client.create_anonymous_client()`` (which honours
    ``STORAGE_EMULATOR_HOST``). Beam caches that result per process in ``auth._Credentials``; recording
    "looked up, found none" there gives the same anonymous client without the wait.
    """
    credentials = auth._Credentials
    if not all(hasattr(credentials, name) for name in ("_credentials_lock", "_credentials_init", "_credentials")):
        raise RuntimeError(
            "apache_beam.internal.gcp.auth._Credentials changed (written for Beam 2.77, checked on 2.78); "
            "update pipeline/store/storage.skip_beam_credential_lookup for this Beam version"
        )
    with credentials._credentials_lock:
        credentials._credentials = None
        credentials._credentials_init = True


def join(base: str, *parts: str) -> str:
    return FileSystems.join(base, *parts)


def exists(path: str) -> bool:
    return gcsio().exists(path) if is_gcs(path) else FileSystems.exists(path)


def read_bytes(path: str) -> bytes:
    """The stored bytes: no decompression by file suffix (FileSystems' default is to guess from it)."""
    if is_gcs(path):
        with gcsio().open(path, "rb") as f:
            return f.read()
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


_this_thread = threading.local()


def gcsio():
    """This thread's Beam ``GcsIO``, made once per thread for the options and the endpoint in force.

    Needed since Beam's ``GCSFileSystem`` makes a new ``GcsIO`` (a new storage client) for every call, ~30 ms
    each, and a lock, a commit or a reuse check makes dozens of calls. Calls through it are what
    ``FileSystems`` would do on gs:// (the same ``GcsIO`` methods, uncompressed, the same options: the driver's,
    or a worker's runtime ones). One per thread, as Beam itself once cached them, since a storage client is
    not promised to be thread-safe."""
    from apache_beam.io.gcp.gcsio import GcsIO

    options = FileSystems._pipeline_options or RuntimeValueProvider.runtime_options  # what FileSystems passes
    endpoint = os.environ.get(EMULATOR_ENV)  # another emulator needs another client
    made = getattr(_this_thread, "gcsio", None)
    if made is None or made[0] is not options or made[1] != endpoint:
        made = _this_thread.gcsio = (options, endpoint, GcsIO(pipeline_options=options))
    return made[2]


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` so readers see the old file or the new one, never a partial one.

    An object in gs:// only appears once its upload completes, so it is written in place; a local file is
    written next to the target (``<name>.tmp-<32 hex>``, a name the output's clean-up recognises when a
    kill leaves one behind) and renamed over it (atomic on POSIX within one filesystem).
    """
    if is_remote(path):
        write_in_place(path, data)
        return
    temp_path = temp_name(path)
    write_in_place(temp_path, data)
    try:
        _rename_local(temp_path, path)
    except Exception:
        unlink_quietly(temp_path)
        raise


def temp_name(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex}"


def write_in_place(path: str, data: bytes) -> None:
    faults.before_change("write", path)
    if not is_remote(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    opened = (
        gcsio().open(path, "wb", mime_type="application/octet-stream")
        if is_gcs(path)
        else FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED)
    )
    with opened as f:
        f.write(data)


def _rename_local(source: str, destination: str) -> None:
    faults.before_change("rename", destination)
    os.rename(source, destination)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def list_files(prefix: str) -> dict[str, int]:
    """Every file under the folder ``prefix`` (recursively), path → size; {} for a missing folder."""
    (match,) = FileSystems.match([f"{prefix.rstrip('/')}/**"])
    return {m.path: m.size_in_bytes for m in match.metadata_list}


def rename(source: str, destination: str) -> None:
    """Move one file (on gs:// a copy and a delete, two changes: readers may briefly see both)."""
    if is_remote(destination):
        faults.before_change("copy", destination)
        if is_gcs(source) and is_gcs(destination):
            try:
                gcsio().copy(source, destination)
            except Exception as e:  # noqa: BLE001  as FileSystems.copy reports it
                raise BeamIOError("Copy operation failed", {(source, destination): e}) from e
        else:
            FileSystems.copy([source], [destination])
        delete_files([source])
        return
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    _rename_local(source, destination)


def delete_files(paths: Sequence[str], within: str | None = None) -> None:
    """Delete each file that exists, exactly that file: never a folder, never a glob's matches (so a
    manifest that lists a folder deletes nothing). Local folders left empty are removed too, up to (not
    including) the folder ``within``."""
    for path in paths:
        if is_gcs(path):
            faults.before_change("delete", path)
            try:
                gcs_blob(path).delete()
            except gcs_errors().NotFound:
                pass
        elif os.path.isfile(path) or os.path.islink(path):
            faults.before_change("delete", path)
            unlink_quietly(path)
    if within is not None:
        for folder in sorted({os.path.dirname(p) for p in paths if not is_remote(p)}, key=len, reverse=True):
            _remove_empty_folders(folder, stop=within)


def prune_empty_folders(root: str) -> None:
    """Remove the empty folders under a local ``root``, and ``root`` itself if it ends up empty (gs:// has
    no folders: nothing to do)."""
    if is_remote(root) or not os.path.isdir(root):
        return
    for folder, _, _ in sorted(os.walk(root), key=lambda entry: len(entry[0]), reverse=True):
        _rmdir_if_empty(folder)


def remove_folder_if_empty(folder: str) -> None:
    """A local ``folder`` removed if it holds nothing (gs:// has no folders: nothing to do)."""
    if not is_remote(folder):
        _rmdir_if_empty(folder)


def _remove_empty_folders(folder: str, stop: str) -> None:
    stop = os.path.normpath(stop)
    while folder.startswith(stop + os.sep) and _rmdir_if_empty(folder):
        folder = os.path.dirname(folder)


def _rmdir_if_empty(folder: str) -> bool:
    if not os.path.isdir(folder) or os.listdir(folder):
        return False
    faults.before_change("delete", folder)
    try:
        os.rmdir(folder)
    except OSError:  # a file arrived meanwhile: keep the folder
        return False
    return True


def checksum(path: str) -> str:
    """``sha256:<hex>`` of a local file; on gs:// the object's CRC32C as GCS keeps it (no download)."""
    if is_gcs(path):
        try:
            return f"crc32c:{gcsio().checksum(path)}"
        except Exception as e:  # noqa: BLE001  as FileSystems.checksum reports it
            raise BeamIOError("Checksum operation failed", {path: e}) from e
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def gcs_errors():
    from google.api_core import exceptions

    return exceptions


def gcs_blob(path: str):
    bucket, name = split_gcs(path)
    return gcs_client().bucket(bucket).blob(name)


def gcs_client():
    """A google-cloud-storage client: anonymous against the emulator, the environment's credentials else."""
    return _client_for(os.environ.get(EMULATOR_ENV))


@functools.lru_cache(maxsize=4)
def _client_for(host: str | None):
    from google.cloud import storage as gcs

    if host:
        from google.auth.credentials import AnonymousCredentials

        return gcs.Client(
            project="docbeam-emulator", credentials=AnonymousCredentials(), client_options={"api_endpoint": host}
        )
    return gcs.Client()


def copy_tree(local_dir: str, dest: str) -> None:
    """Profiles are written locally by JAX, then copied byte for byte to the output (local or gs://)."""
    for root, _, files in os.walk(local_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), local_dir)
            target = join(dest, *rel.split(os.sep))
            if not is_remote(target):
                os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(os.path.join(root, name), "rb") as src:
                write_bytes(target, src.read())

"""Versioned reads and conditional writes, local and gs:// alike: the only way the output lock, the
manifest, summary.json and _SUCCESS change, so a run whose view is out of date changes nothing.

A version is the object's generation on gs:// and the file's bytes locally; None is "absent". Kept apart
from pipeline/store/storage.py, whose plain reads and writes any stage may use: these carry the commit's
guarantees, and a reader should find them in one short file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from docbeam.pipeline.store import faults, storage


def read_versioned(path: str) -> tuple[bytes | None, object]:
    if not storage.is_gcs(path):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):  # under a file, as under a missing folder: absent
            return None, None
        return data, data
    errors = storage.gcs_errors()
    for _ in range(5):  # changed between the metadata and the download: read again
        named = storage.gcs_blob(path)
        blob = named.bucket.get_blob(named.name)
        if blob is None:
            return None, None
        generation = blob.generation  # before the download, which resets it from response headers
        try:
            return blob.download_as_bytes(if_generation_match=generation), generation
        except (errors.PreconditionFailed, errors.NotFound):
            continue
    raise RuntimeError(f"{path} kept changing while it was read")


def write_if(path: str, data: bytes, version: object) -> bool:
    """Write ``data`` only if ``path`` is still at ``version`` (None: only if it does not exist); False
    when it is not. gs:// checks with a generation precondition; local disk compares the bytes under an
    exclusive ``flock`` of the folder, then renames a finished temporary file over the target."""
    return write_versioned(path, data, version)[0]


def write_versioned(path: str, data: bytes, version: object) -> tuple[bool, object]:
    """``write_if``, also returning the version the write created (to write from it next, unread)."""
    if storage.is_gcs(path):
        faults.before_change("write", path)
        blob = storage.gcs_blob(path)
        try:
            blob.upload_from_string(data, if_generation_match=version or 0)
        except storage.gcs_errors().PreconditionFailed:
            return False, None
        return True, blob.generation
    temp_path = storage.temp_name(path)
    storage.write_in_place(temp_path, data)
    faults.before_change("rename", path)
    with _folder_guard(os.path.dirname(path)):
        try:
            if read_versioned(path)[1] == version:
                os.rename(temp_path, path)
                return True, data
        except FileNotFoundError:  # our temporary file was cleaned up as a leftover: the write did not happen
            return False, None
    storage.unlink_quietly(temp_path)
    return False, None


def delete_if(path: str, version: object) -> bool:
    """Delete ``path`` only if it is still at ``version``; False when it is not (or is gone)."""
    if version is None:
        return False
    faults.before_change("delete", path)
    if storage.is_gcs(path):
        errors = storage.gcs_errors()
        try:
            storage.gcs_blob(path).delete(if_generation_match=version)
        except (errors.PreconditionFailed, errors.NotFound):
            return False
        return True
    with _folder_guard(os.path.dirname(path)):
        if read_versioned(path)[1] != version:
            return False
        os.unlink(path)
        return True


@contextlib.contextmanager
def _folder_guard(folder: str):
    """An exclusive flock of a local folder: the compare and the rename of a conditional write happen as one
    step for every process and thread on this host (the kernel releases it when a process dies)."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

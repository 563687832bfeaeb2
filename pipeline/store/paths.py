"""Which store a path names: the one test of "local or remote" every module asks.

Without Beam, so the config can ask it while it loads (importing Beam costs seconds); the pattern is Beam's
own (``FileSystems.get_scheme``), so this module and the FileSystems that open the path always agree.
"""

from __future__ import annotations

import posixpath
import re

_SCHEME = re.compile(r"^(?P<scheme>[a-zA-Z][-a-zA-Z0-9+.]*)://")  # apache_beam/io/filesystems.py
GCS_PREFIX = "gs://"


def is_remote(path: str) -> bool:
    """Whether ``path`` names an object store rather than this machine's disk: a scheme Beam's FileSystems
    dispatches on (``gs://``, ``s3://``, ...). The one test of "local or not": local paths get folders made,
    symlinks checked and ``abspath`` spellings; remote ones never do."""
    return _SCHEME.match(path.strip()) is not None


def is_gcs(path: str) -> bool:
    """Whether ``path`` is on Google Cloud Storage, where docbeam's versioned writes use object generations."""
    return path.startswith(GCS_PREFIX)


def split_gcs(path: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` → ``("bucket", "a/b")``."""
    bucket, _, name = path[len(GCS_PREFIX) :].partition("/")
    return bucket, name


def normalize_folder(path: str) -> str:
    """One spelling per folder: ``//``, ``/./``, ``/../`` and a trailing ``/`` resolved (gs:// too), so that
    every later comparison of paths under it is a plain prefix test."""
    if is_gcs(path):
        bucket, name = split_gcs(path)
        name = posixpath.normpath("/" + name).lstrip("/") if name else ""
        return f"{GCS_PREFIX}{bucket}/{name}".rstrip("/") if name else f"{GCS_PREFIX}{bucket}"
    normal = posixpath.normpath(path)
    return "/" + normal.lstrip("/") if normal.startswith("/") else normal

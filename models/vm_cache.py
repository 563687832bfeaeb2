"""Folders filled once per machine, shared by every process on it.

Needed since Dataflow starts one SDK process per vCPU: each copying the checkpoint (or the compilation
cache) from gs:// would multiply start-up time and egress by the core count. The first process to ask
fills the folder under an exclusive ``fcntl.flock``; the others wait on the lock and then find it
complete. A folder is filled in a temporary sibling and renamed into place, so a process killed halfway
leaves nothing that looks complete. The root is ``$DOCBEAM_VM_CACHE`` or a folder in the system temp
directory, the place Beam's MultiProcessShared also relies on to find what processes share.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from typing import Callable

ROOT_ENV = "DOCBEAM_VM_CACHE"
COMPLETE = ".complete"  # holds the pid of the process that filled the folder


def root() -> str:
    return os.environ.get(ROOT_ENV) or os.path.join(tempfile.gettempdir(), "docbeam-vm-cache")


def once_per_vm(kind: str, key: str, fill: Callable[[str], None]) -> str:
    """``root()/kind/key``, filled by ``fill(folder)`` exactly once per machine; returns the folder."""
    parent = os.path.join(root(), kind)
    folder = os.path.join(parent, key)
    if os.path.exists(os.path.join(folder, COMPLETE)):
        return folder
    os.makedirs(parent, exist_ok=True)
    with open(f"{folder}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if os.path.exists(os.path.join(folder, COMPLETE)):
            return folder
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete fill by a process that died
        partial = tempfile.mkdtemp(prefix=f"{key}.partial-", dir=parent)
        try:
            fill(partial)
            with open(os.path.join(partial, COMPLETE), "w") as f:
                f.write(str(os.getpid()))
            os.rename(partial, folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return folder


def filled_by(folder: str) -> int:
    """The pid of the process that filled ``folder``."""
    with open(os.path.join(folder, COMPLETE)) as f:
        return int(f.read())

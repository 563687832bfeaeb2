"""JAX's persistent compilation cache at ``runner.compilation_cache``, local or on gs://.

JAX 0.10 opens a non-local cache folder through etils' epath, which for gs:// needs gcsfs (not in the
worker image) and then reads every entry over the network on each lookup. Instead the worker keeps the
cache in a local folder and mirrors it: entries under the gs:// prefix are copied down once per VM
(models/vm_cache.py) when the encoder loads, and entries this process compiled are copied up after the
batch that compiled them. An entry is a file named by its key, written once and never changed, so
mirroring is copying the names the other side lacks.

The cache only saves time: one that cannot be reached (a bucket that does not exist or denies this worker,
a folder that cannot be created, an upload that fails) is logged as a warning and the encoder compiles
without it, as it would with no cache configured. A gs:// endpoint that does not answer costs Beam's
retries (about two minutes) once per VM: the first process to give up leaves a note beside the VM's copy,
and the VM's other processes, which waited for it on the same lock, read the note instead of retrying.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

from docbeam.models import vm_cache
from docbeam.pipeline.store import storage

ENTRY_SUFFIX = "-cache"  # JAX's LRUCache names an entry <key>-cache (and keeps -atime files beside it)
UNREACHABLE_SUFFIX = ".unreachable"  # beside the VM's copy: why the first process could not fill it
# A note speaks for one job's start-up only: a later job on the same machine (a developer's, or a reused
# VM) tries the cache again.
UNREACHABLE_NOTE_TTL_S = 600
log = logging.getLogger(__name__)


class CompileCache:
    """Points this process's JAX at the cache; ``push()`` after compiling copies new entries up."""

    def __init__(self, location: str):
        self.location = location.rstrip("/")
        self.remote = storage.is_remote(self.location)
        self.local: str | None = None  # None: not reachable, this process compiles without a cache
        self._pushed: set[str] = set()
        try:
            self.local = self._open()
        except Exception as e:  # noqa: BLE001  whatever keeps the cache out of reach, the encoder can still run
            log.warning(
                "compilation cache %s cannot be reached (%s: %s); compiling without it",
                self.location,
                type(e).__name__,
                " ".join(str(e).split())[:300],
            )
            return
        _use(self.local)

    def _open(self) -> str:
        if not self.remote:
            os.makedirs(self.location, exist_ok=True)
            return self.location
        storage.skip_credential_lookup_for_emulator()
        key = hashlib.sha256(self.location.encode()).hexdigest()[:16]
        self._note = os.path.join(vm_cache.root(), "jax-cache", key + UNREACHABLE_SUFFIX)
        local = vm_cache.once_per_vm("jax-cache", key, self._pull)
        self._pushed = set(_entries(local))
        return local

    def _pull(self, folder: str) -> None:
        """Runs under the VM's lock for this cache, so a note left by a process that gave up is seen here."""
        if os.path.exists(self._note) and time.time() - os.path.getmtime(self._note) < UNREACHABLE_NOTE_TTL_S:
            with open(self._note) as f:
                raise OSError(f"another process on this VM could not reach it: {f.read()}")
        try:
            remote = storage.list_files(self.location)
        except Exception as e:
            with open(self._note, "w") as f:
                f.write(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
            raise
        for path in remote:
            name = path.rsplit("/", 1)[-1]
            if name.endswith(ENTRY_SUFFIX):
                with open(os.path.join(folder, name), "wb") as f:
                    f.write(storage.read_bytes(path))
        log.info("compilation cache: %d entries from %s", len(remote), self.location)

    def push(self) -> int:
        """Copies entries compiled here that the gs:// prefix lacks; returns how many. A failed upload is a
        warning (the next push tries the rest again), never the batch's failure."""
        if not self.remote or self.local is None:
            return 0
        uploaded = 0
        try:
            for name in sorted(set(_entries(self.local)) - self._pushed):
                with open(os.path.join(self.local, name), "rb") as f:
                    storage.write_bytes(f"{self.location}/{name}", f.read())
                self._pushed.add(name)
                uploaded += 1
        except Exception as e:  # noqa: BLE001  the executables are in the local cache already
            log.warning(
                "compilation cache %s: upload failed (%s: %s); this job's compilations stay local",
                self.location,
                type(e).__name__,
                " ".join(str(e).split())[:300],
            )
        return uploaded


def _entries(folder: str) -> list[str]:
    return [n for n in os.listdir(folder) if n.endswith(ENTRY_SUFFIX)] if os.path.isdir(folder) else []


def keep_every_compilation() -> None:
    """When JAX already has a persistent cache folder (JAX_COMPILATION_CACHE_DIR, as ``make run`` sets),
    keep every compilation in it: JAX's default keeps only those that took over a second, and docbeam's
    probes and shapes mostly compile faster than that, so a warm start would find none of them."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _use(folder: str) -> None:
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir != folder:
        compilation_cache.set_cache_dir(folder)
        compilation_cache.reset_cache()  # JAX opens its cache once per process: reopen it here
    # The encoder compiles a handful of shapes; each is worth keeping however fast it compiled here.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    # JAX's default also turns on XLA's GPU autotune cache inside the cache folder, which puts the local
    # folder's path into every entry's key: a machine whose folder differs would never hit.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")

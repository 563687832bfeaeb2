"""The engine cache's bound. Every exported shape holds the model's float32 weights twice on disk, in its IR and in
OpenVINO's compiled blob (MiniLM's 22.7M parameters: 90 MB and 87 MB measured; a 335M-parameter model: about
1.3 GB each at 4 bytes a parameter), and every change to the checkpoint, the
libraries or docbeam's models/ code exports every shape again under a new key. Unbounded, a developer's cache grew
by about 700 MB in two benchmark runs (2026-12-07): the hidden disk leak this project was started to avoid.

So after each fresh export the cache keeps its most recently used entries within ``MAX_BYTES``. An entry is one
key's IR pair (``<key>.xml`` and ``.bin``) with OpenVINO's compiled blobs for it (``compiled/<key>/``, the
``CACHE_DIR`` compile_model gives it); reading an entry marks it used (the xml's mtime). An entry used within
``MIN_AGE_S`` is never removed, whatever the bound: another process of the VM may be compiling from it, and a
model whose own shapes outgrow the bound must not evict them while it exports them. The same age rule clears what a
killed export child left: its temporary folders, and compiled blobs whose IR is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time

MAX_BYTES = 4 * 1024**3  # about 23 MiniLM shapes at 177 MB; a 335M-parameter model's shapes outgrow it (MIN_AGE_S)
MIN_AGE_S = 3600.0
COMPILED = "compiled"
log = logging.getLogger(__name__)


def mark_used(xml: str) -> None:
    """The entry was read: it is the most recently used (its xml's mtime)."""
    try:
        os.utime(xml)
    except OSError:  # a read-only cache is still a cache
        pass


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for folder, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(folder, n)) for n in names if os.path.isfile(os.path.join(folder, n)))
    return total


def entries(folder: str) -> dict[str, tuple[float, int]]:
    """key -> (last used, bytes) of each exported model in the engine cache."""
    found = {}
    for name in os.listdir(folder):
        if not name.endswith(".xml"):
            continue
        key = name[:-4]
        parts = [os.path.join(folder, name), os.path.join(folder, key + ".bin"), os.path.join(folder, COMPILED, key)]
        with contextlib.suppress(FileNotFoundError):  # another process of the VM pruned it meanwhile
            found[key] = (os.path.getmtime(parts[0]), sum(_size(p) for p in parts if os.path.exists(p)))
    return found


def remove(folder: str, key: str) -> None:
    """The xml first: a reader that sees no xml exports again; one that sees an xml finds its bin."""
    for path in (os.path.join(folder, key + ".xml"), os.path.join(folder, key + ".bin")):
        with contextlib.suppress(FileNotFoundError):  # another process of the VM pruned it meanwhile
            os.remove(path)
    shutil.rmtree(os.path.join(folder, COMPILED, key), ignore_errors=True)


def leftovers(folder: str, keys: set[str]) -> list[str]:
    """A killed export child's temporary folders, and compiled blobs whose IR is gone (or from before each key had
    its own folder)."""
    found = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("tmp")]
    compiled = os.path.join(folder, COMPILED)
    if os.path.isdir(compiled):
        found += [os.path.join(compiled, n) for n in os.listdir(compiled) if n not in keys]
    return found


def prune(folder: str, max_bytes: int = MAX_BYTES, min_age_s: float = MIN_AGE_S, now: float | None = None) -> list:
    """Removes the least recently used entries not used within ``min_age_s`` until the cache fits ``max_bytes``,
    and the leftovers older than that; returns the keys and paths removed. Only saves disk: a failure is a
    warning."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        found = entries(folder)
        for path in leftovers(folder, set(found)):
            with contextlib.suppress(FileNotFoundError):
                if now - os.path.getmtime(path) > min_age_s:
                    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
                    removed.append(path)
        total = sum(size for _, size in found.values())
        for key, (used, size) in sorted(found.items(), key=lambda item: item[1][0]):
            if total <= max_bytes or now - used <= min_age_s:
                break
            remove(folder, key)
            removed.append(key)
            total -= size
    except OSError as e:
        log.warning("engine cache %s cannot be pruned (%s: %s)", folder, type(e).__name__, e)
    if removed:
        log.info("engine cache %s: removed %d least recently used entries and leftovers", folder, len(removed))
    return removed

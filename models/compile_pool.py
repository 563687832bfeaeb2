"""Compile an encoder's shapes ahead of its batches, in background threads.

Needed since a first batch of each (rows, bucket) shape would otherwise wait for its compilation: XLA
compiles without the GIL, so threads overlap the compilations with reading and tokenizing. A batch whose
shape has not started compiling yet compiles it itself rather than wait behind the others.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any, Callable

Key = tuple[str, tuple[int, int]]  # (backend, (rows, bucket_len))


class CompilePool:
    """One future per planned (backend, shape); ``compile_one(backend, shape) -> (executable, record)``."""

    def __init__(self, compile_one: Callable[[str, tuple[int, int]], tuple[Any, dict]], keys: list[Key]):
        self._compile_one = compile_one
        self._lock = threading.Lock()  # the background threads add to the finished records
        self._finished: list[dict] = []  # compiled ahead, not yet reported
        self._futures: dict[Key, concurrent.futures.Future] = {}
        self._pool = None
        if keys:
            # One core fewer than the machine has: the worker's own stages (reading, tokenizing, and on the
            # DirectRunner all of Beam) keep one, or they would wait behind the compilations they overlap.
            workers = max(1, min(len(keys), (os.cpu_count() or 2) - 1))
            self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="docbeam-compile")
        for key in keys:
            self._futures[key] = self._pool.submit(self._in_background, *key)

    def planned(self, key: Key) -> bool:
        return key in self._futures

    def pending(self) -> int:
        """Compilations ahead still running or waiting their turn."""
        return sum(not future.done() for future in self._futures.values())

    def _in_background(self, backend: str, shape: tuple[int, int]):
        executable, record = self._compile_one(backend, shape)
        with self._lock:
            self._finished.append(record)
        return executable

    def executable(self, key: Key):
        """(the executable, seconds waited for it) for a planned shape, or (None, 0.0) for one that is not;
        a shape whose turn has not come is compiled here, in the calling thread (its batch's compilation)."""
        future = self._futures.get(key)
        if future is None:
            return None, 0.0
        if future.cancel():
            executable, _ = self._compile_one(*key)
            future = self._futures[key] = concurrent.futures.Future()
            future.set_result(executable)
            return executable, 0.0
        if future.done():
            return future.result(), 0.0
        t0 = time.perf_counter()
        executable = future.result()
        return executable, time.perf_counter() - t0

    def stop(self) -> None:
        """Drop the compilations not started yet; a batch that comes later compiles its shape itself."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def wait(self) -> None:
        for future in list(self._futures.values()):
            if not future.cancelled():
                future.result()

    def take_finished(self) -> list[dict]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

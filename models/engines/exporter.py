"""The export process: one child per worker process, started by the first export and kept while exports come.

Why a child at all: models/engines/export.py (jax2onnx swaps jax.numpy functions process-wide while it traces).
Why one kept child rather than one per shape: a child's start (importing JAX, jax2onnx and OpenVINO, and
jax2onnx's first conversion) is most of an export. A tiny model's shape took 6.8-7.2 s in a child of its own and
0.6 s as the second export of a kept child (the export itself, in one process: 4.2 s, then 0.6 s), so a worker
that exports its buckets' shapes at start pays the start once. Why not forever: an idle child would keep what a
large model's export left in its heap for the worker's whole life, so it exits after ``IDLE_S`` without an export,
and after any failed export (its state is then unknown); the next export starts another.

Requests go to the child's stdin (a length and a pickle); replies come back as one JSON line on the child's
original stdout, which it keeps apart from what its libraries print (models/engines/export.py ``main``).
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Any

EXPORT_TIMEOUT_S = 1800  # a large model's trace and conversion take minutes; a hung child must not hang the worker
IDLE_S = 60.0  # the compile pool exports a worker's shapes back to back; a late shape may start a child again
HEADER = struct.Struct("<Q")  # the pickled request's length


class Exporter:
    """The kept export child of this process; ``export`` is thread-safe (one export at a time)."""

    def __init__(self, idle_s: float = IDLE_S, timeout_s: float = EXPORT_TIMEOUT_S):
        self.idle_s = idle_s
        self.timeout_s = timeout_s
        self.started = 0  # children started so far
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stderr: Any = None  # the child's stderr, a temporary file: the tail goes into a failure's reason
        self._timer: threading.Timer | None = None
        self._exports = 0  # exports asked so far: an idle timer armed after an earlier one does nothing

    def export(self, request: tuple) -> None:
        """Sends ``request`` ((Recipe, layout, folder, key)) to the child and waits for its IR to be written;
        raises RuntimeError with the child's reason when it could not export, died or took too long."""
        data = pickle.dumps(request)  # a request that cannot be sent costs no child
        with self._lock:
            self._exports += 1
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            try:
                reply = self._ask(self._child(), data)
            except BaseException:
                self._close(kill=True)  # hung, dead or interrupted: nothing it would still write is wanted
                raise
            if not reply.get("ok"):
                self._close()
                raise RuntimeError(reply.get("error") or f"the export process replied {reply}")
            self._timer = threading.Timer(self.idle_s, self._close_if_idle, args=(self._exports,))
            self._timer.daemon = True
            self._timer.start()

    def running(self) -> bool:
        with self._lock:
            return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        with self._lock:
            self._close()

    def _child(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._close()
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "docbeam.models.engines.export"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},  # the child never takes the worker's accelerator
        )
        self.started += 1
        return self._proc

    def _ask(self, proc: subprocess.Popen, data: bytes) -> dict:
        try:
            proc.stdin.write(HEADER.pack(len(data)) + data)
            proc.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(self._died(proc)) from None
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
        if not ready:
            raise RuntimeError(f"the export process took longer than {self.timeout_s:g} s (stopped)")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(self._died(proc))
        return json.loads(line)

    def _died(self, proc: subprocess.Popen) -> str:
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        return f"the export process exited {code}: {self._stderr_tail()}"

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - 4000))
        return " ".join(self._stderr.read().decode(errors="replace").split())[-300:]

    def _close_if_idle(self, exports: int) -> None:
        with self._lock:
            if self._exports == exports:  # no export since the one that armed this timer
                self._close()

    def _close(self, kill: bool = False) -> None:
        """Ends the child: EOF on its stdin (it exits once its export is done), killed if it has not within 10 s,
        or at once with ``kill``."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        proc, self._proc = self._proc, None
        if proc is not None:
            if kill:
                proc.kill()
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def forget(self) -> None:
        """After a fork: the child and its pipes are the parent's, so this process starts its own."""
        self._lock = threading.Lock()
        self._proc, self._stderr, self._timer = None, None, None


EXPORTER = Exporter()
atexit.register(EXPORTER.close)
os.register_at_fork(after_in_child=EXPORTER.forget)

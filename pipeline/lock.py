"""One writer per output: a lock object under the output, with the owner and a heartbeat.

A second run into an output that a live run is writing is refused at start, naming that run. A lock is
stale, and taken over with a warning, when its owner is provably gone (same host, process not alive) or
its heartbeat is older than ``STALE_AFTER_S``; ``--force`` takes over any lock. Before the commit the
run checks that the lock still names it, so a run whose lock was taken never commits.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import threading
import time

import psutil

from pipeline import storage
from pipeline.errors import Refused

LOCK_NAME = "_lock.json"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0  # ten missed heartbeats and more: the owner is gone (README "Runs and commits")
log = logging.getLogger(__name__)


class LockHeld(Refused):
    """Another live run writes this output: refuse at start."""


class LockLost(RuntimeError):
    """This run's lock now names another run (taken over with --force or as stale): never commit."""


@dataclasses.dataclass(frozen=True)
class Owner:
    run_id: str
    host: str
    pid: int
    process_started: float  # guards against a reused pid
    heartbeat: float  # epoch seconds

    @classmethod
    def me(cls, run_id: str) -> "Owner":
        return cls(run_id, socket.gethostname(), os.getpid(), psutil.Process().create_time(), time.time())

    def to_bytes(self) -> bytes:
        record = dataclasses.asdict(self)
        record["heartbeat_at"] = datetime.datetime.fromtimestamp(self.heartbeat, datetime.timezone.utc).isoformat()
        return json.dumps(record, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Owner":
        raw = json.loads(data)
        return cls(str(raw["run_id"]), str(raw["host"]), int(raw["pid"]), float(raw["process_started"]),
                   float(raw["heartbeat"]))

    def who(self) -> str:
        age = time.time() - self.heartbeat
        return f"run {self.run_id} (host {self.host}, pid {self.pid}, last heartbeat {age:.0f} s ago)"


def why_stale(owner: Owner, now: float, host: str) -> str | None:
    """Why the owner is provably gone, or None while it may be alive."""
    if now - owner.heartbeat > STALE_AFTER_S:
        return f"its heartbeat is {now - owner.heartbeat:.0f} s old (stale after {STALE_AFTER_S:.0f} s)"
    if owner.host == host and not _alive(owner.pid, owner.process_started):
        return f"its process {owner.pid} on this host is no longer running"
    return None


def _alive(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def read_owner(path: str) -> Owner | None:
    data = storage.read_bytes(path) if storage.exists(path) else None
    if data is None:
        return None
    try:
        return Owner.from_bytes(data)
    except (ValueError, KeyError, TypeError):
        # A torn or foreign lock object: treat it as held by nobody alive, but say so.
        log.warning("%s is not a docbeam lock record; treating it as stale", path)
        return Owner("unknown", "unknown", -1, 0.0, 0.0)


class OutputLock:
    """Acquire with ``OutputLock.acquire(output, run_id, force)``; ``release()`` when the run ends."""

    def __init__(self, path: str, owner: Owner):
        self.path, self.owner = path, owner
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, output: str, run_id: str, *, force: bool = False) -> "OutputLock":
        path = storage.join(output, LOCK_NAME)
        me = Owner.me(run_id)
        for _ in range(3):  # a lock released or taken over between our read and our create: look again
            current = read_owner(path)
            if current is not None:
                reason = why_stale(current, time.time(), me.host) or ("--force" if force else None)
                if reason is None:
                    raise LockHeld(f"output {output} is being written by {current.who()}; wait for it, or "
                                   f"pass --force if you know it is gone (a lock is stale after "
                                   f"{STALE_AFTER_S:.0f} s without a heartbeat)")
                log.warning("taking over the output lock of %s: %s", current.who(), reason)
                if read_owner(path) != current:
                    continue
                storage.delete_files([path])
            if storage.create_exclusive(path, me.to_bytes()) and read_owner(path) == me:
                lock = cls(path, me)
                lock._start_heartbeat()
                return lock
        raise LockHeld(f"output {output}: another run took the lock at the same moment "
                       f"({(read_owner(path) or me).who()})")

    def check(self) -> None:
        """Raise LockLost unless the lock still names this run."""
        check_owner(self.path, self.owner.run_id)

    def release(self) -> None:
        self.hand_over()
        release_if_owner(self.path, self.owner.run_id)

    def hand_over(self) -> None:
        """Stop the heartbeat and leave the lock to the job, whose commit releases it (a driver that does
        not wait for its job; the lock turns stale after STALE_AFTER_S if the job dies)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="docbeam-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                current = read_owner(self.path)
                if current is None or current.run_id != self.owner.run_id:
                    return  # released by the commit, or taken over: the commit's own check decides
                self.owner = dataclasses.replace(self.owner, heartbeat=time.time())
                storage.write_bytes(self.path, self.owner.to_bytes())
            except Exception as e:  # noqa: BLE001  a missed beat is not a failed run; staleness is judged by age
                log.warning("could not renew the output lock %s: %s", self.path, e)


def check_owner(lock_path: str, run_id: str) -> None:
    current = read_owner(lock_path)
    if current is None or current.run_id != run_id:
        holder = current.who() if current else "nobody"
        raise LockLost(f"the output lock {lock_path} is held by {holder}, not by this run {run_id}; "
                       "refusing to commit")


def release_if_owner(lock_path: str, run_id: str) -> None:
    current = read_owner(lock_path)
    if current is not None and current.run_id == run_id:
        storage.delete_files([lock_path])

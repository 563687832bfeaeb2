"""One writer per output: a lock object under the output, with the owner, a heartbeat and a fencing token.

A second run into an output that a live run is writing is refused at start, naming that run. A lock is
stale, and taken over with a warning, when its owner is provably gone (same host, process not alive) or
its heartbeat is older than ``STALE_AFTER_S``; ``--force`` takes over any lock. Every change of the lock is
a conditional write (pipeline/store/versioned.write_if) from the version just read, so of any number of runs
racing for it exactly one wins. The lock names its holder by run id and token (the token grows by one at
each takeover): the ``Fence`` the commit carries proves, before each step, that the lock still names it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import socket
import threading
import time
from typing import Callable

import psutil

from docbeam.errors import Refused
from docbeam.pipeline.store import storage, versioned
from docbeam.pipeline.store.output import LOCK

HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0  # ten missed heartbeats and more: the owner is gone (README "Runs and commits")
RUNNING, COMMITTED = "running", "committed"
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
    token: int = 0  # the fencing token: one more than the lock this one took over
    state: str = RUNNING  # COMMITTED once the run passed its commit point: a successor must finish that commit
    pending: str | None = None  # a run whose commit point passed and that may not have finished: finish it first

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
        pending = raw.get("pending")
        for key in ("process_started", "heartbeat"):  # NaN would never go stale; a lock must say a time
            if not isinstance(raw[key], (int, float)) or isinstance(raw[key], bool) or not math.isfinite(raw[key]):
                raise ValueError(f"{key} is {raw[key]!r}, not a time")
        if not isinstance(raw["pid"], int) or isinstance(raw["pid"], bool):
            raise ValueError(f"pid is {raw['pid']!r}, not a process id")
        return cls(
            str(raw["run_id"]),
            str(raw["host"]),
            int(raw["pid"]),
            float(raw["process_started"]),
            float(raw["heartbeat"]),
            int(raw.get("token", 0)),
            str(raw.get("state", RUNNING)),
            None if pending is None else str(pending),
        )

    def who(self) -> str:
        age = time.time() - self.heartbeat
        return f"run {self.run_id} (host {self.host}, pid {self.pid}, last heartbeat {age:.0f} s ago)"


def why_stale(owner: Owner, now: float, host: str) -> str | None:
    """Why the owner is provably gone, or None while it may be alive."""
    if now - owner.heartbeat > STALE_AFTER_S:
        return f"its heartbeat is {now - owner.heartbeat:.0f} s old (stale after {STALE_AFTER_S:.0f} s)"
    if owner.heartbeat - now > STALE_AFTER_S:  # a clock hours ahead, or a garbled 1e11: it would never go stale
        return f"its heartbeat is {owner.heartbeat - now:.0f} s in the future (more than {STALE_AFTER_S:.0f} s)"
    if owner.host == host and not _alive(owner.pid, owner.process_started):
        return f"its process {owner.pid} on this host is no longer running"
    return None


def _alive(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def parse_owner(data: bytes | None, path: str) -> Owner | None:
    if data is None:
        return None
    try:
        return Owner.from_bytes(data)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        # A torn, foreign or garbled lock object: treat it as held by nobody alive, but say so.
        log.warning("%s is not a docbeam lock record; treating it as stale", path)
        return Owner("unknown", "unknown", -1, 0.0, 0.0)


def read_owner(path: str) -> Owner | None:
    return parse_owner(versioned.read_versioned(path)[0], path)


@dataclasses.dataclass(frozen=True)
class Fence:
    """What a run's commit carries to prove, step by step, that the output's lock still names it."""

    output: str
    run_id: str
    token: int
    # The lock record this fence last wrote and its version: the next step writes from it without reading
    # first (one request on gs://); if anything wrote since, that write fails and the step reads again.
    _last: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def path(self) -> str:
        return storage.join(self.output, LOCK)

    def check(self) -> Owner:
        """Raise LockLost unless the lock names this run and token."""
        current = read_owner(self.path)
        self._raise_unless_mine(current)
        return current

    def prove(self) -> Owner:
        """Renew the heartbeat by a conditional write: the lock named this run at the instant it was written."""
        return self.update(lambda owner: owner)

    def commit_point(self) -> Owner:
        """The commit point: from here on, whoever holds the lock next finishes this run's commit."""
        return self.update(lambda owner: dataclasses.replace(owner, state=COMMITTED))

    def settled(self) -> Owner:
        """The pending commit of a previous holder is finished: stop carrying it."""
        return self.update(lambda owner: dataclasses.replace(owner, pending=None))

    def update(self, change: Callable[[Owner], Owner]) -> Owner:
        if self._last:
            ((current, version),) = self._last
            if (new := self._write(change(current), version)) is not None:
                return new
        for _ in range(8):  # our own heartbeat may have written in between: read again
            data, version = versioned.read_versioned(self.path)
            current = parse_owner(data, self.path)
            self._raise_unless_mine(current)
            if (new := self._write(change(current), version)) is not None:
                return new
        raise LockLost(f"the output lock {self.path} kept changing under run {self.run_id}; refusing to go on")

    def _write(self, owner: Owner, version: object) -> Owner | None:
        new = dataclasses.replace(owner, heartbeat=time.time())
        written, new_version = versioned.write_versioned(self.path, new.to_bytes(), version)
        self._last[:] = [(new, new_version)] if written and new_version is not None else []
        return new if written else None

    def release(self) -> bool:
        """Delete the lock if it still names this run; True when it did."""
        data, version = versioned.read_versioned(self.path)
        current = parse_owner(data, self.path)
        if current is None or (current.run_id, current.token) != (self.run_id, self.token):
            return False
        return versioned.delete_if(self.path, version)

    @contextlib.contextmanager
    def failing_as_lost(self):
        """An error raised while the lock names another run is that takeover's doing (a file moved or deleted
        under this run): report it as LockLost, which is what the operator needs to know."""
        try:
            yield
        except Exception as error:
            lost = self.taken_over(error)
            if lost is not None:
                raise lost from error
            raise

    def taken_over(self, error: Exception) -> LockLost | None:
        """The LockLost to report instead of ``error`` when the lock no longer names this run."""
        if isinstance(error, LockLost):
            return None
        try:
            self.check()
        except LockLost as lost:
            return lost
        except Exception:  # noqa: BLE001  the lock cannot be read: report the original error
            return None
        return None

    def _raise_unless_mine(self, current: Owner | None) -> None:
        if current is None or (current.run_id, current.token) != (self.run_id, self.token):
            holder = current.who() if current else "nobody"
            raise LockLost(
                f"the output lock {self.path} is held by {holder}, not by this run {self.run_id} "
                f"(token {self.token}); refusing to change the output"
            )


class OutputLock:
    """Acquire with ``OutputLock.acquire(output, run_id, force)``; ``release()`` when the run ends."""

    def __init__(self, output: str, owner: Owner, taken_from: Owner | None, owner_dead: bool):
        self.owner = owner
        self.fence = Fence(output, owner.run_id, owner.token)
        self.path = self.fence.path
        self.taken_from = taken_from  # the lock this one replaced, if any
        self.owner_dead = owner_dead  # whether that lock's run is provably gone (not merely forced or silent)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(
        cls, output: str, run_id: str, *, force: bool = False, owner: Owner | None = None, heartbeat: bool = True
    ) -> "OutputLock":
        """``owner``: who takes the lock (default: this process; a test names a dead process's run)."""
        path = storage.join(output, LOCK)
        me = owner or Owner.me(run_id)
        for _ in range(3):  # a lock released or taken between our read and our write: look again
            data, version = versioned.read_versioned(path)
            current = parse_owner(data, path)
            mine = dataclasses.replace(me, token=1)
            dead = False
            if current is not None:
                stale = why_stale(current, time.time(), me.host)
                if stale is None and not force:
                    raise LockHeld(
                        f"output {output} is being written by {current.who()}; wait for it, or "
                        f"pass --force if you know it is gone (a lock is stale after "
                        f"{STALE_AFTER_S:.0f} s without a heartbeat)"
                    )
                dead = stale is not None and (
                    current.pid < 0 or (current.host == me.host and not _alive(current.pid, current.process_started))
                )
                pending = current.run_id if current.state == COMMITTED else current.pending
                mine = dataclasses.replace(me, token=current.token + 1, pending=pending)
            if versioned.write_if(path, mine.to_bytes(), version):
                if current is not None:
                    log.warning("taking over the output lock of %s: %s", current.who(), stale or "--force")
                lock = cls(output, mine, current, dead)
                if heartbeat:
                    lock._start_heartbeat()
                return lock
        current = read_owner(path)
        raise LockHeld(
            f"output {output}: another run took the lock at the same moment "
            f"({current.who() if current else 'and released it'})"
        )

    def check(self) -> None:
        """Raise LockLost unless the lock still names this run."""
        self.fence.check()

    def release(self) -> None:
        self.hand_over()
        self.fence.release()

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
        def renew(owner: Owner) -> Owner:
            if owner.state != RUNNING:
                raise LockLost("committing")  # the commit owns the lock now: stop beating
            return owner

        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.fence.update(renew)
            except LockLost:
                return  # taken over, released or committing: the commit's own checks decide
            except Exception as e:  # noqa: BLE001  a missed beat is not a failed run; staleness is judged by age
                log.warning("could not renew the output lock %s: %s", self.path, e)

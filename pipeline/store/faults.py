"""Crash and pause points in the storage layer: every write, rename and delete of ``pipeline/store/storage.py``
calls ``before_change`` first, so a test can kill a run (or stop it) just before its N-th change.

Needed since a commit and a lock are long sequences of changes to shared storage, and only walking every
instant between them shows that each one leaves an output the next run can recover. A plan applies to the
thread that installed it (a concurrent run in another thread is not counted) unless ``every_thread``: the
end-to-end test's commit runs in a Beam worker thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Iterator


class SimulatedKill(BaseException):
    """The process died here, as with kill -9: a BaseException so that no ``except Exception`` clean-up runs,
    and every later change by the same run raises it again (a dead process changes nothing)."""


@dataclasses.dataclass
class FaultPlan:
    """Kill (``crash_at``) or pause (``pause_at``) a run just before its N-th change (0-based), counting
    only changes ``counts(op, path)`` accepts. A paused run sets ``paused`` and waits for ``resume``."""

    crash_at: int | None = None
    pause_at: int | None = None
    counts: Callable[[str, str], bool] = lambda op, path: True
    every_thread: bool = False
    changes: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    paused: threading.Event = dataclasses.field(default_factory=threading.Event)
    resume: threading.Event = dataclasses.field(default_factory=threading.Event)
    dead: bool = False
    thread: int | None = None

    def before(self, op: str, path: str) -> None:
        if self.dead:
            raise SimulatedKill(f"{op} {path} after the run was killed")
        if not self.counts(op, path):
            return
        n = len(self.changes)
        self.changes.append((op, path))
        if n == self.crash_at:
            self.dead = True
            raise SimulatedKill(f"killed before change {n}: {op} {path}")
        if n == self.pause_at:
            self.paused.set()
            if not self.resume.wait(timeout=300):
                raise TimeoutError(f"paused before change {n} ({op} {path}) and never resumed")


_plans: list[FaultPlan] = []
_plans_lock = threading.Lock()


@contextlib.contextmanager
def injected(plan: FaultPlan) -> Iterator[FaultPlan]:
    """Apply ``plan`` to this thread's changes (or every thread's) until the block ends."""
    plan.thread = None if plan.every_thread else threading.get_ident()
    with _plans_lock:
        _plans.append(plan)
    try:
        yield plan
    finally:
        with _plans_lock:
            _plans.remove(plan)


def before_change(op: str, path: str) -> None:
    """Called by the storage layer before it changes anything: ``op`` is write, rename, copy or delete."""
    if not _plans:
        return
    me = threading.get_ident()
    with _plans_lock:
        plans = [p for p in _plans if p.thread in (None, me)]
    for plan in plans:
        plan.before(op, path)

"""pipeline/store/lock.py: one writer per output; a dead owner's lock is taken over, a live one's never."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid

import pytest
from gcs_emulator import gcs_emulator

from docbeam.pipeline.store import lock, output, storage, transaction


def lock_path(out) -> str:
    return storage.join(str(out), output.LOCK)


def test_a_second_run_is_refused_naming_the_live_owner(tmp_path):
    first = lock.OutputLock.acquire(str(tmp_path), "run-A")
    try:
        with pytest.raises(lock.LockHeld, match=rf"being written by run run-A \(host .*, pid {os.getpid()}\b"):
            lock.OutputLock.acquire(str(tmp_path), "run-B")
        assert lock.read_owner(lock_path(tmp_path)).run_id == "run-A"  # the refused run changed nothing
    finally:
        first.release()
    assert not storage.exists(lock_path(tmp_path))


def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owner = dataclasses.replace(lock.Owner.me("run-dead"), pid=dead.pid)
    storage.write_bytes(lock_path(tmp_path), owner.to_bytes())
    taken = lock.OutputLock.acquire(str(tmp_path), "run-new")
    try:
        assert lock.read_owner(lock_path(tmp_path)).run_id == "run-new"
        assert "is no longer running" in caplog.text and "run-dead" in caplog.text
    finally:
        taken.release()


def test_a_reused_pid_does_not_keep_a_dead_owners_lock():
    me = lock.Owner.me("run-old")
    reused = dataclasses.replace(me, process_started=me.process_started - 3600)
    assert lock.why_stale(reused, time.time(), me.host) == f"its process {me.pid} on this host is no longer running"
    assert lock.why_stale(me, time.time(), me.host) is None


def test_a_lock_from_another_host_is_stale_only_after_its_heartbeat_ages():
    other = dataclasses.replace(lock.Owner.me("run-X"), host="elsewhere", pid=1)
    assert lock.why_stale(other, other.heartbeat + lock.STALE_AFTER_S - 1, "here") is None
    assert "heartbeat is" in lock.why_stale(other, other.heartbeat + lock.STALE_AFTER_S + 1, "here")


def test_a_heartbeat_far_in_the_future_is_stale_not_a_lock_held_forever():
    """A driver whose clock is hours ahead, or a garbled 1e11, would never age: more than STALE_AFTER_S ahead is
    stale; a few seconds of clock skew is not."""
    now = time.time()
    ahead = dataclasses.replace(lock.Owner.me("run-X"), host="elsewhere", pid=1, heartbeat=1e11)
    assert "in the future" in lock.why_stale(ahead, now, "here")
    skewed = dataclasses.replace(ahead, heartbeat=now + 5)
    assert lock.why_stale(skewed, now, "here") is None


def test_force_takes_over_a_live_lock_and_the_loser_cannot_commit(tmp_path):
    out = str(tmp_path)
    first = lock.OutputLock.acquire(out, "run-A")
    staged = f"{output.staging_dir(out, 'run-A')}/embeddings/part-run-A-00000-of-00001.parquet"
    storage.write_bytes(staged, b"run-A's rows")
    second = lock.OutputLock.acquire(out, "run-B", force=True)
    try:
        with pytest.raises(lock.LockLost, match="held by run run-B.*not by this run run-A"):
            first.check()
        with pytest.raises(lock.LockLost, match="held by run run-B.*not by this run run-A"):
            transaction.commit(out, first.fence, [staged], {"run_id": "run-A"}, {})
        assert not any(storage.exists(storage.join(out, name)) for name in transaction.POINTERS)
        assert storage.read_bytes(staged) == b"run-A's rows"  # not moved into the output
        second.check()
    finally:
        first.release()  # must not remove run-B's lock
        assert lock.read_owner(lock_path(tmp_path)).run_id == "run-B"
        second.release()


def test_the_heartbeat_renews_the_lock_while_the_run_lives(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    held = lock.OutputLock.acquire(str(tmp_path), "run-A")
    try:
        first = lock.read_owner(lock_path(tmp_path)).heartbeat
        deadline = time.monotonic() + 10  # a starved thread on a loaded machine beats late, not never
        while lock.read_owner(lock_path(tmp_path)).heartbeat <= first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.read_owner(lock_path(tmp_path)).heartbeat > first
    finally:
        held.release()


def test_a_garbled_lock_is_treated_as_stale_not_as_a_crash(tmp_path):
    storage.write_bytes(lock_path(tmp_path), b"{half a json")
    held = lock.OutputLock.acquire(str(tmp_path), "run-A")
    assert lock.read_owner(lock_path(tmp_path)).run_id == "run-A"
    held.check()
    held.release()
    assert not storage.exists(lock_path(tmp_path))


GOOD_FIELDS = '"run_id": "run-X", "host": "elsewhere", "process_started": 1.0, "token": 3'


@pytest.mark.parametrize(
    "record",
    [
        "{" + GOOD_FIELDS + ', "pid": 1e400, "heartbeat": 1.0}',  # a pid past any int: was an OverflowError
        "{" + GOOD_FIELDS + ', "pid": 7, "heartbeat": NaN}',  # NaN never went stale: every run refused
        "{" + GOOD_FIELDS + ', "pid": 7, "heartbeat": "soon"}',
        "{" + GOOD_FIELDS + ', "pid": true, "heartbeat": 1.0}',
        "[1, 2]",
    ],
)
def test_a_lock_whose_fields_are_not_what_a_lock_says_is_stale_not_a_crash_or_a_block(tmp_path, record):
    storage.write_bytes(lock_path(tmp_path), record.encode())
    assert lock.read_owner(lock_path(tmp_path)).run_id == "unknown"
    held = lock.OutputLock.acquire(str(tmp_path), "run-A")
    assert lock.read_owner(lock_path(tmp_path)).run_id == "run-A"
    held.release()


@pytest.mark.gcs
def test_on_gcs_a_second_run_is_refused_and_a_released_lock_is_gone():
    # The emulator honours generation preconditions (tests/gcs_emulator_server.py), as GCS does.
    with gcs_emulator() as gcs:
        storage.pipeline_options()
        out = gcs.url(f"out-{uuid.uuid4().hex[:8]}")
        first = lock.OutputLock.acquire(out, "run-A")
        with pytest.raises(lock.LockHeld, match="being written by run run-A"):
            lock.OutputLock.acquire(out, "run-B")
        first.release()
        assert not storage.exists(lock_path(out))
        lock.OutputLock.acquire(out, "run-B").release()

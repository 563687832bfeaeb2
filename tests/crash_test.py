"""The commit and the lock, killed or paused before every one of their changes to storage.

A run here is what the driver and the job do around the pipeline (lock, recover, mark the staging folder,
the sinks' files, commit, release), driven directly so that each of its few dozen changes can be the one
before which it dies (pipeline/store/faults.py) or stops while a ``--force`` run takes the output over. After
each: a reader of the manifest sees a whole run, the next run recovers exactly the old run or exactly the
new one (bytes, manifest, ``_SUCCESS``, ``summary.json`` agree), commits its own, and leaves no stray file.
On local disk and on the GCS emulator (with generation preconditions: tests/gcs_emulator_server.py): every
point locally; on the emulator a sample that walks every kind of step (``walked_points``), every point under
`make test-all`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import uuid

import pytest
from conftest import TEST_ALL_ENV
from crash_fixtures import (
    POINTERS,
    Outputs,
    a_run,
    assert_a_reader_sees_a_whole_run,
    changes_of_a_clean_run,
    clear,
    every_file,
    holds_exactly,
    holds_exactly_but_staging_of,
    step_kind,
    walked_points,
)
from gcs_emulator import gcs_emulator

from docbeam.pipeline.store import output, storage, transaction
from docbeam.pipeline.store.faults import FaultPlan, SimulatedKill, injected
from docbeam.pipeline.store.lock import LockHeld, LockLost, OutputLock, Owner

# `make test-extra CRASH_POINTS=sample` (CI, for time) walks the emulator's sample of every kind of step, not every point.
CRASH_POINTS_ENV = "DOCBEAM_CRASH_POINTS"


@pytest.fixture(scope="module")
def emulator():
    with gcs_emulator() as server:
        storage.pipeline_options()
        yield server


@pytest.fixture(params=["local", pytest.param("gcs", marks=[pytest.mark.gcs, pytest.mark.slow, pytest.mark.extra])])
def new_output(request, tmp_path) -> Outputs:
    """Makes a fresh output folder per call: one per crash point."""
    if request.param == "local":
        return Outputs(lambda: str(tmp_path / uuid.uuid4().hex[:8]), sampled=False)
    server = request.getfixturevalue("emulator")
    # Only the word `sample` samples: a misspelt value walks every point rather than quietly checking less.
    every = os.environ.get(TEST_ALL_ENV) and os.environ.get(CRASH_POINTS_ENV) != "sample"
    return Outputs(lambda: server.url(f"crash-{uuid.uuid4().hex[:8]}"), sampled=not every)


@pytest.fixture(scope="module")
def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_walked_points_sampled_cover_every_kind_of_step_and_the_named_boundaries():
    changes = [
        ("write", "_lock.json"),
        ("write", "_staging/r/a.tmp-1"),
        ("copy", "_staging/r/a"),
        ("delete", "_staging/r/a.tmp-1"),
        ("write", "_lock.json"),
        ("copy", "embeddings/a"),
        ("copy", "embeddings/b"),
        ("copy", "embeddings/c"),
        ("copy", "_manifest.json"),
        ("delete", "embeddings/old"),
        ("delete", "_lock.json"),
    ]
    sample = walked_points(changes, sampled=True, must={6, 99})
    assert {step_kind(*changes[n]) for n in sample} == {step_kind(*c) for c in changes}
    assert sample == [0, 1, 2, 3, 5, 6, 8, 9, 10]
    assert walked_points(changes, sampled=False) == list(range(len(changes)))


def test_a_run_killed_before_any_of_its_changes_leaves_the_old_or_the_new_run_and_the_next_run_recovers(
    new_output, dead_pid
):
    changes = changes_of_a_clean_run(new_output)
    assert len(changes) >= 30, changes  # the crash points number in the dozens
    recovered = {}

    def killed_at(n):
        out = new_output.with_old_run()
        killed = dataclasses.replace(Owner.me("new"), pid=dead_pid)  # the run's process is gone, as after kill -9
        with injected(FaultPlan(crash_at=n)), pytest.raises(SimulatedKill):
            a_run(out, "new", owner=killed)
        assert_a_reader_sees_a_whole_run(out, "old", "new")

        held = OutputLock.acquire(out, "next", heartbeat=False)  # not forced: the dead run's lock is stale
        transaction.recover(out, held)
        held.release()
        survivor = "old" if holds_exactly(out, "old") else "new"
        assert holds_exactly(out, survivor), (n, changes[n], every_file(out).keys())
        recovered[n] = survivor
        a_run(out, "next")
        assert holds_exactly(out, "next"), (n, changes[n], every_file(out).keys())
        clear(out)

    for n in walked_points(changes, new_output.sampled):
        killed_at(n)
    # Sampled, the commit point lies between the last point the old run survived and the first the new one
    # did: every point in between is walked, so the commit point is found exactly either way.
    last_old = max((n for n, r in recovered.items() if r == "old"), default=-1)
    for n in range(last_old + 1, min((n for n, r in recovered.items() if r == "new"), default=len(changes))):
        killed_at(n)
    points = sorted(recovered)
    commit_point = min(n for n in points if recovered[n] == "new")  # before it the old run survives, from it the new
    assert [recovered[n] for n in points] == ["old" if n < commit_point else "new" for n in points]
    assert commit_point - 1 in recovered
    assert changes[commit_point - 1] in (("rename", output.LOCK), ("write", output.LOCK))


def test_a_run_paused_before_any_of_its_changes_while_a_forced_run_takes_over_changes_nothing_after(new_output):
    changes = changes_of_a_clean_run(new_output)
    success_written = max(i for i, (op, rel) in enumerate(changes) if rel == "_SUCCESS" and op != "delete")
    locked = min(i for i, (op, rel) in enumerate(changes) if rel == output.LOCK and op != "delete")
    boundaries = {locked, locked + 1, success_written, success_written + 1}
    for n in walked_points(changes, new_output.sampled, must=boundaries):
        out = new_output.with_old_run()
        plan = FaultPlan(pause_at=n)
        outcome = {}

        def paused_run(plan=plan, out=out, outcome=outcome):
            with injected(plan):
                try:
                    outcome["result"] = a_run(out, "slow")
                except (LockLost, LockHeld) as e:
                    outcome["result"] = e

        slow = threading.Thread(target=paused_run)
        slow.start()
        assert plan.paused.wait(timeout=60), f"the run never reached change {n}"
        a_run(out, "forced", force=True)
        plan.resume.set()
        slow.join(timeout=60)
        assert not slow.is_alive()
        result = outcome["result"]
        if n <= locked:  # stopped before it held the lock: it takes the lock the forced run released
            assert isinstance(result, dict) and holds_exactly(out, "slow"), (n, changes[n], result)
        else:  # overtaken: it fails (or had finished its commit) and the forced run's output stands
            assert isinstance(result, LockLost) or n > success_written, (n, changes[n], result)
            assert holds_exactly_but_staging_of(out, "forced", "slow"), (n, changes[n], every_file(out).keys())
        a_run(out, "next")
        assert holds_exactly(out, "next"), (n, changes[n], every_file(out).keys())
        clear(out)


# Every race is forced, not hoped for: all forty read the stale lock before any of them writes (pause_at=0),
# so a lock that admits two owners fails the first race. Checked by breaking it: with the emulator ignoring
# ifGenerationMatch on uploads, or the local write renaming without comparing under the flock, one race
# failed in 3 of 3 runs, on both stale kinds. The second race is margin for thread scheduling; five only
# repeated the same interleaving at ~4 s a race on the emulator.
RACES = 2


@pytest.mark.parametrize("stale", ["garbled", "dead owner"])
def test_forty_racers_for_a_stale_lock_exactly_one_acquires_every_time(new_output, dead_pid, stale):
    for _ in range(RACES):
        out = new_output()
        lock_path = storage.join(out, output.LOCK)
        dead = dataclasses.replace(Owner.me("gone"), pid=dead_pid, token=1)
        storage.write_bytes(lock_path, b"{half a lock" if stale == "garbled" else dead.to_bytes())
        resume = threading.Event()  # every racer reads the stale lock, then all write at once
        plans = [FaultPlan(pause_at=0, resume=resume) for _ in range(40)]
        won = [None] * 40

        def race(i, plans=plans, won=won, out=out):
            with injected(plans[i]):
                try:
                    won[i] = OutputLock.acquire(out, f"racer-{i}", heartbeat=False)
                except LockHeld:
                    won[i] = False

        racers = [threading.Thread(target=race, args=(i,)) for i in range(40)]
        for racer in racers:
            racer.start()
        assert all(plan.paused.wait(timeout=60) for plan in plans)
        resume.set()
        for racer in racers:
            racer.join(timeout=60)
        winners = [held for held in won if held]
        assert len(winners) == 1 and won.count(False) == 39
        winners[0].check()
        assert json.loads(storage.read_bytes(lock_path))["token"] == (2 if stale == "dead owner" else 1)


@pytest.mark.slow
def test_a_pipeline_overtaken_by_a_forced_run_during_its_commit_fails_and_the_forced_run_stands(
    tmp_path, tiny_checkpoint_dir
):
    """The wiring, end to end: the real job pauses before its commit places its first file; a forced
    `docbeam run` commits meanwhile; the paused job then fails with LockLost and changes nothing."""
    import gzip

    from conftest import REPO, SAMPLE, TEST_BATCHING, checkout_env, job_config

    from docbeam.pipeline.driver.run import run_job

    corpus = tmp_path / "docs.jsonl"
    with gzip.open(SAMPLE, "rt") as f:
        corpus.write_text("".join(line for line, _ in zip(f, range(20))))
    out = str(tmp_path / "out")
    plan = FaultPlan(
        pause_at=0,
        every_thread=True,  # the commit runs in a Beam worker thread
        counts=lambda op, path: op == "rename" and path.startswith(f"{out}/embeddings/"),
    )
    outcome = {}

    def overtaken():
        with injected(plan):
            try:
                outcome["result"] = run_job(job_config(str(corpus), out, tiny_checkpoint_dir))
            except Exception as e:  # noqa: BLE001  what the command line would turn into exit 1
                outcome["result"] = e

    job = threading.Thread(target=overtaken)
    job.start()
    assert plan.paused.wait(timeout=300), outcome
    paused_run = json.loads(storage.read_bytes(f"{out}/_lock.json"))["run_id"]
    forced = subprocess.run(
        [
            sys.executable,
            "-m",
            "docbeam",
            "run",
            "--config",
            f"{REPO}/configs/local.yaml",
            "--force",
            "--set",
            f"input.path={corpus}",
            "--set",
            f"output.path={out}",
            "--set",
            f"model.path={tiny_checkpoint_dir}",
            "--set",
            f"batching.buckets={TEST_BATCHING['buckets']}",
            "--set",
            f"batching.tokens_per_batch={TEST_BATCHING['tokens_per_batch']}",
        ],
        cwd=REPO,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    plan.resume.set()
    job.join(timeout=300)
    assert forced.returncode == 0, forced.stderr
    assert isinstance(outcome["result"], LockLost), outcome["result"]
    manifest = json.loads(storage.read_bytes(f"{out}/_manifest.json"))
    assert (
        manifest["run_id"] != paused_run
        and json.loads(storage.read_bytes(f"{out}/summary.json"))["run_id"]
        == manifest["run_id"]
        == storage.read_bytes(f"{out}/_SUCCESS").decode().strip()
    )
    outside_staging = {output.relative(out, p) for p in storage.list_files(out)} - set(POINTERS)
    assert {rel for rel in outside_staging if not rel.startswith("_staging/")} == {f["path"] for f in manifest["files"]}
    assert not any(paused_run in rel for rel in outside_staging if not rel.startswith(f"_staging/{paused_run}/"))

"""The run/commit/exit-code contract, tried the way a flaky cloud or a hostile user would: failed reruns,
a killed run, two runs at once, odd output paths, a kernel that returns NaN. Every run goes through the
``docbeam`` command's ``main`` (in this process: cli_test checks the real command's exit status end to end); a run
that is killed, or must be alive while another starts, is a real subprocess."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_runner import run_docbeam
from conftest import REPO, SAMPLE, TEST_BATCHING

pytestmark = pytest.mark.slow
LOCAL = os.path.join(REPO, "configs", "local.yaml")


def docbeam(*args: str) -> subprocess.Popen:
    """A run in its own process: for the runs a test kills, or keeps alive while another run starts."""
    return subprocess.Popen(
        [sys.executable, "-m", "docbeam", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run_args(corpus: str, out: str, model: str, *sets: str) -> list[str]:
    args = [
        "run",
        "--config",
        LOCAL,
        "--set",
        f"input.path={corpus}",
        "--set",
        f"output.path={out}",
        "--set",
        f"model.path={model}",
        "--set",
        f"batching.buckets={TEST_BATCHING['buckets']}",
        "--set",
        f"batching.tokens_per_batch={TEST_BATCHING['tokens_per_batch']}",
    ]
    for s in sets:
        args += ["--set", s]
    return args


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(corpus: str, out: str, model: str, *sets: str) -> subprocess.CompletedProcess:
    return run_docbeam(*run_args(corpus, out, model, *sets))


def snapshot(out: str) -> dict[str, bytes]:
    """Every file a reader can see, byte for byte (the staging folder is the run's own scratch space)."""
    files = {}
    for path in glob.glob(f"{out}/**", recursive=True):
        rel = os.path.relpath(path, out)
        if os.path.isfile(path) and not rel.startswith("_staging"):
            files[rel] = open(path, "rb").read()
    return files


def sample_docs(n: int) -> list[dict]:
    with gzip.open(SAMPLE, "rt") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in sample_docs(30)))
    return str(path)


@pytest.fixture(scope="module")
def yesterday(tmp_path_factory, corpus, tiny_checkpoint_dir) -> tuple[str, dict[str, bytes]]:
    """A committed output, and its bytes: what every failed run below must leave exactly as it was."""
    out = str(tmp_path_factory.mktemp("runs") / "daily")
    result = run(corpus, out, tiny_checkpoint_dir)
    assert result.returncode == 0, result.stderr
    return out, snapshot(out)


FAILED_RERUNS = {
    "input glob matches nothing": (2, ["input.path={missing}/*.jsonl"], "matches no file"),
    "input is a folder": (2, ["input.path={missing_parent}"], "it is a folder"),
    "backend raises": (2, ["attention.backend=tests.fixtures_bad_backends:attend_raises"], "failed on a probe batch"),
    "backend returns B,N,T,H": (
        2,
        ["attention.backend=tests.fixtures_bad_backends:attend_wrong_layout"],
        "it must return q's shape, layout and dtype",
    ),
    "backend returns NaN": (2, ["attention.backend=tests.fixtures_bad_backends:attend_nan"], "non-finite values"),
    "capability check raises": (
        2,
        ["attention.backend=tests.fixtures_bad_backends:attend_check_raises"],
        "its capability check raised KeyError",
    ),
    "bucket past the position table": (
        2,
        ["batching.buckets=[64, 1024]"],
        "bucket 1024 is longer than the checkpoint's 512 position embeddings",
    ),
    "fail_if_exists": (2, ["output.mode=fail_if_exists"], "already holds run"),
    "text_field typo rejects everything": (1, ["input.text_field=body"], "nothing was embedded from 30 documents"),
    "too many rejected": (1, ["input.max_line_bytes=600"], "more than input.max_rejected_fraction=0.1"),
}


@pytest.mark.parametrize("case", FAILED_RERUNS)
def test_a_failed_rerun_leaves_yesterdays_output_byte_identical(case, yesterday, corpus, tiny_checkpoint_dir, tmp_path):
    out, before = yesterday
    code, sets, message = FAILED_RERUNS[case]
    sets = [s.format(missing=tmp_path / "none", missing_parent=tmp_path) for s in sets]
    result = run(corpus, out, tiny_checkpoint_dir, *sets)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert snapshot(out) == before
    if code == 1:
        assert "nothing committed (the previous output is unchanged)" in result.stderr
        (staged,) = glob.glob(f"{out}/_staging/*/summary.json")  # the failed run's errors and summary, kept
        assert json.load(open(staged))["failed"]


@pytest.fixture
def committed(tmp_path, yesterday) -> tuple[str, dict[str, bytes]]:
    """A committed output of the test's own: yesterday's files copied (a manifest lists its files by relative
    path), without the staging folders its failed reruns keep."""
    out = str(tmp_path / "out")
    shutil.copytree(yesterday[0], out, ignore=shutil.ignore_patterns("_staging"))
    assert snapshot(out) == yesterday[1]
    return out, snapshot(out)


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def big_corpus(tmp_path, copies: int = 4) -> str:
    """Long enough (~30 s with the tiny model) that the run still works when the test kills it."""
    path = tmp_path / "big.jsonl"
    path.write_text(
        "".join(json.dumps({**d, "id": f"{d['id']}#{i}"}) + "\n" for i in range(copies) for d in sample_docs(400))
    )
    return str(path)


def staged_files(out: str) -> list[str]:
    return [p for p in glob.glob(f"{out}/_staging/**", recursive=True) if os.path.isfile(p)]


def test_a_killed_run_leaves_the_previous_output_and_the_next_run_cleans_up(
    committed, tmp_path, corpus, tiny_checkpoint_dir
):
    out, before = committed
    proc = docbeam(*run_args(big_corpus(tmp_path), out, tiny_checkpoint_dir))
    wait_for(lambda: staged_files(out), proc, "the run started writing")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert snapshot(out).keys() - before.keys() == {"_lock.json"}  # the dead run's lock, nothing else
    assert {k: v for k, v in snapshot(out).items() if k != "_lock.json"} == before
    assert glob.glob(f"{out}/_staging/*")

    rerun = run(corpus, out, tiny_checkpoint_dir)  # the 30 documents: the clean-up, not the size, is on trial
    assert rerun.returncode == 0, rerun.stderr
    assert "is no longer running" in rerun.stdout and "cleaned up the staging folder of dead run" in rerun.stdout
    assert not os.path.exists(f"{out}/_staging") and not os.path.exists(f"{out}/_lock.json")
    manifest = json.load(open(f"{out}/_manifest.json"))
    assert sorted(os.path.relpath(p, out) for p in glob.glob(f"{out}/*/*")) == sorted(
        f["path"] for f in manifest["files"]
    )
    assert manifest["counts"]["docs_embedded"] == 30
    assert manifest["run_id"] not in (json.loads(before["_manifest.json"])["run_id"], None)


def test_a_second_run_into_a_live_runs_output_is_refused_naming_it(committed, tmp_path, tiny_checkpoint_dir, corpus):
    out, _ = committed
    first = docbeam(*run_args(corpus, out, tiny_checkpoint_dir))
    wait_for(lambda: os.path.exists(f"{out}/_lock.json"), first, "the first run took the lock")
    # Stopped, not merely slow: alive and holding the lock while the second run starts, however fast it is
    # (a stopped process is as alive as a busy one to the lock's check), without a big corpus to outlast it.
    first.send_signal(signal.SIGSTOP)
    try:
        owner = json.load(open(f"{out}/_lock.json"))
        second = run(corpus, out, tiny_checkpoint_dir)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    assert f"is being written by run {owner['run_id']}" in second.stderr and f"pid {first.pid}" in second.stderr
    assert finish(first).returncode == 0
    assert json.load(open(f"{out}/_manifest.json"))["run_id"] == owner["run_id"]
    assert json.load(open(f"{out}/summary.json"))["docs_embedded"] == 30


@pytest.mark.parametrize(
    "output_path, message",
    [
        ("{root}/run*", "without glob characters or commas (found *)"),
        ("{root}/runA,{root}/runB", "without glob characters or commas (found ,)"),
        ("~", "must name a folder for this job's output, not your home folder"),
        ("{root}/runA/../../../../../../../../../../..", "not the filesystem's root"),  # normalised, then judged
        ("gs://bucket/runs/..", "not a bucket's root"),
        ("{root}", "holds 2 file(s) that no docbeam run wrote"),
    ],
)
def test_odd_output_paths_are_refused_and_nothing_is_deleted(
    output_path, message, tmp_path, corpus, tiny_checkpoint_dir
):
    for name in ("runA", "runB"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "embeddings.parquet").write_bytes(b"someone's data")
    result = run(corpus, output_path.format(root=tmp_path), tiny_checkpoint_dir)
    assert result.returncode == 2
    assert message in result.stderr
    assert all((tmp_path / n / "embeddings.parquet").read_bytes() == b"someone's data" for n in ("runA", "runB"))
    assert not glob.glob(str(tmp_path / "run[*]"))


def test_an_input_inside_the_output_is_refused_before_anything_is_touched(tmp_path, corpus, tiny_checkpoint_dir):
    (tmp_path / "errors").mkdir()
    inner = tmp_path / "errors" / "corpus.jsonl"
    inner.write_bytes(open(corpus, "rb").read())
    before = {p: open(p, "rb").read() for p in glob.glob(f"{tmp_path}/**", recursive=True) if os.path.isfile(p)}
    result = run(str(inner), str(tmp_path), tiny_checkpoint_dir)
    assert result.returncode == 2 and "lies inside output.path" in result.stderr
    assert inner.read_bytes() == open(corpus, "rb").read()
    after = {p: open(p, "rb").read() for p in glob.glob(f"{tmp_path}/**", recursive=True) if os.path.isfile(p)}
    assert after == before  # no lock, no staging folder, nothing written or removed


def test_a_kernel_that_returns_nan_for_some_rows_never_gets_them_written(tmp_path, corpus, tiny_checkpoint_dir):
    seven_tokens = tmp_path / "extra.jsonl"
    seven_tokens.write_text(json.dumps({"id": "seven", "text": "alpha beta gamma delta epsilon"}) + "\n")
    out = str(tmp_path / "out")
    result = run(
        f"{corpus},{seven_tokens}",
        out,
        tiny_checkpoint_dir,
        "attention.backend=tests.fixtures_bad_backends:attend_nan_at_length_7",
    )
    assert result.returncode == 0, result.stderr
    errors = [json.loads(line) for path in glob.glob(f"{out}/errors/*.jsonl") for line in open(path)]
    assert [(e["id"], e["kind"]) for e in errors] == [("seven", "non_finite")]
    # The 7-token window fits bucket 16; as a leftover it may ride in a longer bucket's batch, which the reason names.
    named = re.search(
        r"computed at bucket (\d+) with attention tests\.fixtures_bad_backends:attend_nan_at_length_7",
        errors[0]["reason"],
    )
    assert named and int(named.group(1)) >= 16, errors[0]["reason"]
    table = pq.read_table(glob.glob(f"{out}/embeddings/*.parquet"))
    assert "seven" not in table.column("id").to_pylist() and table.num_rows == 30
    assert np.isfinite(np.array(table.column("embedding").to_pylist())).all()
    summary = json.load(open(f"{out}/summary.json"))
    assert summary["rejected_by_kind"] == {"non_finite": 1} and summary["docs_read"] == 31


def test_an_empty_input_commits_an_empty_output_that_the_report_can_read(tmp_path, tiny_checkpoint_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = str(tmp_path / "out")
    result = run(str(empty), out, tiny_checkpoint_dir)
    assert result.returncode == 0, result.stderr
    manifest = json.load(open(f"{out}/_manifest.json"))
    assert manifest["counts"]["docs_read"] == 0 == manifest["counts"]["docs_embedded"]
    assert pq.read_table(glob.glob(f"{out}/embeddings/*.parquet")).num_rows == 0
    report = run_docbeam("report", out)
    assert report.returncode == 0, report.stderr


@pytest.mark.slow
def test_an_empty_folder_of_the_users_under_staging_is_not_deleted(tmp_path, corpus, tiny_checkpoint_dir):
    out = tmp_path / "out"
    assert run(corpus, str(out), tiny_checkpoint_dir).returncode == 0
    (out / "_staging" / "mine" / "notes").mkdir(parents=True)  # the user's, empty: docbeam never wrote it
    assert run(corpus, str(out), tiny_checkpoint_dir).returncode == 0  # recovery, then the commit's clean-up
    assert (out / "_staging" / "mine" / "notes").is_dir()
    assert sorted(p.name for p in (out / "_staging").iterdir()) == ["mine"]  # the runs' own folders are gone

"""docbeam/errors.py: one base class decides exit 2, and a run that fails after it started leaves its summary."""

from __future__ import annotations

import glob
import json

import pytest
from conftest import job_config

from docbeam.errors import JobFailed, Refused, UnusablePath, refused_at_start


def start_time_exceptions() -> list[type]:
    from docbeam.attention.dispatch import AttentionPlanError
    from docbeam.attention.registry import UnknownBackendError
    from docbeam.config import ConfigError
    from docbeam.models.checkpoint import CheckpointError
    from docbeam.pipeline.store.lock import LockHeld
    from docbeam.pipeline.store.output import OutputRefused

    return [
        AttentionPlanError,
        UnknownBackendError,
        CheckpointError,
        ConfigError,
        LockHeld,
        OutputRefused,
        UnusablePath,
    ]


def test_every_start_time_refusal_is_a_refused_and_no_job_failure_is():
    from docbeam.pipeline.stages.commit import RunFailed
    from docbeam.pipeline.store.lock import LockLost

    assert [cls for cls in start_time_exceptions() if not issubclass(cls, Refused)] == []
    assert [cls for cls in (RunFailed, LockLost, JobFailed) if issubclass(cls, Refused)] == []


def test_an_os_error_in_a_start_step_becomes_a_refusal_naming_the_step(tmp_path):
    with pytest.raises(
        UnusablePath,
        match=r"^output.path x: taking its lock: IsADirectoryError: \[Errno 21\] .*"
        r"; fix or remove it, or choose another path$",
    ):
        with refused_at_start("output.path x: taking its lock"):
            open(tmp_path, "rb")


def test_a_garbled_file_in_a_start_step_becomes_a_refusal():
    with pytest.raises(UnusablePath, match="^output.path x: JSONDecodeError: Expecting value"):
        with refused_at_start("output.path x"):
            json.loads("not json")


def test_a_refusal_passes_unchanged_and_a_bug_is_not_called_a_refusal():
    from docbeam.config import ConfigError

    with pytest.raises(ConfigError, match="^as it was$"):
        with refused_at_start("output.path x"):
            raise ConfigError("as it was")
    with pytest.raises(TypeError):
        with refused_at_start("output.path x"):
            len(3)


def _hash_that_raises(text: str, prompt: str | None = None) -> str:
    from docbeam.models.checkpoint import CheckpointError

    raise CheckpointError("model.path: tokenizer.json vanished on the worker")


@pytest.mark.slow
def test_a_run_that_fails_after_it_started_leaves_its_summary_in_staging_and_is_no_refusal(
    tmp_path, tiny_checkpoint_dir, monkeypatch
):
    """A start-time error class raised by a worker (here a CheckpointError in a step of the job) is a failed
    job: exit 1, with summary.json in the run's staging folder saying why."""
    from docbeam.pipeline.driver import run
    from docbeam.pipeline.stages import encode_documents

    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"id": "a", "text": "hello world"}\n')
    out = tmp_path / "out"
    monkeypatch.setattr(encode_documents, "content_hash", _hash_that_raises)  # the fault: any exception inside the job

    with pytest.raises(JobFailed, match="CheckpointError: model.path: tokenizer.json vanished on the worker"):
        run.run_job(job_config(str(corpus), str(out), tiny_checkpoint_dir))
    [staged] = glob.glob(f"{out}/_staging/*/summary.json")
    summary = json.loads(open(staged).read())
    assert "tokenizer.json vanished on the worker" in summary["failed"][0]
    assert summary["run_id"] in staged and summary["model"] == tiny_checkpoint_dir
    assert not (out / "summary.json").exists() and not (out / "_lock.json").exists()

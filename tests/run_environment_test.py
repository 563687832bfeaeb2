"""``runner.worker_env`` is the workers' environment: on the DirectRunner's in-memory workers that is the calling
process, so ``docbeam.run`` puts it back as it was after the job, and a scheduler's or a notebook's next job does
not inherit it."""

from __future__ import annotations

import gzip
import os

import pytest
from conftest import SAMPLE, job_config

from docbeam.pipeline.driver.run import run_job

KEY, KEPT = "DOCBEAM_TEST_WORKER_ENV", "DOCBEAM_TEST_WORKER_ENV_KEPT"


@pytest.fixture
def documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    with gzip.open(SAMPLE, "rt") as f:
        path.write_text("".join(line for _, line in zip(range(5), f)))
    return str(path)


@pytest.mark.slow
def test_the_workers_environment_is_put_back_after_the_job(documents, tmp_path, tiny_checkpoint_dir, monkeypatch):
    monkeypatch.delenv(KEY, raising=False)
    monkeypatch.setenv(KEPT, "the caller's")
    env = {"worker_env": {KEY: "set for the workers", KEPT: "the workers'"}}
    summary = run_job(job_config(documents, str(tmp_path / "out"), tiny_checkpoint_dir, runner=env))
    assert summary["docs_embedded"] == 5
    assert KEY not in os.environ and os.environ[KEPT] == "the caller's"

"""One accelerator, one owner: with ``runner.one_model_per_vm`` the SDK processes of a machine share one encoder.

Two worker processes on the DirectRunner (multi_processing) stand in for the SDK processes of one Dataflow VM.
Every timing record names the process that encoded the batch (``worker``) and the one that sent it
(``requested_by``).
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from conftest import SAMPLE, job_config

from docbeam.pipeline.driver.run import encoder_spec, run_job
from docbeam.pipeline.stages.encode import EncoderHandler

pytestmark = pytest.mark.slow
TWO_PROCESSES = {"direct_num_workers": 2, "direct_running_mode": "multi_processing"}


def timing(output: str) -> list[dict]:
    return [json.loads(line) for path in sorted(glob.glob(f"{output}/timing/*.jsonl")) for line in open(path)]


def pids(records: list[dict], field: str) -> set[str]:
    return {r[field].rsplit(":", 1)[1] for r in records}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """The sample's first 60 documents: batches enough for four shards over two processes, which is what these
    tests are about; the other 340 documents only added encoding time."""
    from fixtures_sample import sample_head

    return sample_head(tmp_path_factory.mktemp("corpus"), CORPUS_DOCS)


CORPUS_DOCS = 60


def two_process_job(corpus: str, tiny_checkpoint_dir, output: str, share: bool):
    return job_config(
        corpus,
        output,
        tiny_checkpoint_dir,
        batching={"buckets": [32, 64, 128], "shards": 4, "tokens_per_batch": 512},
        runner={"one_model_per_vm": share, "options": TWO_PROCESSES},
    )


@pytest.mark.extra
def test_with_sharing_two_worker_processes_send_batches_to_one_runtime(corpus, tiny_checkpoint_dir, tmp_path):
    shared = run_job(two_process_job(corpus, tiny_checkpoint_dir, str(tmp_path / "shared"), share=True))
    records = timing(str(tmp_path / "shared"))
    assert shared["docs_embedded"] == CORPUS_DOCS and len(records) == shared["batches"]
    assert len(pids(records, "requested_by")) == 2, "both worker processes sent batches"
    assert len(pids(records, "worker")) == 1, "one runtime encoded every batch"
    assert pids(records, "worker") <= pids(records, "requested_by"), "the owner is one of the workers"


@pytest.mark.extra
def test_without_sharing_each_worker_process_builds_its_own_runtime(corpus, tiny_checkpoint_dir, tmp_path):
    run_job(two_process_job(corpus, tiny_checkpoint_dir, str(tmp_path / "own"), share=False))
    records = timing(str(tmp_path / "own"))
    assert len(pids(records, "worker")) == 2
    assert all(r["worker"] == r["requested_by"] for r in records)


def test_the_handler_asks_runinference_for_one_shared_copy_and_sets_the_worker_env(
    tiny_checkpoint_dir, tmp_path, monkeypatch
):
    from docbeam.pipeline.driver.plan import make_plan

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    cfg = job_config(
        SAMPLE,
        str(tmp_path / "out"),
        tiny_checkpoint_dir,
        runner={"one_model_per_vm": True, "worker_env": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}},
    )
    handler = EncoderHandler(encoder_spec(make_plan(cfg), str(tmp_path / "staging"), "run"))
    assert handler.share_model_across_processes() and handler.model_copies() == 1
    handler.set_environment_vars()  # what RunInference's setup() calls before load_model()
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    default = EncoderHandler(
        encoder_spec(
            make_plan(job_config(SAMPLE, str(tmp_path / "o2"), tiny_checkpoint_dir)), str(tmp_path / "staging"), "run"
        )
    )
    assert not default.share_model_across_processes()

"""runner.compilation_cache: the second job of a schedule takes its executables from JAX's persistent cache.

``compile_cache_hits`` in each timing record counts the executables the cache served for that batch
(jax.monitoring's ``/jax/compilation_cache/cache_hits``), and summary.json's ``compile_cache_hits_ahead``
those it served as the encoder compiled every shape before its first batch. Each job runs its encoder in fresh worker processes,
as a scheduled job's workers would be. A cache that cannot be reached costs only its time: the encoder
compiles without it and says so.
"""

from __future__ import annotations

import glob
import json
import logging
import os

import jax
import jax.numpy as jnp
import pytest
from conftest import job_config

from docbeam.models import vm_cache
from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.stages.compile_cache import CompileCache

FRESH_PROCESS = {"direct_num_workers": 1, "direct_running_mode": "multi_processing"}


def timing(output: str) -> list[dict]:
    return [json.loads(line) for path in sorted(glob.glob(f"{output}/timing/*.jsonl")) for line in open(path)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """The sample's first 60 documents, short and long: the cache's work (what these tests check) is per compiled
    shape, not per document, and the whole sample only added encoding time."""
    from fixtures_sample import sample_head

    return sample_head(tmp_path_factory.mktemp("corpus"), 60)


def job(corpus: str, tiny_checkpoint_dir, output: str, cache: str):
    return job_config(
        corpus,
        output,
        tiny_checkpoint_dir,
        batching={"buckets": [64, 128], "tokens_per_batch": 512},
        runner={"compilation_cache": cache, "options": FRESH_PROCESS},
    )


def compiled_and_hits(records: list[dict], summary: dict) -> tuple[int, int]:
    """Compilations and cache hits of a run: ahead of its first batch (the summary), then in its batches."""
    return (
        summary["compiles_ahead"] + sum(r["compiled"] for r in records),
        summary["compile_cache_hits_ahead"] + sum(r["compile_cache_hits"] for r in records),
    )


@pytest.mark.slow
def test_a_local_cache_serves_the_second_jobs_compilations(corpus, tiny_checkpoint_dir, tmp_path):
    cache = str(tmp_path / "jax-cache")
    first_summary = run_job(job(corpus, tiny_checkpoint_dir, str(tmp_path / "first"), cache))
    entries = [n for n in os.listdir(cache) if n.endswith("-cache")]
    second_summary = run_job(job(corpus, tiny_checkpoint_dir, str(tmp_path / "second"), cache))

    first, second = timing(str(tmp_path / "first")), timing(str(tmp_path / "second"))
    assert entries, "the first job left no executables in the cache"
    compiled, hits = compiled_and_hits(first, first_summary)
    assert compiled > 0 and hits == 0
    compiled, hits = compiled_and_hits(second, second_summary)
    assert hits >= compiled > 0, "every shape the second job compiled came from the cache"


@pytest.mark.slow
@pytest.mark.gcs
@pytest.mark.extra
def test_a_gcs_cache_is_filled_by_one_job_and_read_by_the_next_on_a_new_machine(
    corpus, tiny_checkpoint_dir, tmp_path, monkeypatch
):
    from gcs_emulator import gcs_emulator

    with gcs_emulator() as gcs:
        cache = gcs.url("jax-cache", "cpu")
        monkeypatch.setenv(vm_cache.ROOT_ENV, str(tmp_path / "vm-1"))
        first_summary = run_job(job(corpus, tiny_checkpoint_dir, str(tmp_path / "first"), cache))
        uploaded = [b.name for b in gcs.client.list_blobs(gcs.bucket, prefix="jax-cache/cpu/")]
        monkeypatch.setenv(vm_cache.ROOT_ENV, str(tmp_path / "vm-2"))  # a fresh VM: nothing local
        second_summary = run_job(job(corpus, tiny_checkpoint_dir, str(tmp_path / "second"), cache))

    first, second = timing(str(tmp_path / "first")), timing(str(tmp_path / "second"))
    assert uploaded and all(name.endswith("-cache") for name in uploaded)
    assert compiled_and_hits(first, first_summary)[1] == 0
    compiled, hits = compiled_and_hits(second, second_summary)
    assert hits >= compiled > 0
    pulled = os.listdir(glob.glob(str(tmp_path / "vm-2" / "jax-cache" / "*"))[0])
    assert set(n.rsplit("/", 1)[-1] for n in uploaded) <= set(pulled)


def uncreatable(tmp_path) -> str:
    """A local cache folder no process can create: its parent is a file."""
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "jax-cache")


def test_a_local_cache_that_cannot_be_created_is_a_warning_and_jax_compiles_without_it(tmp_path, caplog):
    before = jax.config.jax_compilation_cache_dir
    with caplog.at_level(logging.WARNING, logger="docbeam.pipeline.stages.compile_cache"):
        cache = CompileCache(uncreatable(tmp_path))
    assert f"compilation cache {uncreatable(tmp_path)} cannot be reached (NotADirectoryError" in caplog.text
    assert "compiling without it" in caplog.text
    assert jax.config.jax_compilation_cache_dir == before, "JAX was pointed at the unreachable folder"
    assert cache.push() == 0
    assert float(jax.jit(lambda x: x * 3)(jnp.float32(2))) == 6.0


@pytest.mark.gcs
def test_a_gcs_cache_in_a_bucket_that_does_not_exist_is_a_warning(tmp_path, monkeypatch, caplog):
    from gcs_emulator import gcs_emulator

    monkeypatch.setenv(vm_cache.ROOT_ENV, str(tmp_path / "vm"))
    before = jax.config.jax_compilation_cache_dir
    with gcs_emulator() as gcs, caplog.at_level(logging.WARNING, logger="docbeam.pipeline.stages.compile_cache"):
        cache = CompileCache("gs://no-such-bucket/jax-cache/cpu")
        assert cache.push() == 0
        assert list(gcs.client.list_blobs(gcs.bucket)) == []
    assert "compilation cache gs://no-such-bucket/jax-cache/cpu cannot be reached" in caplog.text
    assert jax.config.jax_compilation_cache_dir == before


def messages(caplog) -> list[str]:
    """The cache's own records (another thread's warning may come last)."""
    return [r.getMessage() for r in caplog.records if r.name == "docbeam.pipeline.stages.compile_cache"]


@pytest.mark.gcs
def test_the_vms_other_processes_take_the_first_ones_word_instead_of_retrying(tmp_path, monkeypatch, caplog):
    """Beam retries a gs:// endpoint that does not answer for about two minutes; the VM's processes wait for
    each other on one lock, so without the note each of them would spend those minutes in turn."""
    from gcs_emulator import gcs_emulator

    monkeypatch.setenv(vm_cache.ROOT_ENV, str(tmp_path / "vm"))
    with gcs_emulator() as gcs, caplog.at_level(logging.WARNING, logger="docbeam.pipeline.stages.compile_cache"):
        CompileCache("gs://no-such-bucket/jax-cache/cpu")
        gcs.client.create_bucket("no-such-bucket")  # reachable now: the second process must not ask
        caplog.clear()
        second = CompileCache("gs://no-such-bucket/jax-cache/cpu")
        assert second.local is None
        assert any("another process on this VM could not reach it: BeamIOError" in m for m in messages(caplog))
        (note,) = glob.glob(str(tmp_path / "vm" / "jax-cache" / "*.unreachable"))
        os.utime(note, (0, 0))  # a note from an earlier job: a new one asks the endpoint again
        gcs.client.bucket("no-such-bucket").delete()  # (and fails, so that JAX's cache stays this process's)
        caplog.clear()
        CompileCache("gs://no-such-bucket/jax-cache/cpu")
        assert any("cannot be reached (BeamIOError: Match operation failed" in m for m in messages(caplog))


@pytest.mark.slow
def test_a_job_whose_cache_cannot_be_reached_embeds_every_document_and_commits(corpus, tiny_checkpoint_dir, tmp_path):
    cfg = job_config(
        corpus,
        str(tmp_path / "out"),
        tiny_checkpoint_dir,
        batching={"buckets": [64, 128], "tokens_per_batch": 512},
        runner={"compilation_cache": uncreatable(tmp_path)},
    )
    summary = run_job(cfg)
    assert summary["docs_embedded"] == summary["docs_read"] > 0 and summary["compiles"] > 0
    assert os.path.exists(tmp_path / "out" / "_SUCCESS")

"""Start-up: summary.json says where the time to the first batch went and what share of the wall time
each stage took; the encoder compiles every shape before its first batch; `docbeam run` stays light."""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, SAMPLE, TEST_BATCHING, checkout_env, drop_warm_encoder, job_config

from docbeam.pipeline.telemetry.observe import STAGES

BUCKETS = TEST_BATCHING["buckets"]  # the tiny run's, as job_config gives them


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl.gz"
    with gzip.open(SAMPLE, "rt") as src, gzip.open(path, "wt") as dst:
        dst.writelines(itertools.islice(src, 40))
    return str(path)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, small_corpus, tiny_checkpoint_dir):
    from docbeam.pipeline.driver.run import run_job

    drop_warm_encoder()  # a cold start is under test: not one warm from an earlier test's job
    output = str(tmp_path_factory.mktemp("startup-run"))
    process_started = time.time()
    summary = run_job(
        job_config(small_corpus, output, tiny_checkpoint_dir, runner={"progress_seconds": 0}),
        process_started=process_started,
    )
    timing = [json.loads(line) for path in sorted(glob.glob(f"{output}/timing/*.jsonl")) for line in open(path)]
    return output, summary, timing


def test_the_startup_steps_are_non_negative_and_add_up_to_the_pipelines_start(tiny_run):
    _, summary, _ = tiny_run
    startup = summary["startup"]
    steps, since = startup["steps_s"], startup["since_process_start_s"]
    assert set(steps) == {"imports", "plan", "lock_and_checks", "graph"}
    assert all(v >= 0 for v in steps.values())
    assert sum(steps.values()) == pytest.approx(since["pipeline_started"], abs=0.01)
    assert 0 <= since["plan_done"] <= since["pipeline_started"] <= since["first_batch_started"]
    assert since["first_batch_started"] <= since["first_batch_done"]
    assert set(startup["encoder_s"]) == {"checkpoint", "probes"}
    assert all(v >= 0 for v in startup["encoder_s"].values())


def test_the_steady_state_is_every_batch_after_the_first(tiny_run):
    _, summary, timing = tiny_run
    steady = summary["startup"]["steady_state"]
    assert steady["batches"] == summary["batches"] - 1 == len(timing) - 1
    first = min(timing, key=lambda t: t["started_at"])
    assert steady["real_tokens"] == summary["real_tokens"] - first["real_tokens"]
    assert steady["seconds"] >= 0 and steady["encode_seconds"] >= 0


def test_stage_shares_are_measured_and_sum_to_at_most_one_on_one_worker(tiny_run):
    _, summary, _ = tiny_run
    stages = summary["stages"]
    assert set(stages["seconds"]) == set(STAGES)
    assert all(stages["seconds"][s] > 0 for s in STAGES)  # every stage's own code was timed
    shares = stages["share_of_wall"]
    assert all(0 <= v <= 1 for v in shares.values())
    assert sum(shares[s] for s in STAGES) <= 1
    assert sum(shares.values()) == pytest.approx(1, abs=1e-3)  # "other" is the rest
    assert stages["wall_s"] <= summary["wall_seconds"] + summary["startup"]["since_process_start_s"]["pipeline_started"]


def test_every_shape_compiles_once_ahead_or_at_its_first_batch_and_never_after(tiny_run):
    _, summary, timing = tiny_run
    compiles = summary["startup"]["compiles_s"]
    shapes = [name.split(" ")[0] for name in compiles]
    assert len(shapes) == len(set(shapes)) == len(BUCKETS) == summary["compiles"]  # every planned shape, once
    assert summary["compiles_ahead"] == sum("(at its batch)" not in name for name in compiles)
    assert {f"{t['rows']}x{t['bucket_len']},native" for t in timing} <= set(shapes)
    assert all(seconds > 0 for seconds in compiles.values())
    first_of_shape = {}
    for t in sorted(timing, key=lambda t: t["started_at"]):
        if first_of_shape.setdefault((t["rows"], t["bucket_len"]), t["batch_id"]) != t["batch_id"]:
            assert not t["compiled"] and t["compile_ms"] == 0  # warmed up: nothing to compile or wait for


def test_the_summary_file_holds_the_breakdown_and_the_manifest_still_matches_the_files(tiny_run):
    import os

    output, summary, _ = tiny_run
    assert json.load(open(f"{output}/summary.json")) == summary
    manifest = json.load(open(f"{output}/_manifest.json"))
    assert all(os.path.getsize(f"{output}/{f['path']}") == f["size"] for f in manifest["files"])


@pytest.mark.slow
def test_a_later_job_in_the_process_starts_warm_and_a_rewritten_checkpoint_loads_afresh(
    small_corpus, real_checkpoint_dir, tmp_path
):
    """One encoder kept per process, keyed by what the driver read of the checkpoint: a second job with the same
    spec reuses it and says so, one whose weights changed in place loads them, and the old encoder is let go."""
    import gc
    import weakref

    import pyarrow.parquet as pq
    from conftest import write_tiny_checkpoint

    from docbeam.pipeline.driver.cli import format_startup
    from docbeam.pipeline.driver.run import run_job
    from docbeam.pipeline.stages import encode

    model = write_tiny_checkpoint(str(tmp_path / "model"), real_checkpoint_dir, seed=3)

    def run(name: str) -> tuple[dict, dict]:
        summary = run_job(job_config(small_corpus, str(tmp_path / name), model, runner={"progress_seconds": 0}))
        table = pq.read_table(glob.glob(str(tmp_path / name / "embeddings" / "*.parquet")))
        return summary, dict(zip(table["id"].to_pylist(), table["embedding"].to_pylist()))

    drop_warm_encoder()
    first, first_vectors = run("first")
    (loaded,) = [weakref.ref(r) for r in encode._RUNTIMES.values()]
    second, second_vectors = run("second")
    assert set(first["startup"]["encoder_s"]) == {"checkpoint", "probes"} and first["compiles"] == len(BUCKETS)
    assert second["startup"]["encoder_s"] == {"reused": 0.0} and second["compiles"] == 0
    assert "encoder warm from an earlier job in this process" in format_startup(second)  # what the CLI prints
    timing = [
        json.loads(line) for path in glob.glob(str(tmp_path / "second" / "timing" / "*.jsonl")) for line in open(path)
    ]
    assert timing and not any(t["compiled"] for t in timing)
    assert second_vectors == first_vectors
    write_tiny_checkpoint(model, real_checkpoint_dir, seed=4)  # the same path, other weights
    third, third_vectors = run("third")
    assert set(third["startup"]["encoder_s"]) == {"checkpoint", "probes"}
    assert third_vectors.keys() == first_vectors.keys() and third_vectors != first_vectors
    gc.collect()
    assert len(encode._RUNTIMES) == 1 and loaded() is None, "the first checkpoint's encoder is still held"


def test_the_encoder_compiles_ahead_then_reports_its_startup_once(tiny_checkpoint_dir):
    from benchmarks.common import standalone_spec
    from docbeam.attention.settings import AttentionConfig
    from docbeam.pipeline.records import TokenWindow
    from docbeam.pipeline.stages.encode import STARTUP_TAG, load_encoder
    from docbeam.pipeline.stages.packer import padded_batch, rows_for

    spec = standalone_spec(
        tiny_checkpoint_dir,
        "float32",
        "mean",
        AttentionConfig(),
        buckets=(16, 32),
        tokens_per_batch=256,
    )
    runtime = load_encoder(spec)
    report = runtime.take_startup_report(wait=True)  # once every shape has compiled in the background
    assert report["checkpoint_s"] > 0 and report["probes_s"] >= 0
    assert sorted((c["bucket_len"], c["rows"]) for c in report["compiles"]) == [(16, 16), (32, 8)]
    records = []
    for bucket in (16, 32, 16):
        window = TokenWindow("d", 0, 1, np.arange(1, 11, dtype=np.int32), 8, False)
        records.append(runtime.encode(padded_batch([window], bucket, rows_for(bucket, 256)))[1])
    assert not any(r["compiled"] for r in records) and all(r["compile_ms"] == 0 for r in records)
    assert all(STARTUP_TAG not in r for r in records)  # reported once
    assert runtime.take_startup_report(wait=True) is None


def test_the_worker_does_not_repeat_the_drivers_probes(monkeypatch, tiny_checkpoint_dir):
    from docbeam.attention import probe_once
    from docbeam.attention.dispatch import choose_backends
    from docbeam.attention.settings import AttentionConfig
    from docbeam.models.checkpoint import open_checkpoint
    from docbeam.models.encoder import attention_cases

    calls = []
    monkeypatch.setattr(probe_once, "probe", lambda spec, choice: calls.append(choice.case.seq_len))
    monkeypatch.setattr(probe_once, "_PROBED", set())
    spec = AttentionConfig()
    choices = choose_backends(spec, attention_cases(open_checkpoint(tiny_checkpoint_dir).config, (16, 32), "cpu"))
    for _ in range(2):  # the driver's plan, then the worker's runtime in the same process
        for choice in choices:
            probe_once.probe_once(spec, choice)
    assert calls == [16, 32]


def test_docbeam_run_imports_neither_torch_nor_transformers():
    code = (
        "import sys; import docbeam.pipeline.driver.cli, docbeam.pipeline.driver.run; "
        "from apache_beam.ml.inference import base; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokamax') if m in sys.modules), "
        "base.resource is not None)"
    )  # RunInference still reports the process's memory
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=checkout_env(), capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[] True"


def test_a_refused_config_answers_without_importing_beam():
    """A typo in the YAML is answered in about two seconds, not five: loading and refusing a config, and building
    the command's parser (the report's arguments too), import no part of Beam."""
    code = (
        "import sys; from docbeam.pipeline.driver.cli import main; "
        f"code = main(['validate', '--config', {os.path.join(REPO, 'configs', 'local.yaml')!r}, "
        "'--set', 'batching.bucket_size=3']); "
        "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'apache_beam', 'pyarrow', 'pandas'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=checkout_env(), capture_output=True, text=True)
    assert result.stdout.strip() == "2 []", result.stderr
    assert "batching.bucket_size: unknown key (got 3)" in result.stderr


def test_the_command_prints_the_first_batch_time_and_the_stage_shares(tiny_run):
    from docbeam.pipeline.driver.cli import format_summary

    output, summary, _ = tiny_run
    text = format_summary(summary, output)
    first = summary["startup"]["since_process_start_s"]["first_batch_started"]
    assert f"start-up   first batch after {first:.1f} s (imports " in text
    assert "stages     read " in text and ", other " in text


def test_the_process_start_is_before_now_and_close_to_the_os_clock():
    import psutil

    from docbeam.pipeline.telemetry.observe import process_started

    started = process_started()
    assert started <= time.time()
    assert abs(started - psutil.Process().create_time()) < 1.5  # psutil's boot time is whole seconds


def test_a_batch_whose_shape_is_still_compiling_compiles_it_itself_or_waits_never_twice(tiny_checkpoint_dir):
    from benchmarks.common import standalone_spec
    from docbeam.attention.settings import AttentionConfig
    from docbeam.pipeline.records import TokenWindow
    from docbeam.pipeline.stages.encode import STARTUP_TAG, load_encoder
    from docbeam.pipeline.stages.packer import padded_batch, rows_for

    buckets = (16, 32, 64, 128)
    runtime = load_encoder(
        standalone_spec(
            tiny_checkpoint_dir,
            "float32",
            "mean",
            AttentionConfig(),
            buckets=buckets,
            tokens_per_batch=512,
        )
    )
    window = TokenWindow("d", 0, 1, np.arange(1, 11, dtype=np.int32), 8, False)
    _, first = runtime.encode(padded_batch([window], 16, rows_for(16, 512)))  # bucket 16 is compiled last
    _, again = runtime.encode(padded_batch([window], 16, rows_for(16, 512)))
    reported = (first.get(STARTUP_TAG) or {}).get("compiles", []) + runtime.take_startup_report(wait=True)["compiles"]
    ahead = sorted(c["bucket_len"] for c in reported)
    if first["compiled"]:  # its turn had not come: compiled here, not in the background
        assert ahead == [32, 64, 128] and first["compile_ms"] > 0
    else:  # it was compiling already: this batch waited for it
        assert ahead == [16, 32, 64, 128]
    assert not again["compiled"] and again["compile_ms"] == 0

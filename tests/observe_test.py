"""What a run shows about itself: profiler traces naming the kernel, Beam metrics in the summary,
progress lines."""

from __future__ import annotations

import glob
import gzip
import json
import os

import pytest
from conftest import SAMPLE, job_config

from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.telemetry.observe import Progress


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, tiny_checkpoint_dir):
    output = str(tmp_path_factory.mktemp("profiled"))
    summary = run_job(
        job_config(SAMPLE, output, tiny_checkpoint_dir, profile={"batches": 2}, attention={"backend": "chunked"})
    )
    return output, summary


@pytest.mark.slow
def test_profile_trace_of_the_first_batches_names_the_attention_kernel(profiled_run):
    output, summary = profiled_run
    traces = glob.glob(f"{output}/profiles/{summary['run_id']}/*/plugins/profile/*/*.trace.json.gz")
    xplanes = glob.glob(f"{output}/profiles/{summary['run_id']}/*/plugins/profile/*/*.xplane.pb")
    assert len(traces) == 1 and len(xplanes) == 1  # one worker, one capture
    listed = {f["path"] for f in json.load(open(f"{output}/_manifest.json"))["files"]}
    assert {os.path.relpath(p, output) for p in traces + xplanes} <= listed  # committed with the run
    assert b"attention/chunked" in open(xplanes[0], "rb").read()  # what TensorBoard/XProf shows
    assert b"docbeam_embed" in gzip.open(traces[0]).read()  # what Perfetto shows


@pytest.mark.slow
def test_summary_carries_beam_metrics_that_agree_with_the_outputs(profiled_run):
    _, summary = profiled_run
    counters = summary["metrics"]["counters"]
    assert counters["docs_read"] == summary["docs_read"] == 400
    assert counters["docs_embedded"] == summary["docs_embedded"]
    assert counters["windows"] == summary["windows"]
    assert counters["real_tokens"] == summary["real_tokens"]
    assert counters["batches"] == summary["batches"]
    compute = {k: v for k, v in summary["metrics"]["distributions"].items() if k.startswith("compute_ms[")}
    compiled_in_batches = summary["compiles"] - summary["compiles_ahead"]
    assert sum(d["count"] for d in compute.values()) == summary["batches"] - compiled_in_batches  # steady only
    assert compute and all(name.endswith(",chunked]") for name in compute)  # per bucket and backend
    assert counters["num_inferences"] == summary["batches"]  # RunInference's own metrics come along


def test_summary_and_report_name_a_fallback_the_same_way():
    from docbeam.pipeline.stages.write import timing_stats
    from docbeam.pipeline.tools.report.data import fallbacks
    from docbeam.pipeline.tools.report.load import Run, batch_columns

    record = {
        "batch_id": "b16-x",
        "bucket_len": 16,
        "rows": 4,
        "real_rows": 1,
        "real_tokens": 10,
        "padded_tokens": 64,
        "attention_backend": "native",
        "attention_requested": "flash",
        "attention_kernel": "",
        "fallback_reason": "pallas_tpu runs on TPU, not cpu",
        "compiled": False,
        "compile_ms": 0.0,
        "compute_ms": 1.0,
        "total_ms": 1.0,
        "device": "cpu:0",
        "worker": "h:1",
        "started_at": "2026-11-29T00:00:00+00:00",
    }
    from_summary = timing_stats(record)["fallbacks"]
    from_batches = fallbacks(Run(path="", summary={}, batches=batch_columns([record]), errors=[]))
    assert from_summary == from_batches == {"flash->native: pallas_tpu runs on TPU, not cpu": 1}


def test_progress_lines_are_rate_limited_and_give_an_eta(monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 12.0, 13.0])
    monkeypatch.setattr("docbeam.pipeline.stages.encode.time.monotonic", lambda: next(clock))
    progress = Progress(every_s=10, total_windows=40)
    lines = [progress.update(2, 4, 100) for _ in range(4)]
    assert lines[:2] == [None, None] and lines[3] is None
    assert lines[2] == (
        "progress: 6 documents, 12 windows, 300 tokens in 12 s (25 tokens/s); "
        "30% of the job's 40 windows, ETA 28 s at this worker's rate"
    )


def test_progress_off_when_interval_is_zero():
    assert Progress(every_s=0).update(1, 1, 1) is None


class FakeChip:
    """A chip that reports its memory as a TPU or GPU does."""

    def __init__(self, id_: int, in_use: int, peak: int):
        self.platform, self.id, self.device_kind = "tpu", id_, "TPU v5 lite"
        self._stats = {"bytes_in_use": in_use, "peak_bytes_in_use": peak}

    def memory_stats(self):
        return self._stats


def test_on_a_mesh_the_fullest_chip_speaks_for_the_batch_and_each_chip_is_kept():
    from docbeam.pipeline.stages.write import memory_samples
    from docbeam.pipeline.telemetry.observe import describe_devices, memory

    chips = [FakeChip(0, 100, 150), FakeChip(1, 300, 320)]
    facts = memory(chips)
    assert (facts["memory_in_use_bytes"], facts["memory_peak_bytes"]) == (300, 320)
    assert facts["memory_per_device"] == {"tpu:0 (TPU v5 lite)": 100, "tpu:1 (TPU v5 lite)": 300}
    assert describe_devices(chips) == "tpu:0 (TPU v5 lite) +1"
    record = {"worker": "w", "device": describe_devices(chips), "started_at": "t", **facts}
    samples = memory_samples(record)
    assert [key for key, _ in samples] == ["w tpu:0 (TPU v5 lite)", "w tpu:1 (TPU v5 lite)"]
    assert [sample[1:3] for _, sample in samples] == [(100, 150), (300, 320)]  # each chip's own in use and peak
    one = memory(chips[:1])
    assert "memory_per_device" not in one and one["memory_in_use_bytes"] == 100

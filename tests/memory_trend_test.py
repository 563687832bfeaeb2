"""The leak alarm: the steady-state memory trend per worker, in summary.json, the report and the limit.

The rule is tested on synthetic series first (warm-up, a step, noise, slow and fast leaks), then on real runs:
a backend that keeps 3 MB per call is flagged and named, native over the same documents is not, and the
optional limit fails the run and leaves the output as it was."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from docbeam.pipeline.telemetry import memory_trend
from docbeam.pipeline.telemetry.memory_trend import MB, steady_growth, trend

BASE = 600 * MB


def series(n=200, warmup_mb=0.0, leak_mb_per_batch=0.0, noise_mb=0.0, step_at=None, step_mb=0.0, seed=0):
    rng = np.random.default_rng(seed)
    i = np.arange(n)
    warm = warmup_mb * MB * (1 - np.exp(-i / 5))  # compilations and caches filling early on
    leak = leak_mb_per_batch * MB * i
    step = np.where(i >= step_at, step_mb * MB, 0.0) if step_at is not None else 0.0
    return BASE + warm + leak + step + rng.normal(0, noise_mb * MB, n)


def verdict(values):
    return trend("w", list(values), list(values))


def test_flat_memory_after_warm_up_is_no_leak():
    t = verdict(series(warmup_mb=200))
    assert not t.leak_suspected and abs(t.growth_mb_per_1k_batches) < 1


def test_a_one_time_step_is_no_leak_wherever_it_falls():
    for step_at in (60, 100, 150, 190):
        t = verdict(series(warmup_mb=50, step_at=step_at, step_mb=300, noise_mb=2))
        assert not t.leak_suspected, step_at


def test_noise_alone_is_no_leak():
    for seed in range(20):
        assert not verdict(series(noise_mb=30, seed=seed)).leak_suspected, seed


def test_a_steady_leak_is_found_and_measured_despite_warm_up_and_noise():
    t = verdict(series(warmup_mb=300, leak_mb_per_batch=3, noise_mb=5))
    assert t.leak_suspected
    assert t.growth_mb_per_1k_batches == pytest.approx(3000, rel=0.05)


def test_a_slow_leak_over_a_long_run_is_found():
    # 0.1 MB per batch (100 MB per 1,000 batches) under 4 MB of noise, over 2,000 batches
    assert verdict(series(n=2000, warmup_mb=100, leak_mb_per_batch=0.1, noise_mb=4)).leak_suspected


def test_a_leak_below_the_threshold_is_reported_but_not_flagged():
    t = verdict(series(n=2000, leak_mb_per_batch=0.01))
    assert t.growth_mb_per_1k_batches == pytest.approx(10, rel=0.05) and not t.leak_suspected


def test_too_few_batches_are_not_judged_and_the_summary_says_so():
    t = verdict(series(n=10, leak_mb_per_batch=50))
    assert t.growth_mb_per_1k_batches is None and not t.leak_suspected
    assert "too few" in memory_trend.summary_block([t])["note"]


def test_summary_block_names_the_worst_worker_and_projects_it():
    calm, leaky = (
        verdict(series(noise_mb=1)),
        trend("host:7 cpu", list(series(leak_mb_per_batch=2)), list(series(leak_mb_per_batch=2))),
    )
    block = memory_trend.summary_block([calm, leaky], limit_mb_per_1k_batches=500)
    assert block["leak_suspected"] and block["worst_worker"] == "host:7 cpu"
    assert block["projected_bytes_at_10x"] > block["peak_bytes"] + 9 * 200 * 2 * MB * 0.9
    assert "on host:7 cpu" in memory_trend.over_limit(block)
    assert memory_trend.over_limit(memory_trend.summary_block([calm], 500)) is None


def test_growth_beside_the_start_up_compilations_is_warm_up_however_long_they_take():
    """From a cold cache a short job's shapes compile while its first batches run: 60% of them here."""
    i = np.arange(100)
    values = BASE + np.minimum(i, 60) * 2 * MB + i * 0.001 * MB  # climbs while compiling, then holds
    assert verdict(values).leak_suspected, "the series no longer shows what the flags are for"
    t = trend("w", list(values), list(values), warming=list(i < 60))
    assert not t.leak_suspected and t.growth_mb_per_1k_batches == pytest.approx(1.0, abs=0.01)


def test_only_the_start_up_compilations_extend_warm_up_so_a_leak_after_them_is_found():
    values = series(warmup_mb=300, leak_mb_per_batch=3, noise_mb=5)
    t = trend("w", list(values), list(values), warming=[k < 10 for k in range(len(values))])
    assert t.leak_suspected and t.growth_mb_per_1k_batches == pytest.approx(3000, rel=0.05)
    late = memory_trend.trend_from_samples(
        "w", [(f"2026-12-01T00:{k // 60:02d}:{k % 60:02d}", v, v, int(k < 10)) for k, v in enumerate(values)]
    )
    assert late == t  # timing records, in any order, say the same through trend_from_samples


def test_steady_growth_ignores_missing_figures():
    values = list(series(leak_mb_per_batch=2))
    values[50] = float("nan")
    growth, rising = steady_growth(values)
    assert rising and growth == pytest.approx(2 * MB, rel=0.05)


# --- real runs ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """The sample's first 100 documents: ~300 windows, ~150 batches of 256 tokens, far above the rule's 16 steady
    batches; the whole sample's 1,200 windows tripled the cost of each of the three runs here for no more signal."""
    from fixtures_sample import sample_head

    return sample_head(tmp_path_factory.mktemp("memory-corpus"), 100)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_checkpoint_dir, corpus):
    from conftest import job_config

    from docbeam.pipeline.driver.embed import encoder_spec
    from docbeam.pipeline.driver.plan import make_plan
    from docbeam.pipeline.driver.run import run_job
    from docbeam.pipeline.stages.encode import runtime_for

    summaries = {}
    for backend in ("native", "tests.fixtures_leaky_backend:attend"):
        output = str(tmp_path_factory.mktemp("memory"))
        cfg = job_config(
            corpus,
            output,
            tiny_checkpoint_dir,
            attention={"backend": backend},
            batching={"buckets": [32, 64, 128], "tokens_per_batch": 256, "packing": False},
        )
        # Its encoder loaded and every shape compiled before the job, as a worker's is once warm: from a cold cache
        # the compilations run into a job this short, and the batches beside them (warm-up) leave too few to judge.
        runtime_for(encoder_spec(make_plan(cfg, for_output=False))).take_startup_report(wait=True)
        summaries[backend] = (output, run_job(cfg))
    return summaries


@pytest.mark.slow
def test_a_leaking_backend_is_flagged_and_its_worker_named(runs):
    output, summary = runs["tests.fixtures_leaky_backend:attend"]
    memory = summary["memory"]
    assert summary["batches"] > 40
    assert memory["leak_suspected"] is True
    assert memory["worst_worker"] in memory["workers"] and memory["workers"][memory["worst_worker"]]["leak_suspected"]
    assert memory["growth_mb_per_1k_batches"] > 1000  # two layers x 3 MB per batch: ~6,000
    assert json.load(open(os.path.join(output, "summary.json")))["memory"] == memory


@pytest.mark.slow
def test_native_over_the_same_documents_is_not_flagged(runs):
    summary = runs["native"][1]
    memory = summary["memory"]
    assert summary["startup"]["encoder_s"] == {"reused": 0.0}  # warm, as the fixture made it
    assert memory["leak_suspected"] is False and memory["growth_mb_per_1k_batches"] is not None
    assert memory["rule"] == memory_trend.RULE


@pytest.mark.slow
def test_the_memory_limit_fails_the_run_and_leaves_the_output_unchanged(runs, tiny_checkpoint_dir, corpus):
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job
    from docbeam.pipeline.stages.commit import RunFailed

    output, _ = runs["native"]
    before = {name: open(os.path.join(output, name), "rb").read() for name in ("_manifest.json", "summary.json")}
    cfg = job_config(
        corpus,
        output,
        tiny_checkpoint_dir,
        attention={"backend": "tests.fixtures_leaky_backend:attend"},
        batching={"buckets": [32, 64, 128], "tokens_per_batch": 256, "packing": False},
        runner={"max_memory_growth_mb_per_1k_batches": 500},
        output={"path": output, "mode": "replace"},
    )
    with pytest.raises(RunFailed, match="max_memory_growth_mb_per_1k_batches=500"):
        run_job(cfg)
    assert {name: open(os.path.join(output, name), "rb").read() for name in before} == before


@pytest.mark.slow
def test_the_report_shows_the_trend_and_the_baseline_comparison_exits_1_for_a_new_leak(runs, tmp_path):
    import argparse

    from docbeam.pipeline.tools.report import command as report

    leaky, native = runs["tests.fixtures_leaky_backend:attend"][0], runs["native"][0]
    page = tmp_path / "leaky.html"
    args = argparse.Namespace(output=leaky, baseline=native, out=str(page), threshold=0.1)
    assert report.main(args) == 1
    html = page.read_text()
    assert "Memory leak suspected" in html and "projected at 10x the batches" in html
    regression = report.write_report(report.load_run(leaky), report.load_run(native), dest=str(tmp_path / "r.html"))
    assert [r.what for r in regression.regressions] == ["memory growth"]
    # The same leak against itself is no regression; native against the leak is none either.
    assert not report.write_report(
        report.load_run(leaky), report.load_run(leaky), dest=str(tmp_path / "same.html")
    ).regressions
    assert not report.write_report(
        report.load_run(native), report.load_run(leaky), dest=str(tmp_path / "better.html")
    ).regressions
    assert "Memory leak suspected" not in (tmp_path / "better.html").read_text()

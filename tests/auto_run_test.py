"""A whole run with ``attention.backend: auto`` and candidates that include a wrong kernel and a slow one: neither runs,
both are recorded in summary.json, the vectors equal sentence-transformers', and the next run reads the cached
choice. And every run says what it cost, in figures that add up (pipeline/telemetry/cost.py)."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
from conftest import SAMPLE, job_config
from pipeline_test import read_embeddings, read_jsonl, sample_texts

from docbeam.attention import measure
from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.telemetry import cost

WRONG, SLOW = "tests.fixtures_auto_candidates:returns_q", "tests.fixtures_auto_candidates:slow_native"


@pytest.fixture(scope="module")
def auto_runs(tmp_path_factory, real_checkpoint_dir):
    """Two runs of 40 sample documents with auto (the second on the first's measurement cache), at $0.50 an hour."""
    folder = tmp_path_factory.mktemp("auto")
    os.environ["XDG_CACHE_HOME"] = str(folder / "cache")  # the measurement cache: no compilation_cache set
    with gzip.open(SAMPLE, "rt") as f:
        lines = f.readlines()[:40]
    (folder / "docs.jsonl").write_text("".join(lines))
    runs = []
    for name in ("first", "second"):
        cfg = job_config(
            str(folder / "docs.jsonl"),
            str(folder / name),
            real_checkpoint_dir,
            attention={"backend": "auto", "candidates": ["chunked", WRONG, SLOW]},
            runner={"price_per_hour": 0.5},
            batching={"buckets": [128, 256], "tokens_per_batch": 2048},
        )
        runs.append((str(folder / name), run_job(cfg)))
        measure._MEASURED.clear()  # the next day's run is another process: it reads the cache on disk
    del os.environ["XDG_CACHE_HOME"]
    return runs


def test_neither_the_wrong_nor_the_slow_kernel_runs_and_both_are_recorded(auto_runs):
    output, summary = auto_runs[0]
    ran = {t["attention_backend"] for t in read_jsonl(output, "timing")}
    assert ran <= {"native", "chunked"}
    assert {t["attention_requested"] for t in read_jsonl(output, "timing")} == {"auto"}
    for line in summary["attention_plan"].values():
        m = line["measurement"]
        assert m["chosen"] == line["backend"] and line["measured_on"] == "the driver"
        assert m["candidates"][WRONG]["verdict"] == "mismatch" and m["candidates"][WRONG]["error"] > m["tolerance"]
        assert m["candidates"][SLOW]["verdict"] == "passed"
        assert m["candidates"][SLOW]["time_ms"] > m["candidates"]["native"]["time_ms"]
    assert summary["fallbacks"] == {}  # auto's choice is not a fallback


def test_auto_vectors_equal_sentence_transformers(auto_runs, real_checkpoint_dir):
    from sentence_transformers import SentenceTransformer

    output, _ = auto_runs[0]
    rows = {i: r for i, r in read_embeddings(output).items() if r["num_windows"] == 1}
    texts = sample_texts()
    ids = sorted(rows)
    reference = SentenceTransformer(real_checkpoint_dir, device="cpu").encode([texts[i] for i in ids])
    ours = np.array([rows[i]["embedding"] for i in ids], np.float32)
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert len(ids) >= 20 and cosine.min() >= 0.9999


def test_the_second_run_reads_the_cached_choice(auto_runs):
    (_, first), (_, second) = auto_runs
    for bucket, line in second["attention_plan"].items():
        m, before = line["measurement"], first["attention_plan"][bucket]["measurement"]
        assert m["cached"] and m["measure_s"] == 0 and not before["cached"]
        assert m["chosen"] == before["chosen"] and m["key"] == before["key"]


def test_the_cost_adds_up_from_its_own_fields(auto_runs):
    for _, summary in auto_runs:
        c = summary["cost"]
        assert c["price_per_hour"] == 0.5 and c["source"] == "runner.price_per_hour"
        assert c["workers"] == 1 and c["hours"] == pytest.approx(c["wall_seconds"] / 3600, abs=1e-6)
        assert c["usd"] == pytest.approx(c["price_per_hour"] * c["hours"], rel=1e-12)
        assert c["tokens"] == summary["real_tokens"] and c["documents"] == summary["docs_embedded"]
        assert c["usd_per_million_tokens"] == pytest.approx(c["usd"] / c["tokens"] * 1e6, rel=1e-12)
        assert c["usd_per_million_documents"] == pytest.approx(c["usd"] / c["documents"] * 1e6, rel=1e-12)
        assert "storage" in c["leaves_out"] and "driver" in c["leaves_out"]


def test_dataflow_machine_types_take_the_dated_table_and_the_config_overrides_it():
    price, source = cost.worker_price(None, "DataflowRunner", "ct5lp-hightpu-8t")
    assert price == 9.6 and "8 TPU v5e chips" in source and "as of 2026-07" in source and "https://" in source
    assert cost.worker_price(2.0, "DataflowRunner", "ct5lp-hightpu-8t") == (2.0, "runner.price_per_hour")
    price, source = cost.worker_price(None, "DirectRunner", None)
    assert price is None and "runner.price_per_hour" in source
    price, source = cost.worker_price(None, "DataflowRunner", "m9-mystery-1")
    assert price is None and "'m9-mystery-1'" in source
    for p in cost.PRICES.values():
        assert p.usd_per_hour > 0 and p.sources and p.as_of


def test_a_run_without_a_price_says_how_to_set_one_and_still_counts_hours():
    c = cost.cost_section(None, "no price for runner DirectRunner: set runner.price_per_hour", 7200.0, 3, 10**6, 500)
    assert c["usd"] is None and c["usd_per_million_tokens"] is None and c["hours"] == 6.0 and c["workers"] == 3
    assert "set runner.price_per_hour" in cost.describe(c)
    priced = cost.cost_section(1.5, "runner.price_per_hour", 7200.0, 3, 10**6, 0)
    assert priced["usd"] == 9.0 and priced["usd_per_million_tokens"] == 9.0
    assert priced["usd_per_million_documents"] is None  # no documents: no figure, never a division by zero


def test_the_cli_summary_shows_the_cost_and_what_auto_chose(auto_runs):
    from docbeam.pipeline.driver.cli import format_summary

    text = format_summary(auto_runs[0][1], auto_runs[0][0])
    assert "cost       $" in text and "per million tokens" in text
    assert "requested auto" in text and "measured 128: " in text


def test_the_report_shows_the_measurement_and_the_cost_and_compares_the_cost(auto_runs, tmp_path):
    from docbeam.pipeline.tools.report import command as report
    from docbeam.pipeline.tools.report import data as report_data
    from docbeam.pipeline.tools.report import load as report_load

    (first, _), (second, _) = auto_runs
    page = open(report.report(first, dest=str(tmp_path / "r.html")).path).read()
    assert "Attention measured per bucket" in page and "returns_q" in page and "mismatch" in page
    assert "<h3>Cost</h3>" in page and "leaves_out" in page
    run, baseline = report_load.load_run(second), report_load.load_run(first)
    dearer = dict(run.summary, cost={**run.summary["cost"], "usd_per_million_tokens": 1.0})
    cheaper = dict(baseline.summary, cost={**baseline.summary["cost"], "usd_per_million_tokens": 0.5})
    found = report_data.compare(
        report_load.Run(run.path, dearer, run.batches, run.errors),
        report_load.Run(baseline.path, cheaper, baseline.batches, baseline.errors),
        threshold=0.9,  # the cost doubles: flagged; latency on a shared machine is not under test here
    )
    (dear,) = [r for r in found if r.what == "cost"]
    assert "+100.0%" in dear.detail and (dear.baseline, dear.current) == (0.5, 1.0)
    same = report_load.Run(baseline.path, dearer, baseline.batches, baseline.errors)
    assert not [r for r in report_data.compare(same, same, threshold=0.1) if r.what == "cost"]


def test_the_summary_counts_each_worker_and_takes_the_workers_choice_where_their_chip_is_another():
    from docbeam.pipeline.stages.commit import with_workers_measurements

    laptop = {"chosen": "native", "why": "fastest", "device": "cpu: cpu (laptop)", "candidates": {}}
    c3 = {"chosen": "chunked", "why": "fastest: 1.4x native", "device": "cpu: cpu (Xeon)", "candidates": {}}
    plan = {"128": {"backend": "native", "measurement": laptop, "measured_on": "the driver"}}
    seen = {"128": {json.dumps(c3, sort_keys=True): 50}}  # fifty workers' first batches, one text
    line = with_workers_measurements(plan, seen)["128"]
    assert line["workers_chose"] == {"chunked": 50}
    assert (line["backend"], line["measurement"]["device"], line["measured_on"]) == (
        "chunked",
        c3["device"],
        "the workers",
    )
    same = with_workers_measurements(plan, {"128": {json.dumps(laptop): 3}})["128"]
    assert (same["backend"], same["measured_on"], same["workers_chose"]) == ("native", "the driver", {"native": 3})


@pytest.mark.parametrize("price", [float("inf"), float("nan"), -1.0, "cheap"])
def test_a_price_that_is_not_a_finite_non_negative_number_is_refused_naming_the_key(price):
    from docbeam import config
    from docbeam.config import ConfigError

    with pytest.raises(ConfigError, match="runner.price_per_hour"):
        config.parse(
            {"input": {"path": "x"}, "output": {"path": "/tmp/o"}, "runner": {"price_per_hour": price}}, base_dir="/"
        )

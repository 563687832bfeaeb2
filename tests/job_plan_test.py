"""One JobPlan, built once on the driver, that the workers obey: the backend per bucket comes from the plan
(not from the YAML, not from a second choice on the worker); a worker on another platform re-plans and every
timing record says so; and the user's JobConfig never carries plan results."""

from __future__ import annotations

import dataclasses

import apache_beam as beam
import numpy as np
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that
from conftest import SAMPLE, job_config

from docbeam.pipeline.driver.plan import make_plan
from docbeam.pipeline.driver.run import encoder_spec, run_job
from docbeam.pipeline.records import TokenWindow
from docbeam.pipeline.stages.encode import Encode, load_encoder
from docbeam.pipeline.stages.packer import padded_batch, rows_for

NATIVE_OR_CHUNKED = {"backend": "native", "fallback": "chunked"}  # both bindable; the YAML alone runs native
UNPACKED = {"packing": False}  # the batches below are padded, one window per row


def one_batch_per_bucket(buckets, tokens_per_batch=512) -> list:
    window = TokenWindow("d", 0, 1, np.arange(1, 11, dtype=np.int32), 8, False)
    return [
        padded_batch([dataclasses.replace(window, doc_id=f"d{b}")], b, rows_for(b, tokens_per_batch)) for b in buckets
    ]


def with_backend(plan, bucket: int, backend: str):
    """The plan with ``bucket`` run by ``backend``: what a driver's choice looks like to the workers."""
    choices = tuple(
        dataclasses.replace(c, backend=backend, kernel="", fallback_reason="chosen by the test's plan")
        if c.case.seq_len == bucket
        else c
        for c in plan.choices
    )
    return dataclasses.replace(plan, encoder_plan=dataclasses.replace(plan.encoder_plan, choices=choices))


def test_the_workers_run_the_backend_the_plan_chose_for_each_bucket(tiny_checkpoint_dir, tmp_path):
    cfg = job_config(SAMPLE, str(tmp_path / "out"), tiny_checkpoint_dir, attention=NATIVE_OR_CHUNKED, batching=UNPACKED)
    plan = make_plan(cfg)
    assert {c.backend for c in plan.choices} == {"native"} and plan.buckets == (32, 128)
    plan = with_backend(plan, 128, "chunked")

    def ran_as_planned(timings):
        ran = sorted((t["bucket_len"], t["attention_backend"], t["replanned"]) for t in timings)
        assert ran == [(b, "chunked" if b == 128 else "native", None) for b in plan.buckets], ran

    with TestPipeline() as p:
        encoded = (
            p
            | beam.Create(one_batch_per_bucket(plan.buckets))
            | Encode(encoder_spec(plan, str(tmp_path / "staging"), "run"), p | "Total" >> beam.Create([4]))
        )
        assert_that(encoded["timing"], ran_as_planned)


def test_the_workers_receive_the_plans_encoder_part_as_it_is_and_key_their_encoder_by_it(tiny_checkpoint_dir, tmp_path):
    import pickle

    cfg = job_config(SAMPLE, str(tmp_path / "out"), tiny_checkpoint_dir, batching=UNPACKED)
    plan = make_plan(cfg)
    spec = encoder_spec(plan, str(tmp_path / "staging"), "run")
    assert spec.plan is plan.encoder_plan and spec.plan.attention is cfg.attention  # referenced, not copied
    received = pickle.loads(pickle.dumps(spec))  # what a worker receives
    assert received == spec and hash(received) == hash(spec)
    # The driver's early load and the worker's spec are made apart for one run, and for another run of the same
    # job too: each finds the same warm encoder.
    assert encoder_spec(plan, str(tmp_path / "staging"), "another run") == spec


def test_a_worker_on_another_platform_replans_and_every_record_says_so(tiny_checkpoint_dir, tmp_path):
    cfg = job_config(
        SAMPLE,
        str(tmp_path / "out"),
        tiny_checkpoint_dir,
        runner={"device": "tpu"},
        attention={"backend": "flash", "flash": {"kernel": "pallas_tpu"}, "fallback": "native"},
        batching=UNPACKED,
    )
    plan = make_plan(cfg)  # for TPU: flash everywhere, and nothing probed on this CPU driver
    assert plan.platform == "tpu" and not plan.checked and {c.backend for c in plan.choices} == {"flash"}
    runtime = load_encoder(encoder_spec(plan, str(tmp_path / "staging"), "run"))
    records = [runtime.encode(b)[1] for b in one_batch_per_bucket(plan.buckets)]
    assert {r["replanned"] for r in records} == {"planned tpu, worker cpu"}
    assert {r["attention_backend"] for r in records} == {"native"}  # flash's TPU kernel is refused on CPU
    assert all("TPU" in r["fallback_reason"] for r in records)


def test_a_worker_on_the_planned_platform_does_not_choose_again(tiny_checkpoint_dir, tmp_path):
    cfg = job_config(SAMPLE, str(tmp_path / "out"), tiny_checkpoint_dir, attention=NATIVE_OR_CHUNKED, batching=UNPACKED)
    plan = with_backend(make_plan(cfg), 128, "chunked")
    runtime = load_encoder(encoder_spec(plan, str(tmp_path / "staging"), "run"))
    records = [runtime.encode(b)[1] for b in one_batch_per_bucket((32, 128))]
    assert [(r["attention_backend"], r["replanned"]) for r in records] == [("native", None), ("chunked", None)]


def test_the_plan_keeps_the_config_as_given_and_a_run_leaves_it_unchanged(tiny_checkpoint_dir, tmp_path):
    cfg = job_config(SAMPLE, str(tmp_path / "out"), tiny_checkpoint_dir, batching={"buckets": [16, 32, 64, 128, 256]})
    given = cfg.model_dump()
    plan = make_plan(cfg)
    assert plan.config == cfg  # packing auto, every bucket, the path as written: the plan holds what it resolved
    assert cfg.batching.packing == "auto" and plan.packing is True and plan.buckets == (16, 32, 64, 128)
    assert plan.batching().buckets == plan.buckets and plan.batching().packing is True
    summary = run_job(cfg)
    assert cfg.model_dump() == given
    assert summary["packing"] is True and summary["config_digest"] == cfg.digest()

"""``batching.shards: auto`` gives every process that encodes its batch keys (pipeline/driver/shards.py): packed
batches are keyed by shard alone, so 16 shards would cap a 160-process Dataflow job at 16 busy processes."""

from __future__ import annotations

import os

import pytest

from docbeam import config
from docbeam.pipeline.driver.shards import encoding_processes, machine_vcpus, resolved_shards

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "machine, vcpus",
    [
        ("n2-standard-8", 8),
        ("c3-highcpu-22", 22),
        ("g2-standard-4", 4),
        ("ct5lp-hightpu-1t", 1),
        ("ct6e-standard-4t", 4),
        ("n1-custom-8-32768", 8),
        ("custom-6-16384", 6),
        (None, 1),
    ],
)
def test_a_machine_types_vcpus_come_from_its_name(machine, vcpus):
    assert machine_vcpus(machine) == vcpus


@pytest.mark.parametrize(
    "profile, shards", [("dataflow_cpu", 2 * 20 * 8), ("dataflow_gpu", 2 * 8), ("dataflow_tpu", 2 * 4), ("local", 1)]
)
def test_each_profile_has_two_keys_per_encoding_process(profile, shards):
    cfg = config.load(os.path.join(REPO, "configs", f"{profile}.yaml"))
    assert resolved_shards(cfg.batching, cfg.runner) == shards


def test_auto_counts_dataflows_workers_and_the_directrunners():
    assert encoding_processes("DataflowRunner", {"num_workers": 3, "machine_type": "n2-standard-4"}, False) == 12
    assert encoding_processes("DataflowRunner", {"machine_type": "n2-standard-4"}, True) == 1000
    assert encoding_processes("DirectRunner", {"direct_num_workers": 2}, False) == 2
    assert encoding_processes("DirectRunner", {}, False) == 1


def test_a_number_stays_the_number_and_anything_else_is_refused():
    cfg = config.load(os.path.join(REPO, "configs", "dataflow_cpu.yaml"), ["batching.shards=7"])
    assert resolved_shards(cfg.batching, cfg.runner) == 7
    with pytest.raises(config.ConfigError, match="batching.shards"):
        config.load(os.path.join(REPO, "configs", "dataflow_cpu.yaml"), ["batching.shards=many"])


def test_beam_options_after_the_double_dash_count_as_they_would_in_runner_options():
    from docbeam.pipeline.driver.shards import with_beam_args

    local = config.load(os.path.join(REPO, "configs", "local.yaml"), ["batching.shards=auto"])
    given = with_beam_args(local, ["--direct_num_workers=3", "--save_main_session"])
    assert resolved_shards(given.batching, given.runner) == 2 * 3
    profile = config.load(
        os.path.join(REPO, "configs", "local.yaml"), ["batching.shards=auto", "runner.options.direct_num_workers=3"]
    )
    assert resolved_shards(given.batching, given.runner) == resolved_shards(profile.batching, profile.runner)
    # later flags win, as Beam reads them; a flag docbeam does not read changes nothing
    assert with_beam_args(profile, ["--direct_num_workers=1"]).runner.options["direct_num_workers"] == 1
    assert with_beam_args(local, ["--save_main_session"]) is local
    dataflow = with_beam_args(local, ["--machine_type=ct5lp-hightpu-8t"])
    assert dataflow.runner.machine_type() == "ct5lp-hightpu-8t"  # the price table reads it too
    # Beam keeps --worker_machine_type under machine_type: either spelling replaces the config's
    profile = config.load(os.path.join(REPO, "configs", "dataflow_cpu.yaml"), ["batching.shards=auto"])
    spelled = with_beam_args(profile, ["--worker_machine_type=n2-standard-4"])
    assert spelled.runner.machine_type() == "n2-standard-4"
    assert resolved_shards(spelled.batching, spelled.runner) == 2 * 20 * 4


def test_a_run_given_direct_num_workers_after_the_double_dash_plans_its_shards_for_them(tiny_checkpoint_dir, tmp_path):
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"id": "d{i}", "text": "river number {i} runs"}}\n' for i in range(6)))
    cfg = job_config(str(docs), str(tmp_path / "out"), tiny_checkpoint_dir, batching={"shards": "auto"})
    summary = run_job(cfg, ["--direct_num_workers=3"])
    assert summary["batch_shards"] == 6 and summary["docs_embedded"] == 6

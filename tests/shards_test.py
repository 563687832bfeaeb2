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

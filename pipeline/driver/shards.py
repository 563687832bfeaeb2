"""``batching.shards: auto``: enough batch keys for every process that encodes.

Packed batches are keyed by shard alone (pipeline/stages/batch.py), and one key's batches are made by one
process at a time, so a job with 16 shards keeps at most 16 processes encoding, however many workers it has.
``auto`` counts the processes the runner will start, from the options the job already gives: Dataflow's
``max_num_workers`` (else ``num_workers``, else its batch default of 1,000 workers at most) times the SDK
processes per worker (one per vCPU of ``machine_type``, or one with ``runner.one_model_per_vm``), the
DirectRunner's ``direct_num_workers``. Each process gets ``KEYS_PER_PROCESS`` keys, so a crc32 spread of the
windows leaves none idle; a number stays the number it is.
"""

from __future__ import annotations

import re

KEYS_PER_PROCESS = 2
DATAFLOW_MAX_WORKERS = 1000  # Dataflow's batch default for max_num_workers when autoscaling sets none
DEFAULT_VCPUS = 1  # Dataflow's batch default machine type, n1-standard-1, has one vCPU
MACHINE_VCPUS = re.compile(r"-(\d+)(?:t|g)?$")  # n2-standard-8, c3-highcpu-22, ct5lp-hightpu-1t, g2-standard-4


def machine_vcpus(machine_type: str | None) -> int:
    """vCPUs a Compute Engine machine type name ends with (custom-8-32768: 8); the default type's when unset."""
    if not machine_type:
        return DEFAULT_VCPUS
    custom = re.match(r"(?:\w+-)?custom-(\d+)-\d+", machine_type)
    found = custom or MACHINE_VCPUS.search(machine_type)
    return int(found.group(1)) if found else DEFAULT_VCPUS


def encoding_processes(runner: str, options: dict, one_model_per_vm: bool) -> int:
    """How many processes may encode at once on ``runner`` with these Beam ``options``."""
    if runner.endswith("DataflowRunner"):
        workers = int(options.get("max_num_workers") or options.get("num_workers") or DATAFLOW_MAX_WORKERS)
        per_worker = (
            1 if one_model_per_vm else machine_vcpus(options.get("machine_type") or options.get("worker_machine_type"))
        )
        return workers * per_worker
    return int(options.get("direct_num_workers") or 1)


def resolved_shards(batching, runner) -> int:
    """``batching.shards`` as the job runs it: the number given, or ``auto``'s count (``runner``: the config's
    runner section)."""
    if batching.shards != "auto":
        return batching.shards
    return KEYS_PER_PROCESS * encoding_processes(runner.name, runner.options, runner.one_model_per_vm)

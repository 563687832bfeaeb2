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

# The Beam options docbeam reads at start (the processes that encode, the worker's machine type for its price):
# given after ``--`` they count as they would in runner.options.
READ_OPTIONS = ("direct_num_workers", "num_workers", "max_num_workers", "machine_type", "worker_machine_type")
BEAM_DEST = {"worker_machine_type": "machine_type"}  # the flag → the option Beam stores it as
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


def with_beam_args(cfg, beam_args):
    """``cfg`` with the READ_OPTIONS that ``beam_args`` (``docbeam run ... -- --direct_num_workers=3``) set put into
    runner.options, so the plan counts what the job will run with (later flags win, as Beam reads them)."""
    if not beam_args:
        return cfg
    from apache_beam.options.pipeline_options import PipelineOptions

    given = PipelineOptions(list(beam_args)).get_all_options(retain_unknown_options=False)
    named = [arg.split("=", 1)[0].lstrip("-") for arg in beam_args if arg.startswith("--")]
    # Beam keeps --worker_machine_type under machine_type: either spelling sets it, and replaces the config's.
    read = {BEAM_DEST.get(key, key): given[BEAM_DEST.get(key, key)] for key in named if key in READ_OPTIONS}
    if "machine_type" in read:
        cfg = cfg.model_copy(
            update={
                "runner": cfg.runner.model_copy(
                    update={"options": {k: v for k, v in cfg.runner.options.items() if k != "worker_machine_type"}}
                )
            }
        )
    if not read:
        return cfg
    runner = cfg.runner.model_copy(update={"options": {**cfg.runner.options, **read}})
    return cfg.model_copy(update={"runner": runner})


def resolved_shards(batching, runner) -> int:
    """``batching.shards`` as the job runs it: the number given, or ``auto``'s count (``runner``: the config's
    runner section)."""
    if batching.shards != "auto":
        return batching.shards
    return KEYS_PER_PROCESS * encoding_processes(runner.name, runner.options, runner.one_model_per_vm)

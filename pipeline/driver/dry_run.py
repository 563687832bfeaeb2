"""``docbeam run --dry-run``: build the Dataflow job exactly as a run would, and submit nothing.

Beam's own ``--dry_run`` makes DataflowRunner do everything up to the submission: translate the graph,
pickle every DoFn, resolve the worker environment, and add its own options (Runner v2's experiments among
them) to the pipeline's copy of the options. The job's environment (the worker pool and the options the
workers receive) is built from that copy only at submission, so it is built here the same way, from the
runner's own ``Job``: what is printed is what the request would carry. The resolved input and output paths
and the compilation cache are printed beside it, and the profiles' placeholders are refused (exit 2). No
lock is taken and neither input nor output is read or written.
"""

from __future__ import annotations

import dataclasses
import time

import apache_beam as beam

from docbeam import placeholders
from docbeam.config import ConfigError, JobConfig
from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage
from docbeam.pipeline.store.lock import Fence

# Options a reader checks before a submission, by Beam's names, in this order.
SHOWN_OPTIONS = (
    "project",
    "region",
    "job_name",
    "temp_location",
    "staging_location",
    "sdk_container_image",
    "machine_type",
    "dataflow_service_options",
    "experiments",
    "num_workers",
    "max_num_workers",
    "autoscaling_algorithm",
    "disk_size_gb",
    "number_of_worker_harness_threads",
    "service_account_email",
    "network",
    "subnetwork",
    "use_public_ips",
)
PARDO_URN = "beam:transform:pardo:v1"
PICKLED_DOFN_URN = "beam:dofn:pickled_python_info:v1"


@dataclasses.dataclass(frozen=True)
class DryRun:
    run_id: str
    platform: str
    paths: dict  # input.path, output.path, runner.compilation_cache: as this run resolves them
    attention: dict  # bucket -> "backend [kernel]" (fallback reason)
    options: dict  # Beam option name -> value, as the workers would receive them (after the runner's additions)
    worker_pool: dict  # what Dataflow's job environment would ask for
    service_options: tuple[str, ...]
    experiments: tuple[str, ...]
    steps: int
    pickled_dofns: int
    memory: str = ""  # the memory plan at start: the mesh and what each chip holds

    def describe(self) -> str:
        lines = [
            f"# dry run {self.run_id}: the Dataflow job was built (graph translated, every DoFn pickled, "
            "environment resolved) and not submitted",
            "# paths (resolved for this run)",
        ]
        lines += [f"  {key}: {value}" for key, value in self.paths.items()]
        lines.append(f"# attention planned for {self.platform}:")
        lines += [f"  bucket {bucket:>5} -> {choice}" for bucket, choice in self.attention.items()]
        lines.append(f"# memory plan, per chip of the worker: {self.memory}")
        lines.append("# pipeline options (Beam's names, as submitted: the runner's additions included)")
        lines += [f"  {key}: {value}" for key, value in self.options.items()]
        lines.append("# job environment (what Dataflow would create)")
        lines += [f"  {key}: {value}" for key, value in self.worker_pool.items()]
        lines += [
            f"  service_options: {list(self.service_options)}",
            f"  experiments: {list(self.experiments)}",
            f"# graph: {self.steps} transforms, {self.pickled_dofns} pickled DoFns (each unpickled again)",
        ]
        return "\n".join(lines)


def dry_run(cfg: JobConfig, extra_beam_args: list[str] = ()) -> DryRun:
    from apache_beam.runners.dataflow.internal import apiclient

    from docbeam.pipeline.driver.plan import make_plan
    from docbeam.pipeline.driver.run import build

    if cfg.runner.name != placeholders.DATAFLOW:
        raise ConfigError(
            f"--dry-run builds a Dataflow job, but runner.name is {cfg.runner.name!r}; use a "
            "Dataflow profile (e.g. --config configs/dataflow_tpu.yaml) or --set "
            "runner.name=DataflowRunner"
        )
    run_id = output_lib.new_run_id()
    cfg = placeholders.expand(cfg, run_id, output_lib.run_date())
    plan = make_plan(cfg, for_output=False, for_input=False)
    options = storage.pipeline_options(cfg.runner.beam_args() + list(extra_beam_args) + ["--dry_run=True"])
    # Before building: the values as the user gave them (the runner appends the job's name to the locations).
    placeholders.refuse(cfg, options.get_all_options(retain_unknown_options=True))
    try:
        p = beam.Pipeline(options=options)  # Beam validates the options here (project id, locations, ...)
        # A fence that is never proven: a dry run takes no lock, and its commit step is only pickled, never run.
        build(p, plan, Fence(cfg.output.path, run_id, token=0), time.time())
        result = p.run()
    except ValueError as e:
        raise ConfigError(f"runner.options: Dataflow refuses these options: {' '.join(str(e).split())}") from None
    job = result.job  # the runner's Job: its options are the pipeline's copy, with the runner's additions
    proto = job.proto_pipeline
    env = apiclient.Environment(
        [], job.options, apiclient._FNAPI_ENVIRONMENT_MAJOR_VERSION, None, proto_pipeline=proto
    ).proto
    submitted = dict(env.sdk_pipeline_options["options"])
    pool = env.worker_pools[0]
    return DryRun(
        run_id=run_id,
        platform=plan.platform,
        paths={
            "input.path": cfg.input.path,
            "output.path": cfg.output.path,
            "runner.compilation_cache": cfg.runner.compilation_cache or "(none: every job compiles afresh)",
        },
        attention={
            c.case.seq_len: f"{c.backend}"
            + (f" [{c.kernel}]" if c.kernel else "")
            + (f" ({c.fallback_reason})" if c.fallback_reason else "")
            for c in plan.choices
        },
        options={k: plain(submitted[k]) for k in SHOWN_OPTIONS if submitted.get(k) not in (None, [], False)},
        worker_pool={
            "machine_type": pool.machine_type,
            "disk_size_gb": pool.disk_size_gb,
            "num_workers": pool.num_workers or "(Dataflow's default)",
            "max_num_workers": pool.autoscaling_settings.max_num_workers,
            "worker_harness_container_image": pool.worker_harness_container_image,
            "sdk_harness_container_images": [i.container_image for i in pool.sdk_harness_container_images],
            "region": submitted["region"],
        },
        service_options=tuple(env.service_options),
        experiments=tuple(env.experiments),
        steps=len(proto.components.transforms),
        pickled_dofns=unpickle_dofns(proto),
        memory=plan.memory.describe(),
    )


def plain(value):
    """An option as the request's Struct holds it (lists as protobuf lists, integers as floats), as YAML would
    show it: the printed value is the submitted one."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, (str, int, float, bool)) and hasattr(value, "__iter__"):
        return [plain(v) for v in value]
    return value


def unpickle_dofns(proto) -> int:
    """How many ParDos carry a pickled DoFn; each is unpickled, so one that cannot travel fails here."""
    from apache_beam.internal import pickler
    from apache_beam.portability.api import beam_runner_api_pb2

    count = 0
    for transform in proto.components.transforms.values():
        if transform.spec.urn != PARDO_URN:
            continue
        payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload)
        if payload.do_fn.urn == PICKLED_DOFN_URN:
            pickler.loads(payload.do_fn.payload)
            count += 1
    return count

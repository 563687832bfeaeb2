"""Build and run the job: read → tokenize → bucket → encode → pool → write → commit.

The driver plans (pipeline/driver/plan.py: every check that must fail at start), takes the output's lock, cleans
up after dead runs, and runs the pipeline, whose last step commits the output (pipeline/stages/commit.py). A
run that fails commits nothing: the previous output stays as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time

import apache_beam as beam

from docbeam import placeholders
from docbeam.errors import JobFailed, Refused, refused_at_start
from docbeam.pipeline import compat, sinks
from docbeam.pipeline.driver import embed, precision_gate_at_start
from docbeam.pipeline.driver.plan import JobPlan, check_output, make_plan, versions
from docbeam.pipeline.driver.run_summary import leave_failed_summary, metrics_dict, timing_records
from docbeam.pipeline.driver.select_branch import select_documents
from docbeam.pipeline.driver.shards import with_beam_args
from docbeam.pipeline.driver.sink_files import sink_files
from docbeam.pipeline.sinks import SinkBehind
from docbeam.pipeline.stages import vectors
from docbeam.pipeline.stages.commit import MEMORY_LIMIT, CommitRun, RunFailed
from docbeam.pipeline.stages.encode import EncoderSpec, runtime_for, stop_compiling
from docbeam.pipeline.stages.encode_documents import EncodeDocuments
from docbeam.pipeline.stages.read import ReadDocuments
from docbeam.pipeline.stages.reuse import SplitByReuse
from docbeam.pipeline.stages.window_chunks import WriteChunks
from docbeam.pipeline.stages.write import WriteOutputs, rows_schema
from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage, transaction
from docbeam.pipeline.store.lock import Fence, OutputLock
from docbeam.pipeline.telemetry import cost
from docbeam.pipeline.telemetry.breakdown import stage_shares, startup_breakdown

log = logging.getLogger(__name__)


def encoder_spec(plan: JobPlan, staging: str, run_id: str) -> EncoderSpec:
    return embed.encoder_spec(plan, plan.config.profile.batches, output_lib.profiles_dir(staging, run_id), run_id)


def in_process_worker(cfg, options) -> bool:
    """Whether this process will also encode: the DirectRunner's default in-memory mode runs the workers
    as threads of the driver (its multi_processing mode and every other runner start their own)."""
    from apache_beam.options.pipeline_options import DirectOptions

    return compat.is_direct_runner(cfg.runner.name) and options.view_as(DirectOptions).direct_running_mode in (
        None,
        "in_memory",
    )


def load_encoder_early(plan: JobPlan, spec: EncoderSpec, options) -> threading.Thread | None:
    """Start loading the encoder (checkpoint, probes, then its compilations in the background) in a thread
    while Beam builds the graph, reads and tokenizes, when this process's workers will use it
    (``runtime_for`` hands them this one). Not for runs whose encoder may have nothing to do (reuse), nor
    ones that set the worker's environment or share the encoder between processes: those load it as the
    worker starts."""
    cfg = plan.config
    if (
        not in_process_worker(cfg, options)
        or plan.reuse.source is not None
        or cfg.runner.worker_env
        or cfg.runner.one_model_per_vm
    ):
        return None

    def load():
        try:
            runtime_for(spec)
        except Exception as e:  # noqa: BLE001  the worker loads it again and fails the job with the reason
            log.info("loading the encoder early failed (%s: %s); the worker loads it itself", type(e).__name__, e)

    thread = threading.Thread(target=load, name="docbeam-load-encoder", daemon=True)
    thread.start()
    return thread


def summary_base(plan: JobPlan, run_id: str, started: float) -> dict:
    """What summary.json says that the driver knows before the job starts."""
    cfg = plan.config
    return {
        "run_id": run_id,
        "started": started,
        "output": cfg.output.path,
        "attention_requested": cfg.attention.backend,
        "attention_plan": {str(c.case.seq_len): planned_choice(c) for c in plan.choices},
        "model": plan.model_path,
        "window_len": plan.window_len,
        "pooling": plan.pooling,
        "normalize": plan.normalize,
        "embedding_dim": plan.width,
        "truncate_dim": plan.truncate_dim,
        "head": plan.head.describe(),
        **({"embedding": vectors.describe(plan.width, cfg.output.vector_dtype)} if plan.head.quantized else {}),
        "dtype": cfg.model.dtype,
        "platform": plan.platform,
        # runner.mesh on the worker's chips, and what each chip holds (the memory plan at start)
        "mesh": plan.memory.mesh.as_dict(),
        "memory_plan": plan.memory.as_dict(),
        "runner": cfg.runner.name,
        "packing": plan.packing,
        "batch_shards": plan.batching().shards,
        "granularity": cfg.output.granularity,
        "chunking": cfg.output.chunking,
        **({"context_len": plan.context_len} if plan.context_len else {}),
        "config_digest": cfg.digest(),
        "versions": versions(),
        "reuse_key": plan.reuse_key,
        "reuse": plan.reuse.describe(),
        "kept_fields": plan.kept.describe(),
        **({"select": cfg.output.select.model_dump()} if cfg.output.select else {}),
        **{sink.key: planned for sink, section in sinks.active(cfg) if (planned := sink.planned(section, plan))},
        "precision_gate": plan.precision_gate,
        "price": dict(
            zip(
                ("usd_per_hour", "source"),
                cost.worker_price(cfg.runner.price_per_hour, cfg.runner.name, cfg.runner.machine_type()),
            )
        ),
        MEMORY_LIMIT: cfg.runner.max_memory_growth_mb_per_1k_batches,
    }


def planned_choice(c) -> dict:
    """A bucket's line of summary.json's attention plan: what runs and why; for auto the measurement, or that the
    workers measure (their measurements are added when the run ends: pipeline/stages/commit.py)."""
    out = {"backend": c.backend, "kernel": c.kernel, "fallback_reason": c.fallback_reason}
    if c.requested == "auto":
        out.update(
            {"backend": None, "kernel": "", "measured_on": "the workers"}
            if c.measurement is None
            else {"measured_on": "the driver", "measurement": c.measurement.as_dict()}
        )
    return out


def build(p: beam.Pipeline, plan: JobPlan, fence: Fence, started: float, release_lock: bool = True) -> None:
    cfg = plan.config
    run_id = fence.run_id
    staging = output_lib.staging_dir(cfg.output.path, run_id)
    read = p | "ReadDocuments" >> ReadDocuments(cfg.input, plan.kept)
    if plan.reuse.source is not None:
        split = read["documents"] | "SplitByReuse" >> SplitByReuse(plan.reuse.source, plan.head, plan.prompt)
        to_encode, reused = split["to_encode"], split["reused"]
    else:
        to_encode, reused = read["documents"], p | "NothingReused" >> beam.Create([])
    embedded = to_encode | "Embed" >> EncodeDocuments(plan, encoder_spec(plan, staging, run_id))
    # An incremental run keeps the calibration its reused rows were quantized with (docs/outputs.md#vector-dtypes).
    # A head that types its own vectors (models/heads/: Head.quantized) passes through as float32.
    quantized = embedded["embeddings"] | "QuantizeVectors" >> vectors.QuantizeVectors(
        cfg.output.vector_dtype if plan.head.quantized else "float32",
        run_id,
        plan.reuse.source.calibration if plan.reuse.source else None,
    )
    rejected = (read["rejected"], embedded["rejected"], quantized["rejected"]) | "AllRejected" >> beam.Flatten()
    calibration = {"calibration": quantized["calibration"]} if "calibration" in quantized else {}
    sinks_out = sink_files(plan, staging, run_id, read, quantized["rows"], reused)
    selection = select_documents(plan, staging, run_id, read, quantized["rows"], reused, sinks_out.marked)
    selected = {"selected": selection["selected"]} if selection else {}
    sink_stats = {"sink_stats": sinks_out.stats | "AllSinkStats" >> beam.Flatten()} if sinks_out.stats else {}
    written = {
        "encoded": quantized["rows"],
        "reused": reused,
        "timing": embedded["timing"],
        "startup": embedded["startup"],
        "rejected": rejected,
        "docs_read": read["docs_read"],
        **calibration,
        **selected,
        **sink_stats,
    } | "WriteOutputs" >> WriteOutputs(
        staging,
        run_id,
        cfg.output.num_shards,
        schema=rows_schema(plan.head),
        kept_columns=plan.kept.fields(),
        write_embeddings=cfg.output.granularity != "chunk",
        folder=plan.head.folder,
        labels=plan.head.counts_labels,
        row_stats=plan.head.row_stats,
    )
    if cfg.output.granularity != "document":
        # Chunk rows are quantized with the documents' calibration (one scale per output).
        chunks = {
            "windows": embedded["chunks"],
            "documents": to_encode,
            "embedded": quantized["rows"],
            **calibration,
        } | "WriteChunks" >> WriteChunks(
            staging,
            run_id,
            cfg.output.num_shards,
            head=plan.head,
            with_text=cfg.output.chunk_text,
            vector_dtype=cfg.output.vector_dtype,
            kept_columns=plan.kept.fields(),
        )
        written = {**written, "written": (*written["written"], chunks)}
    written = {
        **written,
        "written": written["written"] + sinks_out.written + selection.get("written", ()),
    }
    written | "CommitRun" >> CommitRun(
        fence, summary_base(plan, run_id, started), cfg.input.max_rejected_fraction, release_lock
    )


@dataclasses.dataclass
class Run:
    """One run as the driver goes through its phases; the failure handler reads ``phase``, never the timings."""

    run_id: str
    plan: JobPlan
    marks: dict  # epoch seconds at each phase's end, for summary.json's start-up breakdown
    phase: str = "planned"  # planned → locked → prepared → running → finished (or handed_over)


def run_job(
    cfg,
    extra_beam_args: list[str] = (),
    *,
    force: bool = False,
    wait: bool = True,
    process_started: float | None = None,
) -> dict:
    """Runs the job to completion; returns the committed summary (also in ``summary.json``).

    Phases: plan (every refusal, exit 2, before anything is touched), lock the output, prepare it (clean up
    after dead runs, mark this run's staging folder), submit the pipeline (whose last step commits), then wait
    and finish (metrics into summary.json, the sinks' loads). ``wait=False`` (a Flex Template launcher, which
    must not wait) returns once the job is submitted; the job's last step commits the output and releases the
    lock this driver took, so the lock is handed over rather than released here. ``process_started`` (epoch
    seconds; the command line passes the process's start) is where summary.json's start-up breakdown begins;
    by default, this call.
    """
    with environment_restored(tuple(cfg.runner.worker_env) if wait else ()):
        return _run_job(cfg, extra_beam_args, force, wait, process_started)


@contextlib.contextmanager
def environment_restored(keys: tuple[str, ...]):
    """``keys`` of os.environ as they were, after the job: runner.worker_env is set in each worker process, and
    on the DirectRunner's in-memory workers that is this one, so a scheduler's or a notebook's next job would
    inherit it."""
    before = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _run_job(cfg, extra_beam_args, force: bool, wait: bool, process_started: float | None) -> dict:
    run = plan_run(cfg, extra_beam_args, wait, process_started)
    out = run.plan.config.output.path
    with refused_at_start(f"output.path {out}: taking its lock {output_lib.LOCK}"):
        lock = OutputLock.acquire(out, run.run_id, force=force)
    run.phase, loading, spec = "locked", None, None
    try:
        prepare_output(run, lock)
        result, loading, spec = submit(run, lock, extra_beam_args, wait)
        if not wait:
            lock.hand_over()
            run.phase = "handed_over"
            return {"run_id": run.run_id, "output": out, "submitted": True}
        return finish(run, lock, result)
    except Exception as e:
        raise failure(run, lock, e)  # noqa: B904  failure() sets the cause of any new exception
    finally:
        if loading is not None:  # a failed job may never have asked for it: leave nothing compiling at exit
            loading.join()
            stop_compiling(spec)
        if run.phase != "handed_over":
            lock.release()


def plan_run(cfg, extra_beam_args, wait: bool, process_started: float | None) -> Run:
    """The plan: placeholders filled, the profile's placeholders refused, every check of make_plan and the
    precision gate, each sink's preflight. Nothing is touched yet."""
    from docbeam.pipeline.stages.compile_cache import keep_every_compilation

    marks = {"run_job": time.time()}
    marks["process"] = process_started or marks["run_job"]
    keep_every_compilation()
    run_id = output_lib.new_run_id()
    cfg = with_beam_args(placeholders.expand(cfg, run_id, output_lib.run_date()), extra_beam_args)
    # A scheduled `docbeam run` on a profile as shipped would write a placeholder bucket: refused before anything.
    placeholders.refuse(cfg, placeholders.beam_options_of(cfg, extra_beam_args))
    plan = precision_gate_at_start.checked(
        make_plan(cfg)
    )  # a reduced precision that fails its gate stops here (exit 2)
    for sink, section in sinks.active(cfg):  # e.g. a load after the commit needs a driver that waits
        sink.preflight(section, wait)
    marks["plan"] = time.time()
    return Run(run_id, plan, marks)


def prepare_output(run: Run, lock: OutputLock) -> None:
    """Under the lock: the output checked again (no other run can change it now), dead runs cleaned up, this
    run's staging folder marked with the lock's fence."""
    cfg, out = run.plan.config, run.plan.config.output.path
    check_output(cfg)
    # Refused before any clean-up where it can be: a refused run touches nothing (no dead run's staging pruned).
    # Not where the lock carries a commit past its point of no return: recover() must finish that one first, or
    # the release below would drop the record that it was committed.
    if lock.owner.pending is None:
        output_lib.check_runs_in_order(out, output_lib.read_manifest(out), run.run_id)
    with refused_at_start(f"output.path {out}: cleaning up after dead runs"):
        cleaned = transaction.recover(out, lock)
    # Read again: recover() may have finished a dead run's commit, and runs may have committed since planning.
    output_lib.check_runs_in_order(out, output_lib.read_manifest(out), run.run_id)
    lock.fence.prove()
    output_lib.mark_staging(out, run.run_id, lock.fence.token)
    run.marks["checks"] = time.time()
    run.phase = "prepared"
    log.info(
        "docbeam: run %s on %s with attention %s%s",
        run.run_id,
        cfg.runner.name,
        {c.case.seq_len: c.backend for c in run.plan.choices},
        f"; cleaned up dead run(s) {cleaned}" if cleaned else "",
    )


def submit(run: Run, lock: OutputLock, extra_beam_args, wait: bool):
    """The pipeline built and submitted; returns Beam's result, and the early encoder load (thread, spec)."""
    cfg, out = run.plan.config, run.plan.config.output.path
    options = storage.pipeline_options(cfg.runner.beam_args() + list(extra_beam_args))
    p = beam.Pipeline(runner=compat.runner_for(cfg.runner.name), options=options)
    spec = encoder_spec(run.plan, output_lib.staging_dir(out, run.run_id), run.run_id)
    loading = load_encoder_early(run.plan, spec, options) if wait else None
    # A driver that waits releases the lock itself, after it has added the metrics to summary.json.
    build(p, run.plan, lock.fence, run.marks["checks"], release_lock=not wait)
    run.marks["graph"] = run.marks["pipeline"] = time.time()
    run.phase = "running"  # from here a refusal (a worker's CheckpointError) is the job's failure
    return p.run(), loading, spec


def finish(run: Run, lock: OutputLock, result) -> dict:
    """Waits for the job, checks it committed this run, adds what only a waiting driver knows to summary.json,
    then runs each sink's step after the commit (a sink gets a committed run or nothing)."""
    out = run.plan.config.output.path
    result.wait_until_finish()
    run.marks["finished"] = time.time()
    manifest = output_lib.read_manifest(out)
    if manifest is None or manifest["run_id"] != run.run_id:
        raise RunFailed(
            f"the job finished but the output's manifest names run "
            f"{manifest and manifest['run_id']}, not this run {run.run_id}"
        )
    summary = json.loads(storage.read_bytes(storage.join(out, output_lib.SUMMARY)))
    # Only a driver that waited has these; summary.json is not among the files the manifest sizes.
    summary["metrics"] = metrics_dict(result)
    summary["startup"] = startup_breakdown(run.marks, timing_records(out, manifest), summary["metrics"])
    summary["stages"] = stage_shares(summary["metrics"], run.marks["finished"] - run.marks["pipeline"])
    transaction.rewrite_summary(out, lock.fence, summary)
    run.phase = "finished"
    for sink, section in sinks.active(run.plan.config):
        done = sink.after_commit(out, manifest, section)
        if done is not None:
            summary[sink.key] = done
            transaction.rewrite_summary(out, lock.fence, summary)
    return summary


def failure(run: Run, lock: OutputLock, error: Exception) -> BaseException:
    """What a run that failed after taking the lock raises: a sink behind a committed run as it is; the
    other run's takeover when one took the output; a refusal before submission as it is (exit 2: nothing was
    run); anything else leaves a failed summary.json, a refusal from the workers becoming JobFailed (exit 1)."""
    if isinstance(error, SinkBehind):
        return error  # the run is committed; only the sink is behind, and the error says how to catch it up
    lost = lock.fence.taken_over(error)  # a failure caused by another run taking the output over
    if lost is not None:
        lost.__cause__ = error
        return lost  # the output is the other run's now: this one writes nothing more there
    if isinstance(error, Refused) and run.phase in ("locked", "prepared"):
        return error  # refused at start: nothing was run
    started = run.marks.get("checks", run.marks["plan"])
    leave_failed_summary(run.plan.config.output.path, run.run_id, summary_base(run.plan, run.run_id, started), error)
    if isinstance(error, Refused):  # e.g. a worker's CheckpointError: the job ran, so it failed (exit 1)
        failed = JobFailed(f"{type(error).__name__}: {error}")
        failed.__cause__ = error
        return failed
    return error

"""Build and run the job: read → tokenize → bucket → encode → pool → write → commit.

The driver plans (pipeline/driver/plan.py: every check that must fail at start), takes the output's lock, cleans
up after dead runs, and runs the pipeline, whose last step commits the output (pipeline/stages/commit.py). A
run that fails commits nothing: the previous output stays as it was.
"""
from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import apache_beam as beam

from docbeam.pipeline import compat
from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage
from docbeam.pipeline.store import pgvector, transaction
from docbeam.pipeline.telemetry.breakdown import stage_shares, startup_breakdown
from docbeam.pipeline.stages.chunks import WriteChunks
from docbeam.pipeline.stages.commit import MEMORY_LIMIT, CommitRun, RunFailed
from docbeam.pipeline.driver import placeholders
from docbeam.pipeline.driver import embed, quality_gate
from docbeam.pipeline.driver.embed import EncodeDocuments
from docbeam.pipeline.stages.encode import EncoderSpec, runtime_for, stop_compiling
from docbeam.pipeline.errors import JobFailed, Refused, refused_at_start
from docbeam.pipeline.store.lock import Fence, OutputLock
from docbeam.pipeline.telemetry.observe import METRICS_NAMESPACE
from docbeam.pipeline.driver.plan import JobPlan, check_output, make_plan, versions
from docbeam.pipeline.stages.read import ReadDocuments
from docbeam.pipeline.stages import vectors
from docbeam.pipeline.stages.reuse import SplitByReuse
from docbeam.pipeline.driver import sinks
from docbeam.pipeline.driver.selected import select_documents
from docbeam.pipeline.stages.write import WriteOutputs, rows_schema

log = logging.getLogger(__name__)


def encoder_spec(plan: JobPlan, staging: str, run_id: str) -> EncoderSpec:
    return embed.encoder_spec(plan, plan.config.profile.batches, output_lib.profiles_dir(staging, run_id), run_id)


def in_process_worker(cfg, options) -> bool:
    """Whether this process will also encode: the DirectRunner's default in-memory mode runs the workers
    as threads of the driver (its multi_processing mode and every other runner start their own)."""
    from apache_beam.options.pipeline_options import DirectOptions

    return compat.is_direct_runner(cfg.runner.name) and options.view_as(DirectOptions).direct_running_mode in (
        None, "in_memory")


def load_encoder_early(plan: JobPlan, spec: EncoderSpec, options) -> threading.Thread | None:
    """Start loading the encoder (checkpoint, probes, then its compilations in the background) in a thread
    while Beam builds the graph, reads and tokenizes, when this process's workers will use it
    (``runtime_for`` hands them this one). Not for runs whose encoder may have nothing to do (reuse), nor
    ones that set the worker's environment or share the encoder between processes: those load it as the
    worker starts."""
    cfg = plan.config
    if (not in_process_worker(cfg, options) or plan.reuse.source is not None or cfg.runner.worker_env
            or cfg.runner.one_model_per_vm):
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
        "run_id": run_id, "started": started, "output": cfg.output.path,
        "attention_requested": cfg.attention.backend,
        "attention_plan": {str(c.case.seq_len): {"backend": c.backend, "kernel": c.kernel,
                                                 "fallback_reason": c.fallback_reason} for c in plan.choices},
        "model": plan.model_path, "window_len": plan.window_len, "pooling": plan.pooling, "normalize": plan.normalize,
        "embedding_dim": plan.width, "truncate_dim": plan.truncate_dim, "head": plan.head.describe(),
        **({"embedding": vectors.describe(plan.width, cfg.output.vector_dtype)} if plan.head.name == "embedding"
           else {}),
        "dtype": cfg.model.dtype, "platform": plan.platform, "runner": cfg.runner.name,
        "packing": plan.packing, "granularity": cfg.output.granularity,
        "chunking": cfg.output.chunking, **({"context_len": plan.context_len} if plan.context_len else {}),
        "config_digest": cfg.digest(),
        "versions": versions(),
        "reuse_key": plan.reuse_key,
        "reuse": plan.reuse.describe(),
        "kept_fields": plan.kept.describe(),
        **({"select": cfg.output.select.model_dump()} if cfg.output.select else {}),
        "precision_gate": plan.precision_gate,
        MEMORY_LIMIT: cfg.runner.max_memory_growth_mb_per_1k_batches,
    }


def build(p: beam.Pipeline, plan: JobPlan, fence: Fence, started: float, release_lock: bool = True) -> None:
    cfg = plan.config
    run_id = fence.run_id
    staging = output_lib.staging_dir(cfg.output.path, run_id)
    read = p | "ReadDocuments" >> ReadDocuments(cfg.input, plan.kept)
    if plan.reuse.source is not None:
        split = read["documents"] | "SplitByReuse" >> SplitByReuse(
            plan.reuse.source, plan.head, plan.prompt)
        to_encode, reused = split["to_encode"], split["reused"]
    else:
        to_encode, reused = read["documents"], p | "NothingReused" >> beam.Create([])
    embedded = to_encode | "Embed" >> EncodeDocuments(plan, encoder_spec(plan, staging, run_id))
    # An incremental run keeps the calibration its reused rows were quantized with (docs/outputs.md#vector-dtypes).
    # A multi-vector head writes its own dtype (models/heads/multivector.py): its rows have no embedding column.
    quantized = embedded["embeddings"] | "QuantizeVectors" >> vectors.QuantizeVectors(
        cfg.output.vector_dtype if plan.head.name == "embedding" else "float32", run_id,
        plan.reuse.source.calibration if plan.reuse.source else None)
    rejected = (read["rejected"], embedded["rejected"], quantized["rejected"]) | "AllRejected" >> beam.Flatten()
    calibration = {"calibration": quantized["calibration"]} if "calibration" in quantized else {}
    selection = select_documents(plan, staging, run_id, read, quantized["rows"], reused)
    selected = {"selected": selection["selected"]} if selection else {}
    written = ({"encoded": quantized["rows"], "reused": reused, "timing": embedded["timing"],
                "startup": embedded["startup"], "rejected": rejected, "docs_read": read["docs_read"], **calibration,
                **selected}
               | "WriteOutputs" >> WriteOutputs(staging, run_id, cfg.output.num_shards,
                                                schema=rows_schema(plan.head), kept_columns=plan.kept.fields(),
                                                write_embeddings=cfg.output.granularity != "chunk",
                                                folder=plan.head.folder,
                                                labels=bool(getattr(plan.head, "labels", None))
                                                and not plan.head.regression,
                                                row_stats=getattr(plan.head, "row_stats", None)))
    if cfg.output.granularity != "document":
        # Chunk rows are quantized with the documents' calibration (one scale per output).
        chunks = ({"windows": embedded["chunks"], "documents": to_encode, "embedded": quantized["rows"],
                   **calibration}
                  | "WriteChunks" >> WriteChunks(staging, run_id, cfg.output.num_shards, normalize=plan.normalize,
                                                 truncate_dim=plan.truncate_dim, with_text=cfg.output.chunk_text,
                                                 width=plan.width, vector_dtype=cfg.output.vector_dtype,
                                                 kept_columns=plan.kept.fields(),
                                                 sparse=plan.head if plan.head.name == "sparse" else None))
        written = {**written, "written": (*written["written"], chunks)}
    written = {**written, "written": written["written"] + sinks.sink_files(plan, staging, run_id, read, quantized["rows"],
                                                                     reused) + selection.get("written", ())}
    written | "CommitRun" >> CommitRun(fence, summary_base(plan, run_id, started), cfg.input.max_rejected_fraction,
                                       release_lock)


def metrics_dict(result) -> dict:
    from apache_beam.metrics.metric import MetricsFilter

    try:
        queried = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
    except Exception as e:  # some runners cannot report metrics; the summary still has the data-derived numbers
        log.warning("could not read Beam metrics: %s", e)
        return {}
    counters = {}
    for c in queried["counters"]:
        counters[c.key.metric.name] = counters.get(c.key.metric.name, 0) + (c.committed or 0)
    distributions = {}
    for d in queried["distributions"]:
        v = d.committed
        if v is None or not v.count:
            continue
        distributions[d.key.metric.name] = {"count": v.count, "sum": v.sum, "min": v.min, "max": v.max,
                                            "mean": v.sum / v.count}
    return {"counters": counters, "distributions": distributions}


def run_job(cfg, extra_beam_args: list[str] = (), *, force: bool = False, wait: bool = True,
            process_started: float | None = None) -> dict:
    """Runs the job to completion; returns the committed summary (also in ``summary.json``).

    ``wait=False`` (a Flex Template launcher, which must not wait) returns once the job is submitted; the
    job's last step commits the output and releases the lock this driver took, so the lock is handed over
    rather than released here. ``process_started`` (epoch seconds; the command line passes the process's
    start) is where summary.json's start-up breakdown begins; by default, this call.
    """
    from docbeam.pipeline.stages.compile_cache import keep_every_compilation

    marks = {"run_job": time.time()}
    marks["process"] = process_started or marks["run_job"]
    keep_every_compilation()
    run_id = output_lib.new_run_id()
    cfg = placeholders.expand(cfg, run_id, output_lib.run_date())
    # A scheduled `docbeam run` on a profile as shipped would write a placeholder bucket: refused before anything.
    placeholders.refuse(cfg, placeholders.beam_options_of(cfg, extra_beam_args))
    plan = quality_gate.checked(make_plan(cfg))  # a reduced precision that fails its gate stops here (exit 2)
    for sink, section in sinks.active(cfg):  # e.g. pgvector's load needs a driver that waits
        sink.preflight(section, wait)
    marks["plan"] = time.time()
    out = cfg.output.path
    with refused_at_start(f"output.path {out}: taking its lock {output_lib.LOCK}"):
        lock = OutputLock.acquire(out, run_id, force=force)
    handed_over = False
    loading = None
    try:
        check_output(cfg)  # again, now that no other run can change the output under us
        with refused_at_start(f"output.path {out}: cleaning up after dead runs"):
            cleaned = transaction.recover(out, lock)
        lock.fence.prove()
        output_lib.mark_staging(out, run_id, lock.fence.token)
        options = storage.pipeline_options(cfg.runner.beam_args() + list(extra_beam_args))
        started = marks["checks"] = time.time()
        log.info("docbeam: run %s on %s with attention %s%s", run_id, cfg.runner.name,
                 {c.case.seq_len: c.backend for c in plan.choices},
                 f"; cleaned up dead run(s) {cleaned}" if cleaned else "")
        p = beam.Pipeline(runner=compat.runner_for(cfg.runner.name), options=options)
        spec = encoder_spec(plan, output_lib.staging_dir(out, run_id), run_id)
        if wait:
            loading = load_encoder_early(plan, spec, options)
        # A driver that waits releases the lock itself, after it has added the metrics to summary.json.
        build(p, plan, lock.fence, started, release_lock=not wait)
        marks["graph"] = marks["pipeline"] = time.time()
        result = p.run()
        if not wait:
            lock.hand_over()
            handed_over = True
            return {"run_id": run_id, "output": out, "submitted": True}
        result.wait_until_finish()
        marks["finished"] = time.time()
        manifest = output_lib.read_manifest(out)
        if manifest is None or manifest["run_id"] != run_id:
            raise RunFailed(f"the job finished but the output's manifest names run "
                            f"{manifest and manifest['run_id']}, not this run {run_id}")
        summary_path = storage.join(out, output_lib.SUMMARY)
        summary = json.loads(storage.read_bytes(summary_path))
        # Only a driver that waited has these; summary.json is not among the files the manifest sizes.
        summary["metrics"] = metrics_dict(result)
        summary["startup"] = startup_breakdown(marks, timing_records(out, manifest), summary["metrics"])
        summary["stages"] = stage_shares(summary["metrics"], marks["finished"] - marks["pipeline"])
        transaction.rewrite_summary(out, lock.fence, summary)
        for sink, section in sinks.active(cfg):  # after the commit: e.g. Postgres gets a committed run or nothing
            if sink.after_commit is not None:
                summary[sink.key] = sink.after_commit(out, manifest, section)
                transaction.rewrite_summary(out, lock.fence, summary)
        return summary
    except Exception as e:
        if isinstance(e, pgvector.PostgresBehind):
            raise  # the run is committed; only Postgres is behind, and the error says how to catch it up
        lost = lock.fence.taken_over(e)  # a failure caused by another run taking the output over
        if lost is not None:
            raise lost from e  # the output is the other run's now: this one writes nothing more there
        if isinstance(e, Refused) and "pipeline" not in marks:
            raise  # refused at start: nothing was touched
        leave_failed_summary(out, run_id, summary_base(plan, run_id, marks.get("checks", marks["plan"])), e)
        if isinstance(e, Refused):  # e.g. a worker's CheckpointError: the job ran, so it failed (exit 1)
            raise JobFailed(f"{type(e).__name__}: {e}") from e
        raise
    finally:
        if loading is not None:  # a failed job may never have asked for it: leave nothing compiling at exit
            loading.join()
            stop_compiling(spec)
        if not handed_over:
            lock.release()


def leave_failed_summary(output: str, run_id: str, base: dict, error: BaseException) -> None:
    """summary.json in a failed run's staging folder, saying why it failed, so every run that started
    leaves one. Kept as it is when the job's own commit step wrote it (it has the run's counts)."""
    path = f"{output_lib.staging_dir(output, run_id)}/{output_lib.SUMMARY}"
    try:
        if storage.exists(path):
            return
        summary = {key: value for key, value in base.items() if key != "started"}
        summary.update(started_at=_iso(base["started"]), finished_at=_iso(time.time()),
                       failed=[f"{type(error).__name__}: {error}"])
        storage.write_bytes(path, json.dumps(summary, indent=2, sort_keys=True).encode())
    except Exception as e:  # noqa: BLE001  the job's own error is the one to report
        log.warning("could not leave the failed run's summary at %s: %s: %s", path, type(e).__name__, e)


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat()


def timing_records(output: str, manifest: dict) -> list[dict]:
    """The committed run's timing records, from the files its manifest lists."""
    records = []
    for f in manifest["files"]:
        if output_lib.in_folder(f["path"], output_lib.TIMING):
            text = storage.read_bytes(storage.join(output, f["path"])).decode("utf-8")
            records += [json.loads(line) for line in text.splitlines() if line.strip()]
    return records

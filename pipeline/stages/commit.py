"""CommitRun: the pipeline's last step. It waits for every sink, builds ``summary.json``, checks the run and
commits the staged output (pipeline/store/output.py), so a launcher that does not wait for the job (a Dataflow
template) still gets a committed output with its summary, or a failed job and yesterday's output.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import time

import apache_beam as beam

from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage, transaction
from docbeam.pipeline.store.lock import Fence
from docbeam.pipeline.telemetry import cost, memory_trend
from docbeam.pipeline.telemetry.observe import StageClock

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The job ran, but its result must not be committed (exit 1; the previous output stays)."""


MEMORY_LIMIT = "max_memory_growth_mb_per_1k_batches"  # runner's option, handed over in the driver's base


def summarize(base: dict, stats: dict, finished: float) -> dict:
    """summary.json from the run's summed statistics and what the driver planned (``base``)."""
    wall = max(finished - base["started"], 1e-9)
    real, padded = stats.get("real_tokens", 0), stats.get("padded_tokens", 0)
    embedded = stats.get("docs_embedded", 0)
    summary = {key: value for key, value in base.items() if key not in ("started", "price", MEMORY_LIMIT)}
    trends = [memory_trend.Trend(**t) for _, t in sorted(stats.get("memory_trends", {}).items())]
    doc_tokens = stats.get("doc_tokens", 0)
    summary.update(
        {
            "docs_read": stats.get("docs_read", 0),
            "docs_embedded": embedded,
            "docs_reused": stats.get("docs_reused", 0),
            "docs_encoded": stats.get("docs_encoded", 0),
            "reused_token_share": round(stats.get("tokens_reused", 0) / doc_tokens, 4) if doc_tokens else None,
            "docs_rejected": stats.get("docs_rejected", 0),
            "windows": stats.get("windows", 0),
            "real_tokens": real,
            "padded_tokens": padded,
            "padding_efficiency": round(real / padded, 4) if padded else None,
            "batches": stats.get("batches", 0),
            "compiles": stats.get("compiles", 0),
            "compiles_ahead": stats.get("compiles_ahead", 0),
            "compile_cache_hits_ahead": stats.get("compile_cache_hits_ahead", 0),
            "wall_seconds": round(wall, 3),
            "docs_per_second": round(embedded / wall, 2),
            "tokens_per_second": round(real / wall, 1),
            "attention_backends": stats.get("attention_backends", {}),
            "engines": stats.get("engines", {}),
            "fallbacks": stats.get("fallbacks", {}),
            "rejected_by_kind": stats.get("rejected_by_kind", {}),
            "buckets": stats.get("buckets", {}),
            # The chips the batches ran on, as the workers named them ("tpu:0 (TPU v5 lite) +7": a mesh's first
            # chip and how many more), with how many batches each.
            "devices": stats.get("devices", {}),
            "started_at": _iso(base["started"]),
            "finished_at": _iso(finished),
            "metrics": {},
            "memory": memory_trend.summary_block(trends, base.get(MEMORY_LIMIT)),
            "cost": cost.cost_section(
                (base.get("price") or {}).get("usd_per_hour"),
                (base.get("price") or {}).get("source", "no price"),
                wall,
                len(stats.get("vms", {})),
                real,
                embedded,
            ),
        }
    )
    if "attention_plan" in summary:
        summary["attention_plan"] = with_workers_measurements(
            summary["attention_plan"], stats.get("attention_measured", {})
        )
    for key, record in stats.get("sinks", {}).items():  # a curating sink's counts, over its planned zeros
        summary[key] = overlaid(summary.get(key, {}), record)
    if "select" in summary:  # output.select: how many documents selected/ lists
        summary["docs_selected"] = stats.get("docs_selected", 0)
    if "labels" in stats:  # a classifier's rows: how many documents got each top label
        summary["labels"] = dict(sorted(stats["labels"].items(), key=lambda kv: (-kv[1], kv[0])))
    if "representations" in stats:  # each representation the rows hold: its size per document written
        summary["representations"] = per_document(stats["representations"], embedded)
    if "calibration" in stats:  # int8/uint8: the ranges every vector of the output was quantized with
        summary["embedding"] = {**summary.get("embedding", {}), "calibration": stats["calibration"]}
    return summary


def overlaid(planned: dict, counted: dict) -> dict:
    """``planned`` with ``counted``'s values put over it at every depth: the planned keys keep their order and
    their zeros where nothing was counted."""
    out = dict(planned)
    for k, v in counted.items():
        out[k] = overlaid(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_workers_measurements(plan: dict, measured: dict) -> dict:
    """The attention plan with what ``auto`` measured on the workers (each worker's first batch of a bucket carries
    its measurement, counted once per worker): where the workers measured for themselves (the driver could not, or
    their chip is another kind than the driver's) the bucket takes the workers' choice and the first one's table;
    how many workers chose each candidate is kept, so workers that disagree (two kinds of chip) are seen."""
    out = {}
    for bucket, line in plan.items():
        counted = [(json.loads(text), n) for text, n in sorted((measured.get(bucket) or {}).items())]
        if not counted:
            out[bucket] = line
            continue
        chosen: dict[str, int] = {}
        for m, n in counted:
            chosen[m["chosen"]] = chosen.get(m["chosen"], 0) + n
        line = dict(line)
        driver = line.get("measurement")
        elsewhere = [m for m, _ in counted if driver is None or m.get("device") != driver.get("device")]
        if elsewhere:
            line.update(
                {"backend": " | ".join(sorted(chosen)), "measurement": elsewhere[0], "measured_on": "the workers"}
            )
        line["workers_chose"] = dict(sorted(chosen.items()))
        out[bucket] = line
    return out


def per_document(sums: dict, documents: int) -> dict:
    """``{"sparse_embedding": {"nonzeros": 900, "bytes": 7200}}`` summed over 3 rows → ``{"sparse_embedding":
    {"nonzeros_per_document": 300.0, "bytes_per_document": 2400.0}}`` (what models/heads/vector_types.py counts)."""
    return {
        name: {f"{k}_per_document": round(v / max(documents, 1), 2) for k, v in counts.items()}
        for name, counts in sorted(sums.items())
    }


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat()


def run_problems(summary: dict, max_rejected_fraction: float) -> list[str]:
    """Why this run must not be committed; [] when it may."""
    read, embedded, rejected = summary["docs_read"], summary["docs_embedded"], summary["docs_rejected"]
    problems = []
    if read != embedded + rejected:
        problems.append(f"documents do not add up: read {read} != embedded {embedded} + rejected {rejected}")
    reused, encoded = summary.get("docs_reused", 0), summary.get("docs_encoded", embedded)
    if embedded != reused + encoded:
        problems.append(f"embedded documents do not add up: {embedded} != reused {reused} + encoded {encoded}")
    if read and not embedded:
        problems.append(
            f"nothing was embedded from {read} documents read (rejected by kind: "
            f"{json.dumps(summary['rejected_by_kind'], sort_keys=True)})"
        )
    elif read and rejected / read > max_rejected_fraction:
        problems.append(
            f"{rejected} of {read} documents were rejected ({rejected / read:.1%}), more than "
            f"input.max_rejected_fraction={max_rejected_fraction} (by kind: "
            f"{json.dumps(summary['rejected_by_kind'], sort_keys=True)})"
        )
    memory = memory_trend.over_limit(summary.get("memory", {}))
    if memory:
        problems.append(memory)
    return problems


def manifest_fields(summary: dict) -> dict:
    counts = ("docs_read", "docs_embedded", "docs_reused", "docs_encoded", "docs_rejected", "windows", "batches")
    return {
        "counts": {k: summary[k] for k in counts},
        "summary": output_lib.SUMMARY,
        "reused_from": summary["reuse"],
        **{
            k: summary[k]
            for k in (
                "config_digest",
                "model",
                "window_len",
                "pooling",
                "normalize",
                "dtype",
                "versions",
                "reuse_key",
                "kept_fields",
            )
        },
        "granularity": summary.get("granularity", "document"),
        **{k: summary[k] for k in ("embedding", "head") if k in summary},
    }


_SHARD = re.compile(r"^(?P<prefix>.*-)(?P<index>\d{5})-of-(?P<count>\d{5})(?P<suffix>[^/]*)$")


def every_shard(written: list[str]) -> list[str]:
    """The sinks' files, every shard of each: a finalize step retried after renaming some shards reports
    only the ones it renamed itself, but each name (``…-00001-of-00003.parquet``) says all of its siblings'.
    A shard that is named but missing fails the commit rather than commit a partial output."""
    files = set(written)
    for path in written:
        match = _SHARD.match(path)
        if match is None:
            continue
        count = int(match["count"])
        files |= {f"{match['prefix']}{i:05d}-of-{count:05d}{match['suffix']}" for i in range(count)}
    missing = sorted(p for p in files - set(written) if not storage.exists(p))
    if missing:
        raise RuntimeError(f"the sinks finalised {len(written)} file(s) but not their sibling shard(s) {missing[:3]}")
    return sorted(files)


def profile_files(output: str, run_id: str) -> list[str]:
    """The profiler's traces (written by the encoder, not by a sink): the files under this run's own
    ``profiles/<run_id>/`` staging folder."""
    return sorted(storage.list_files(output_lib.profiles_dir(output_lib.staging_dir(output, run_id), run_id)))


class _Commit(beam.DoFn):
    def __init__(self, fence: Fence, base: dict, max_rejected_fraction: float, release: bool):
        self._fence, self._base = fence, base
        self._max_rejected, self._release = max_rejected_fraction, release

    def process(self, _, stats, written):
        t0 = time.perf_counter()
        summary = self._commit(stats, list(written))
        StageClock("commit").add(time.perf_counter() - t0)
        yield summary

    def _commit(self, stats: dict, written: list[str]) -> dict:
        fence = self._fence
        output, run_id = fence.output, fence.run_id
        summary = summarize(self._base, stats, time.time())
        problems = run_problems(summary, self._max_rejected)
        staging = output_lib.staging_dir(output, run_id)
        if problems:
            summary["failed"] = problems
            fence.prove()
            storage.write_bytes(f"{staging}/{output_lib.SUMMARY}", json.dumps(summary, indent=2).encode())
            raise RunFailed(
                f"run {run_id} not committed: {'; '.join(problems)}. Its errors and summary are "
                f"in {staging}; the previous output is unchanged"
            )
        # The commit's file list is what the sinks wrote, never a listing of the staging folder.
        with fence.failing_as_lost():
            transaction.commit(
                output, fence, every_shard(written) + profile_files(output, run_id), summary, manifest_fields(summary)
            )
        if self._release:
            fence.release()
        log.info("committed run %s to %s", run_id, output)
        return summary


class CommitRun(beam.PTransform):
    """Input: ``{"stats": one dict, "written": PCollections of written file names}``; output: the summary.
    ``release``: the job releases the lock after its commit (a driver that does not wait for it)."""

    def __init__(self, fence: Fence, base: dict, max_rejected_fraction: float, release: bool = True):
        super().__init__()
        self._args = (fence, base, max_rejected_fraction, release)

    def expand(self, inputs):
        written = tuple(inputs["written"]) | "AllWritten" >> beam.Flatten()
        return (
            inputs["stats"].pipeline
            | "Once" >> beam.Create([None])
            | "Commit"
            >> beam.ParDo(
                _Commit(*self._args),
                stats=beam.pvalue.AsSingleton(inputs["stats"]),
                written=beam.pvalue.AsList(written),
            )
        )

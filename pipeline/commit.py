"""CommitRun: the pipeline's last step. It waits for every sink, builds ``summary.json``, checks the run and
commits the staged output (pipeline/output.py), so a launcher that does not wait for the job (a Dataflow
template) still gets a committed output with its summary, or a failed job and yesterday's output.
"""
from __future__ import annotations

import datetime
import json
import logging
import time

import apache_beam as beam

from pipeline import lock as lock_lib
from pipeline import memory_trend
from pipeline import output as output_lib
from pipeline import storage
from pipeline.observe import StageClock

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The job ran, but its result must not be committed (exit 1; the previous output stays)."""


MEMORY_LIMIT = "max_memory_growth_mb_per_1k_batches"  # runner's option, handed over in the driver's base


def summarize(base: dict, stats: dict, finished: float) -> dict:
    """summary.json from the run's summed statistics and what the driver planned (``base``)."""
    wall = max(finished - base["started"], 1e-9)
    real, padded = stats.get("real_tokens", 0), stats.get("padded_tokens", 0)
    embedded = stats.get("docs_embedded", 0)
    summary = {key: value for key, value in base.items() if key not in ("started", MEMORY_LIMIT)}
    trends = [memory_trend.Trend(**t) for _, t in sorted(stats.get("memory_trends", {}).items())]
    doc_tokens = stats.get("doc_tokens", 0)
    summary.update({
        "docs_read": stats.get("docs_read", 0), "docs_embedded": embedded,
        "docs_reused": stats.get("docs_reused", 0), "docs_encoded": stats.get("docs_encoded", 0),
        "reused_token_share": round(stats.get("tokens_reused", 0) / doc_tokens, 4) if doc_tokens else None,
        "docs_rejected": stats.get("docs_rejected", 0), "windows": stats.get("windows", 0),
        "real_tokens": real, "padded_tokens": padded,
        "padding_efficiency": round(real / padded, 4) if padded else None,
        "batches": stats.get("batches", 0), "compiles": stats.get("compiles", 0),
        "compiles_ahead": stats.get("compiles_ahead", 0),
        "compile_cache_hits_ahead": stats.get("compile_cache_hits_ahead", 0),
        "wall_seconds": round(wall, 3), "docs_per_second": round(embedded / wall, 2),
        "tokens_per_second": round(real / wall, 1),
        "attention_backends": stats.get("attention_backends", {}), "fallbacks": stats.get("fallbacks", {}),
        "rejected_by_kind": stats.get("rejected_by_kind", {}), "buckets": stats.get("buckets", {}),
        "started_at": _iso(base["started"]), "finished_at": _iso(finished), "metrics": {},
        "memory": memory_trend.summary_block(trends, base.get(MEMORY_LIMIT)),
    })
    return summary


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
        problems.append(f"nothing was embedded from {read} documents read (rejected by kind: "
                        f"{json.dumps(summary['rejected_by_kind'], sort_keys=True)})")
    elif read and rejected / read > max_rejected_fraction:
        problems.append(f"{rejected} of {read} documents were rejected ({rejected / read:.1%}), more than "
                        f"input.max_rejected_fraction={max_rejected_fraction} (by kind: "
                        f"{json.dumps(summary['rejected_by_kind'], sort_keys=True)})")
    memory = memory_trend.over_limit(summary.get("memory", {}))
    if memory:
        problems.append(memory)
    return problems


def manifest_fields(summary: dict) -> dict:
    counts = ("docs_read", "docs_embedded", "docs_reused", "docs_encoded", "docs_rejected", "windows", "batches")
    return {"counts": {k: summary[k] for k in counts}, "summary": output_lib.SUMMARY, "reused_from": summary["reuse"],
            **{k: summary[k] for k in ("config_digest", "model", "window_len", "pooling", "normalize", "dtype",
                                       "versions", "reuse_key")}}


class _Commit(beam.DoFn):
    def __init__(self, output: str, run_id: str, base: dict, max_rejected_fraction: float):
        self._output, self._run_id, self._base = output, run_id, base
        self._max_rejected = max_rejected_fraction

    def process(self, _, stats, written):
        del written  # a side input only so this step waits for every sink to finalise
        t0 = time.perf_counter()
        summary = self._commit(stats)
        StageClock("commit").add(time.perf_counter() - t0)
        yield summary

    def _commit(self, stats: dict) -> dict:
        summary = summarize(self._base, stats, time.time())
        problems = run_problems(summary, self._max_rejected)
        staging = output_lib.staging_dir(self._output, self._run_id)
        if problems:
            summary["failed"] = problems
            storage.write_bytes(f"{staging}/{output_lib.SUMMARY}", json.dumps(summary, indent=2).encode())
            raise RunFailed(f"run {self._run_id} not committed: {'; '.join(problems)}. Its errors and summary are "
                            f"in {staging}; the previous output is unchanged")
        lock_path = storage.join(self._output, lock_lib.LOCK_NAME)
        lock_lib.check_owner(lock_path, self._run_id)
        output_lib.commit(self._output, self._run_id, summary, manifest_fields(summary))
        lock_lib.release_if_owner(lock_path, self._run_id)
        log.info("committed run %s to %s", self._run_id, self._output)
        return summary


class CommitRun(beam.PTransform):
    """Input: ``{"stats": one dict, "written": PCollections of written file names}``; output: the summary."""

    def __init__(self, output: str, run_id: str, base: dict, max_rejected_fraction: float):
        super().__init__()
        self._args = (output, run_id, base, max_rejected_fraction)

    def expand(self, inputs):
        written = tuple(inputs["written"]) | "AllWritten" >> beam.Flatten()
        return (inputs["stats"].pipeline
                | "Once" >> beam.Create([None])
                | "Commit" >> beam.ParDo(_Commit(*self._args), stats=beam.pvalue.AsSingleton(inputs["stats"]),
                                         written=beam.pvalue.AsList(written)))

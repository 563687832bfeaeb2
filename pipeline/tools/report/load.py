"""A run's outputs loaded into plain structures for ``docbeam report``: summary.json, the timing records as
aligned numpy columns, the error records.

A committed run lists its files in ``_manifest.json``; only those are read, since the output folder may also
hold ``_staging/`` and shards of other runs. Older runs without a manifest are read by glob. Apart from
pipeline/tools/report/data.py (the figures) so that a change to the folder layout touches only this file.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

import numpy as np
from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems

from docbeam.errors import Refused
from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store.output import ERRORS, MANIFEST, STAGING, SUMMARY, TIMING, in_folder
from docbeam.pipeline.telemetry import memory_trend

_NUMERIC = (
    "bucket_len",
    "rows",
    "real_rows",
    "real_tokens",
    "padded_tokens",
    "compute_ms",
    "total_ms",
    "memory_in_use_bytes",
    "memory_peak_bytes",
)
_TEXT = (
    "batch_id",
    "attention_backend",
    "attention_requested",
    "fallback_reason",
    "engine",
    "engine_reason",
    "device",
    "worker",
    "memory_source",
)


@dataclasses.dataclass(frozen=True)
class Run:
    """A run's outputs as plain structures. ``batches`` holds aligned numpy columns (one entry per timing
    record, sorted by start time; numbers are float with NaN where a record lacks the key) plus ``t_s``,
    seconds since the first batch started."""

    path: str
    summary: dict[str, Any]
    batches: dict[str, np.ndarray]
    errors: list[dict[str, Any]]

    @property
    def batch_count(self) -> int:
        return len(self.batches["compiled"])


class RunUnreadable(Refused, ValueError):
    """A run ``docbeam report`` cannot read (missing, not a docbeam output, a damaged file): exit 2, as for
    any Refused, and nothing is written. A ValueError too, as the readers' own errors were."""


def load_run(output: str) -> Run:
    """The run in the folder ``output``; the readers' errors become a RunUnreadable naming the file, here at
    the one place that reads, so the CLI decides its exit status by that base class alone."""
    try:
        return _load_run(output)
    except (
        OSError,
        ValueError,
        RecursionError,
        output_lib.OutputRefused,
    ) as e:  # a missing file, Beam's BeamIOError, bad JSON
        raise RunUnreadable(f"cannot read the run: {e}") from e


def _load_run(output: str) -> Run:
    summary = _read_json(FileSystems.join(output, SUMMARY))
    if summary is not None and not isinstance(summary, dict):
        raise ValueError(f"{FileSystems.join(output, SUMMARY)} is not a JSON object (got {type(summary).__name__})")
    timing = _read_jsonl(run_files(output, TIMING))
    if summary is None and not timing:
        staged = _match(FileSystems.join(output, STAGING, "*", SUMMARY))
        hint = (
            f"; it holds uncommitted runs, e.g. {staged[-1].rsplit('/', 1)[0]} (pass that folder to see one)"
            if staged
            else "; pass the output path of a docbeam run"
        )
        raise FileNotFoundError(f"{output} has neither summary.json nor timing/*.jsonl shards{hint}")
    errors = _read_jsonl(run_files(output, ERRORS))
    return Run(path=output, summary=summary or {}, batches=batch_columns(timing), errors=errors)


def run_files(output: str, part: str) -> list[str]:
    """Paths of the run's ``part`` shards (``timing`` or ``errors``): those the manifest lists when the
    output has one, else whatever ``part/*.jsonl*`` matches."""
    manifest_path = FileSystems.join(output, MANIFEST)
    # The one checked path every reader of a committed run takes (pipeline/store/output.py): the manifest's
    # fields typed, and the files it lists held to their sizes and checksums before a line of them is read.
    manifest = output_lib.read_manifest(output)
    if manifest is None:
        return _match(FileSystems.join(output, part, "*.jsonl*"))
    why = output_lib.damaged(output, manifest, part, require_checksums=False)
    if why:
        raise ValueError(f"{manifest_path}: {why}")
    return sorted(
        FileSystems.join(output, *f["path"].split("/")) for f in manifest["files"] if in_folder(f["path"], part)
    )


def _match(pattern: str) -> list[str]:
    try:
        return sorted(m.path for m in FileSystems.match([pattern])[0].metadata_list)
    except BeamIOError:  # some filesystems raise rather than match nothing, e.g. for a missing directory
        return []


def _read_json(path: str) -> dict | None:
    if not FileSystems.exists(path):
        return None
    with FileSystems.open(path) as f:
        try:
            return json.loads(f.read().decode("utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None


def _read_jsonl(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        with FileSystems.open(path) as f:
            for number, line in enumerate(f.read().decode("utf-8").splitlines(), 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path} line {number} is not JSON ({e})") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"{path} line {number} is a JSON {type(record).__name__}, not a record")
                    records.append(record)
    return records


def batch_columns(records: list[dict]) -> dict[str, np.ndarray]:
    start_s = np.array([_epoch_seconds(r.get("started_at")) for r in records], dtype=float)
    columns = {name: np.array([_number(r.get(name)) for r in records], dtype=float) for name in _NUMERIC}
    columns |= {name: np.array([_text(r.get(name)) for r in records], dtype=object) for name in _TEXT}
    columns["compiled"] = np.array([r.get("compiled") is True for r in records], dtype=bool)
    # Each record's (device, in use, peak): one per chip on a mesh, as the job's leak alarm reads it.
    columns["chip_memory"] = np.empty(len(records), dtype=object)
    columns["chip_memory"][:] = [
        [(_text(device), _number(used), _number(peak)) for device, used, peak in memory_trend.chip_readings(r)]
        for r in records
    ]
    # Runs from before the field: no batch is known to have run beside the start-up compilations.
    columns["compiling_ahead"] = np.array([_number(r.get("compiling_ahead")) > 0 for r in records], dtype=bool)
    columns["t_s"] = start_s - np.nanmin(start_s) if np.isfinite(start_s).any() else start_s
    order = np.argsort(start_s, kind="stable")
    return {name: column[order] for name, column in columns.items()}


def _epoch_seconds(value) -> float:
    try:
        moment = datetime.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return np.nan
    return (moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)).timestamp()


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else np.nan


def _text(value) -> str:
    return "" if value is None else str(value)

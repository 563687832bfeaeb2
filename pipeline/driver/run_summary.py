"""What the driver adds to a run's summary.json around the job: Beam's metrics and the start-up breakdown of a
run that finished, or the reason of one that failed."""

from __future__ import annotations

import datetime
import json
import logging
import time

from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage
from docbeam.pipeline.telemetry.observe import METRICS_NAMESPACE

log = logging.getLogger(__name__)


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
        distributions[d.key.metric.name] = {
            "count": v.count,
            "sum": v.sum,
            "min": v.min,
            "max": v.max,
            "mean": v.sum / v.count,
        }
    return {"counters": counters, "distributions": distributions}


def leave_failed_summary(output: str, run_id: str, base: dict, error: BaseException) -> None:
    """summary.json in a failed run's staging folder, saying why it failed, so every run that started
    leaves one. Kept as it is when the job's own commit step wrote it (it has the run's counts)."""
    path = f"{output_lib.staging_dir(output, run_id)}/{output_lib.SUMMARY}"
    try:
        if storage.exists(path):
            return
        summary = {key: value for key, value in base.items() if key not in ("started", "price")}
        summary.update(
            started_at=_iso(base["started"]), finished_at=_iso(time.time()), failed=[f"{type(error).__name__}: {error}"]
        )
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

"""PoolDocuments (window embeddings → one per document) and WriteOutputs (Parquet, JSONL, run stats).

Everything is written through Beam sinks (temporary files finalised once), so a retried bundle leaves
no duplicates.
"""

from __future__ import annotations

import dataclasses
import json
import time

import apache_beam as beam
import pyarrow as pa
from apache_beam.metrics import Metrics

from docbeam.models.heads import NonFinite
from docbeam.pipeline.records import REJECTED_TAG, Rejected, WindowEmbedding
from docbeam.pipeline.stages.keep import with_kept
from docbeam.pipeline.store.output import EMBEDDINGS, ERRORS, TIMING, part_prefix
from docbeam.pipeline.telemetry import memory_trend
from docbeam.pipeline.telemetry.observe import DOCS_REJECTED, METRICS_NAMESPACE, StageClock, fallback_key, metric_name


def rows_schema(head) -> pa.Schema:
    """The schema of a head's row files (embeddings/, scores/): the id, the head's own columns (models/heads/),
    then what every row says of the document's tokens, windows and content."""
    return pa.schema(head.row_fields())


def document_row(head, windows: list[WindowEmbedding]) -> dict | Rejected:
    """The head's row for one document (models/heads/), or its ``non_finite`` rejection: a row with NaN or inf
    values is never written."""
    return _written(head.document_row(windows), windows)


def _written(row: dict | NonFinite, windows: list[WindowEmbedding]) -> dict | Rejected:
    if isinstance(row, NonFinite):
        return Rejected(source="", line=None, id=windows[0].doc_id, kind="non_finite", reason=str(row))
    return row


class PoolDocuments(beam.PTransform):
    """Input ``{"windows": WindowEmbeddings, "hashes": (id, content hash)}`` and, with input.keep_fields,
    ``"kept": (id, Document.kept)``; outputs ``embeddings`` (the head's rows: vectors, or scores) and
    ``rejected`` (documents whose row is not finite)."""

    def __init__(self, head):
        super().__init__()
        self._head = head

    def expand(self, windows):
        embedded = Metrics.counter(METRICS_NAMESPACE, "docs_encoded")
        clock = StageClock("pool")

        def pool(item):
            _, grouped = item
            t0 = time.perf_counter()
            windows = list(grouped["windows"])  # none for a document rejected before encoding (no tokens)
            row = document_row(self._head, windows) if windows else None
            clock.add(time.perf_counter() - t0)
            if isinstance(row, Rejected):
                yield beam.pvalue.TaggedOutput(REJECTED_TAG, row)
            elif row is not None:
                embedded.inc()
                (row["content_hash"],) = grouped["hash"]
                yield with_kept(row, next(iter(grouped.get("kept", ())), ()))

        keyed = windows["windows"] | "KeyByDocument" >> beam.Map(lambda w: (w.doc_id, w))
        kept = {"kept": windows["kept"]} if "kept" in windows else {}
        pooled = (
            {"windows": keyed, "hash": windows["hashes"], **kept}
            | "GroupWindows" >> beam.CoGroupByKey()
            # The rows' type declared: Beam 2.78 infers Union[TaggedOutput, dict] for the main output from
            # pool's two yields, and a consumer typed ``dict`` (QuantizeVectors) then fails the pipeline's check.
            | "Pool" >> beam.FlatMap(pool).with_output_types(dict).with_outputs(REJECTED_TAG, main="embeddings")
        )
        return {"embeddings": pooled.embeddings, "rejected": pooled[REJECTED_TAG]}


class _SumDicts(beam.CombineFn):
    """Adds nested dicts of numbers: the run's statistics from every output."""

    def create_accumulator(self):
        return {}

    def add_input(self, acc, item):
        return _merge(acc, item)

    def merge_accumulators(self, accs):
        out = {}
        for a in accs:
            out = _merge(out, a)
        return out

    def extract_output(self, acc):
        return acc


def _merge(a: dict, b: dict) -> dict:
    """Numbers add up; a value under a key only one side has (a worker's memory trend) is kept as it is."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict):
            out[k] = _merge(out.get(k, {}), v)
        else:
            out[k] = out[k] + v if k in out else v
    return out


def timing_stats(t: dict) -> dict:
    stats = {
        "batches": 1,
        "windows": t["real_rows"],
        "real_tokens": t["real_tokens"],
        "padded_tokens": t["padded_tokens"],
        "compiles": int(t["compiled"]),
        "attention_backends": {t["attention_backend"]: 1},
        "engines": {t.get("engine", "xla"): 1},
        "devices": {t.get("device", "?"): 1},
        # the VMs that ran batches (a worker is host:pid): the cost's worker count (pipeline/telemetry/cost.py)
        "vms": {str(t.get("worker", "?")).rsplit(":", 1)[0]: 1},
        "buckets": {
            str(t["bucket_len"]): {
                "batches": 1,
                "real_tokens": t["real_tokens"],
                "padded_tokens": t["padded_tokens"],
                # which engine ran the bucket's batches, and why (models/engines/): a reason per shape's verdict
                "engines": {f"{t.get('engine', 'xla')}: {t.get('engine_reason', '')}": 1},
            }
        },
    }
    if t.get("attention_measured"):  # auto's measurement, once per worker and bucket (models/runtime.py)
        stats["attention_measured"] = {str(t["bucket_len"]): {t["attention_measured"]: 1}}
    if t["fallback_reason"]:
        key = fallback_key(t["attention_requested"], t["attention_backend"], t["fallback_reason"])
        stats["fallbacks"] = {key: 1}
    return stats


def memory_samples(t: dict) -> list[tuple[str, tuple[str, float, float, int]]]:
    """The batch's memory sample for its worker's trend; on a mesh one per chip, so the leak alarm watches each
    chip."""
    return [
        (
            memory_trend.worker_key({**t, "device": device or "?"}),
            (t.get("started_at", ""), used, peak, t.get("compiling_ahead", 0)),
        )
        for device, used, peak in memory_trend.chip_readings(t)
    ]


def memory_trend_stats(worker: str, samples) -> dict:
    """One worker's trend (pipeline/telemetry/memory_trend.py) under ``memory_trends``: one entry per worker, so the
    sum of the run's statistics keeps each as it is."""
    return {"memory_trends": {worker: dataclasses.asdict(memory_trend.trend_from_samples(worker, samples))}}


def startup_stats(startup: dict) -> dict:
    """An encoder's compilations ahead of its first batch count among the run's compilations."""
    return {
        "compiles": len(startup["compiles"]),
        "compiles_ahead": len(startup["compiles"]),
        "compile_cache_hits_ahead": sum(c["cache_hits"] for c in startup["compiles"]),
    }


class WriteOutputs(beam.PTransform):
    """Writes embeddings/ (the ``encoded`` rows and the ``reused`` ones; unless ``write_embeddings`` is off:
    ``output.granularity: chunk``, whose rows are still counted), timing/ and errors/ into the run's
    staging folder, every file name carrying the run id (``startup``, optional: Encode's start-up records,
    for the compilation count). Outputs ``stats`` (the numbers summary.json is built from) and ``written`` (each sink's file
    names: waiting on them is waiting for every file to be final). ``schema``: rows_schema(head);
    ``calibration`` (optional input): the int8/uint8 ranges, which summary.json and the manifest record."""

    def __init__(
        self,
        staging_path: str,
        run_id: str,
        num_shards: int = 0,
        *,
        schema: pa.Schema,
        kept_columns: tuple[pa.Field, ...] = (),
        write_embeddings: bool = True,
        folder: str = EMBEDDINGS,
        labels: bool = False,
        row_stats=None,
    ):
        super().__init__()
        self._schema = pa.schema([*schema, *kept_columns])  # kept columns: pipeline/stages/keep.py
        self._out = staging_path.rstrip("/")
        self._run_id = run_id
        self._shards = num_shards
        self._write_embeddings = write_embeddings
        self._folder, self._labels = folder, labels  # the head's folder; whether its rows carry a label
        self._row_stats = row_stats  # the head's numbers of a row for summary.json (a multi-vector head's size)

    def expand(self, outputs):
        from apache_beam.io.parquetio import WriteToParquet

        encoded, reused, timing, rejected, docs_read = (
            outputs["encoded"],
            outputs["reused"],
            outputs["timing"],
            outputs["rejected"],
            outputs["docs_read"],
        )
        embeddings = (encoded, reused) | "AllEmbeddings" >> beam.Flatten()
        rejected_counter = {}
        embedded_counter = Metrics.counter(METRICS_NAMESPACE, "docs_embedded")

        def embedded_stats(row):
            embedded_counter.inc()
            labels = {"labels": {str(row["label"]): 1}} if self._labels else {}  # "None": regression
            return {
                "docs_embedded": 1,
                "doc_tokens": row["num_tokens"],
                **labels,
                **(self._row_stats(row) if self._row_stats else {}),
            }

        def rejected_json(r):
            name = metric_name(DOCS_REJECTED, r.kind)
            rejected_counter.setdefault(r.kind, Metrics.counter(METRICS_NAMESPACE, name)).inc()
            return json.dumps(r.to_json(), ensure_ascii=False)

        written = (
            *(
                [
                    embeddings
                    | "WriteEmbeddings"
                    >> WriteToParquet(
                        part_prefix(self._out, self._folder, self._run_id),
                        self._schema,
                        file_name_suffix=".parquet",
                        num_shards=self._shards,
                        use_compliant_nested_type=True,
                    )
                ]  # LIST of "element": what BigQuery expects
                if self._write_embeddings
                else []
            ),
            timing
            | "TimingJson" >> beam.Map(json.dumps)
            | "WriteTiming"
            >> beam.io.WriteToText(
                part_prefix(self._out, TIMING, self._run_id), file_name_suffix=".jsonl", num_shards=self._shards
            ),
            rejected
            | "ErrorsJson" >> beam.Map(rejected_json)
            | "WriteErrors"
            >> beam.io.WriteToText(
                part_prefix(self._out, ERRORS, self._run_id), file_name_suffix=".jsonl", num_shards=self._shards
            ),
        )
        stats = (
            (
                docs_read | "ReadStats" >> beam.Map(lambda n: {"docs_read": n}),
                embeddings | "EmbeddedStats" >> beam.Map(embedded_stats),
                encoded | "EncodedStats" >> beam.Map(lambda e: {"docs_encoded": 1}),
                reused | "ReusedStats" >> beam.Map(lambda e: {"docs_reused": 1, "tokens_reused": e["num_tokens"]}),
                rejected | "RejectedStats" >> beam.Map(lambda r: {"docs_rejected": 1, "rejected_by_kind": {r.kind: 1}}),
                timing | "TimingStats" >> beam.Map(timing_stats),
                timing
                | "MemorySamples" >> beam.FlatMap(memory_samples)
                | "ByWorker" >> beam.GroupByKey()
                | "MemoryTrend" >> beam.MapTuple(memory_trend_stats),
                *([outputs["startup"] | "StartupStats" >> beam.Map(startup_stats)] if "startup" in outputs else []),
                *(
                    [outputs["calibration"] | "CalibrationStats" >> beam.Map(lambda c: {"calibration": c} if c else {})]
                    if "calibration" in outputs
                    else []
                ),
                *(
                    [outputs["selected"] | "SelectedStats" >> beam.Map(lambda _: {"docs_selected": 1})]
                    if "selected" in outputs
                    else []
                ),
                *([outputs["sink_stats"]] if "sink_stats" in outputs else []),  # a curating sink's counts
            )
            | "AllStats" >> beam.Flatten()
            | "SumStats" >> beam.CombineGlobally(_SumDicts())
        )
        return {"stats": stats, "written": written}

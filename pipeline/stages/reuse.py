"""Incremental runs: carry a previous run's vectors over for documents whose text did not change.

A previous output is a source only when its manifest is complete, every embeddings file has the size and
checksum the manifest lists (sha256 locally, the object's CRC32C on gs://), and its reuse key (KEY_FIELDS:
the one list of what must match) equals this run's; the attention backend is not part of the key, since
every backend is held to native's result. Then each document is joined by id with the previous rows (a Beam CoGroupByKey, so it scales with the corpus): the same content
hash carries the previous vector over byte for byte, anything else is encoded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from docbeam.config import ConfigError
from docbeam.pipeline.records import Document
from docbeam.pipeline.stages.keep import with_kept
from docbeam.pipeline.store import output as output_lib
from docbeam.pipeline.store import storage
from docbeam.pipeline.telemetry.observe import METRICS_NAMESPACE

# ``head`` is the head's own part (models/heads/: Head.reuse_key); "task" the task adapter merged in (vectors of
# another task are other vectors). What an older run's key left out (it had no prompt, no Hub id, wrote float32,
# ...) is filled in where its manifest is read: pipeline/store/output.py, upgrade_manifest.
KEY_FIELDS = (
    "weights_digest",
    "tokenizer_digest",
    "window_len",
    "stride",
    "long_documents",
    "pooling",
    "normalize",
    "dtype",
    "prompt",
    "model_revision",
    "truncate_dim",
    "dense_digest",
    "vector_dtype",
    "head",
    "task",
)
log = logging.getLogger(__name__)


def content_hash(text: str, prompt: str | None = None) -> str:
    """Of exactly what the tokenizer is given (the text decoded, BOM removed, and the prompt put before it): a
    changed byte is a changed document. Without a prompt, the hash of the text alone, as before prompts."""
    data = text if prompt is None else f"{prompt}\0{text}"
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class ReuseSource:
    """A previous committed run whose vectors this run may carry over."""

    path: str
    run_id: str
    files: tuple[str, ...]  # its files of the head's rows (embeddings/, scores/), as its manifest lists them
    # int8/uint8: the ranges its rows were quantized with, which this run keeps so that one output has one scale
    calibration: dict | None = None


@dataclasses.dataclass(frozen=True)
class ReuseDecision:
    source: ReuseSource | None
    reason: str  # why nothing is reused ("" when something may be)

    def describe(self) -> dict:
        return {
            "from": self.source.path if self.source else None,
            "run_id": self.source.run_id if self.source else None,
            "reason": self.reason,
        }


def check_key(key: dict) -> dict:
    """``key`` when it holds exactly KEY_FIELDS; raises naming the odd fields otherwise, since a field the
    plan adds but KEY_FIELDS lacks would never be compared, and a change to it would reuse stale vectors."""
    extra, missing = sorted(set(key) - set(KEY_FIELDS)), sorted(set(KEY_FIELDS) - set(key))
    if extra or missing:
        raise ValueError(
            f"reuse key fields {extra} are not in pipeline/stages/reuse.py KEY_FIELDS and {missing} "
            "are missing from the key: add each field to KEY_FIELDS and to the plan's key together"
        )
    return key


def key_differences(previous: dict, current: dict) -> list[str]:
    """Each field of KEY_FIELDS whose value differs, with both values. ``previous`` is a key as read_manifest
    gives it (an older run's gaps filled in); a field it still lacks counts as None."""
    return [
        f"{name}: {previous.get(name)!r} then, {current.get(name)!r} now"
        for name in KEY_FIELDS
        if previous.get(name) != current.get(name)
    ]


def decide(
    reuse_from: str | None,
    key: dict,
    on_mismatch: str,
    granularity: str = "document",
    folder: str = output_lib.EMBEDDINGS,
) -> ReuseDecision:
    """Whether ``reuse_from`` can be reused, checked on the driver before the job starts. With
    ``on_mismatch: fail`` anything but a usable source stops the run at start (exit 2). Only document rows
    are carried over, so a run that writes chunk rows (``granularity``) reuses nothing: a reused document
    would have no chunks. ``folder``: where the head's rows are (embeddings/, scores/)."""
    check_key(key)
    if not reuse_from:
        return ReuseDecision(None, "")
    if granularity != "document":
        manifest, reason = (
            None,
            (
                f"output.granularity={granularity} writes chunk rows, and an incremental run "
                "carries over only document vectors (set output.granularity: document to reuse)"
            ),
        )
    else:
        manifest, reason = _read_reusable(reuse_from, key, folder)
    if reason is None:
        files = tuple(
            storage.join(reuse_from, f["path"]) for f in manifest["files"] if output_lib.in_folder(f["path"], folder)
        )
        log.info("reusing vectors of run %s from %s", manifest["run_id"], reuse_from)
        calibration = (manifest.get("embedding") or {}).get("calibration")
        return ReuseDecision(ReuseSource(reuse_from, manifest["run_id"], files, calibration), "")
    if on_mismatch == "fail":
        raise ConfigError(
            f"input.reuse_from={reuse_from!r} cannot be reused: {reason} "
            "(input.reuse_mismatch is fail; set it to encode_all to encode everything instead)"
        )
    log.warning("input.reuse_from=%s is not reused, encoding everything: %s", reuse_from, reason)
    return ReuseDecision(None, reason)


def _read_reusable(reuse_from: str, key: dict, folder: str) -> tuple[dict | None, str | None]:
    """The previous run's manifest, and why it cannot be reused (None when it can)."""
    try:
        manifest = output_lib.read_manifest(reuse_from)
    except output_lib.ManifestTooNew:
        raise  # not a mismatch that encoding everything answers: this docbeam is older than the output
    except (output_lib.OutputRefused, ValueError) as e:
        return None, f"its manifest cannot be read ({e})"
    return manifest, _why_not(reuse_from, manifest, key, folder)


def calibration_problem(embedding: dict) -> str | None:
    """Why an earlier run's int8/uint8 calibration cannot quantize today's vectors (not 2 × dim finite ranges, each
    min at most its max), or None: a garbled one would quantize every new vector silently wrong."""
    calibration = embedding.get("calibration")
    if calibration is None:
        return None
    try:
        ranges = np.asarray(calibration["ranges"], np.float64)
        ok = (
            ranges.shape == (2, embedding.get("dim"))
            and np.isfinite(ranges).all()
            and bool((ranges[0] <= ranges[1]).all())
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    return None if ok else "its int8/uint8 calibration is not 2 x dim finite ranges with each min at most its max"


def _why_not(reuse_from: str, manifest: dict | None, key: dict, folder: str) -> str | None:
    if manifest is None:
        return "it holds no committed docbeam run (no _manifest.json: a failed, partial or missing run)"
    if "reuse_key" not in manifest:
        return f"run {manifest['run_id']} recorded no reuse key (written before incremental runs existed)"
    if manifest.get("granularity") == "chunk":
        return f"run {manifest['run_id']} wrote chunk rows only (output.granularity=chunk): no document vectors"
    garbled = calibration_problem(manifest.get("embedding") or {})
    if garbled:
        return f"run {manifest['run_id']}: {garbled}"
    differences = key_differences(manifest["reuse_key"], key)
    if differences:
        return f"run {manifest['run_id']} used other settings: {'; '.join(differences)}"
    return output_lib.damaged(reuse_from, manifest, folder)


class SplitByReuse(beam.PTransform):
    """Documents → ``to_encode`` (new or changed) and ``reused`` (previous rows, byte for byte)."""

    def __init__(self, source: ReuseSource, head, prompt: str | None = None):
        """``head``: the run's models/heads Head, whose rows are read back and checked (Head.reusable)."""
        super().__init__()
        self._source, self._head, self._prompt = source, head, prompt

    def expand(self, documents):
        from apache_beam.io.parquetio import ReadAllFromParquet

        previous = (
            documents.pipeline
            | "PreviousFiles" >> beam.Create(self._source.files)
            | "ReadPrevious" >> ReadAllFromParquet(columns=row_fields(self._head))
            | "KeyPrevious" >> beam.Map(lambda row: (row["id"], row))
        )
        current = documents | "KeyDocuments" >> beam.Map(lambda d: (d.id, d))
        split = (
            {"document": current, "previous": previous}
            | "JoinById" >> beam.CoGroupByKey()
            | "ReuseOrEncode"
            >> beam.FlatMap(_reuse_or_encode, self._head, self._prompt).with_outputs("reused", main="to_encode")
        )
        return {"to_encode": split.to_encode, "reused": split.reused}


_reused = Metrics.counter(METRICS_NAMESPACE, "docs_reused")


def row_fields(head) -> list[str]:
    """The columns of a head's row that a reused row carries over: its files' schema, kept fields aside."""
    from docbeam.pipeline.stages.write import rows_schema

    return rows_schema(head).names


def _reuse_or_encode(item, head, prompt: str | None):
    _, grouped = item
    for doc in grouped["document"]:  # none when it is gone from the input: then it is gone from the output
        row = reusable_row(doc, list(grouped["previous"]), head, prompt)
        if row is None:
            yield doc
        else:
            _reused.inc()
            yield beam.pvalue.TaggedOutput("reused", row)


def reusable_row(doc: Document, previous: list[dict], head, prompt: str | None = None) -> dict | None:
    """The previous row for ``doc`` if its text (and prompt) is unchanged and its values sound (the head's
    ``reusable``: length and finiteness), with ``doc``'s kept fields (this input's values, never the previous
    row's); None to encode it."""
    if len(previous) != 1 or previous[0].get("content_hash") != content_hash(doc.text, prompt):
        return None
    row = previous[0]
    if not head.reusable(row):
        log.warning(
            "document %r: its previous %s row is not of this run's shape or not finite; encoding it again",
            doc.id,
            head.name,
        )
        return None
    return with_kept({name: row[name] for name in row_fields(head)}, doc.kept)

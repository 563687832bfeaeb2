"""ReadDocuments: files (local or gs://, globs) → Documents, and Rejected records for bad input.

Nothing is dropped silently: every JSONL line and every text file becomes exactly one Document or one
Rejected, so ``docs_read == docs_embedded + docs_rejected`` holds by construction downstream.
"""
from __future__ import annotations

import gzip
import json
from typing import BinaryIO, Callable, Iterator

import apache_beam as beam
from apache_beam.io import fileio
from apache_beam.io.filesystem import CompressedFile, CompressionTypes
from apache_beam.metrics import Metrics

from pipeline.config import InputConfig
from pipeline.records import Document, Rejected

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.bz2", ".ndjson", ".ndjson.gz")  # README lists these
REJECTED_TAG = "rejected"
NAMESPACE = "docbeam"


def file_format(path: str, configured: str) -> str:
    if configured != "auto":
        return configured
    return "jsonl" if path.lower().endswith(JSONL_SUFFIXES) else "text"


def read_capped_lines(stream, cap: int, block: int = 1 << 20) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; ``None`` for a line over ``cap`` bytes, whose bytes are never held.

    Reads fixed blocks because Beam's compressed streams have no ``readline(limit)``.
    """
    number, pending, oversized = 0, bytearray(), False
    while True:
        data = stream.read(block)
        if not data:
            break
        start = 0
        while True:
            newline = data.find(b"\n", start)
            piece = data[start:] if newline < 0 else data[start:newline]
            if not oversized:
                pending += piece
                oversized = len(pending.rstrip(b"\r")) > cap
                if oversized:
                    pending.clear()
            if newline < 0:
                break
            number += 1
            yield number, None if oversized else bytes(pending)
            pending, oversized, start = bytearray(), False, newline + 1
    if pending or oversized:
        yield number + 1, None if oversized else bytes(pending)


def parse_jsonl_line(raw: bytes, *, source: str, line: int, id_field: str, text_field: str,
                     cap: int) -> Document | Rejected:
    def reject(kind, reason, doc_id=None):
        return Rejected(source=source, line=line, id=doc_id, kind=kind, reason=reason)

    if raw is None:
        return reject("line_too_large", f"line is larger than input.max_line_bytes={cap}")
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return reject("invalid_utf8", f"not valid UTF-8: {e}")
    try:
        obj = json.loads(decoded)
    except json.JSONDecodeError as e:
        return reject("malformed_json", f"not valid JSON: {e.msg} at column {e.colno}")
    if not isinstance(obj, dict):
        return reject("malformed_json", f"expected a JSON object, got {type(obj).__name__}")
    doc_id = obj.get(id_field)
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or doc_id == "":
        return reject("missing_id", f"field {id_field!r} (input.id_field) is missing or not a string/integer: "
                                    f"{doc_id!r}")
    doc_id = str(doc_id)
    if text_field not in obj or obj[text_field] is None:
        return reject("missing_text", f"field {text_field!r} (input.text_field) is missing", doc_id)
    text = obj[text_field]
    if not isinstance(text, str):
        return reject("non_string_text", f"field {text_field!r} is a {type(text).__name__}, not a string", doc_id)
    if not text.strip():
        return reject("empty_text", f"field {text_field!r} is empty", doc_id)
    return Document(id=doc_id, text=text, source=source, line=line)


def parse_text_file(data: bytes | None, *, source: str, cap: int) -> Document | Rejected:
    if data is None:
        return Rejected(source, None, source, "line_too_large", f"file is larger than input.max_line_bytes={cap}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejected(source, None, source, "invalid_utf8", f"not valid UTF-8: {e}")
    if not text.strip():
        return Rejected(source, None, source, "empty_text", "file is empty")
    return Document(id=source, text=text, source=source, line=None)


def open_decompressed(open_raw: Callable[[], BinaryIO], path: str) -> BinaryIO:
    """gzip through Python's own reader, since Beam's stops quietly at a truncated stream (the tail of
    the file would vanish); other compressions through Beam's."""
    if path.lower().endswith(".gz"):
        return gzip.GzipFile(fileobj=open_raw(), mode="rb")
    return CompressedFile(open_raw(), CompressionTypes.detect_compression_type(path)) \
        if CompressionTypes.detect_compression_type(path) != CompressionTypes.UNCOMPRESSED else open_raw()


def file_records(open_raw: Callable[[], BinaryIO], path: str, config: InputConfig) -> Iterator[Document | Rejected]:
    """Every record of one file, in order: a Document or a Rejected per JSONL line, one per text file.
    ``open_raw`` opens the file's bytes as stored (compressed or not)."""
    with open_decompressed(open_raw, path) as stream:
        if file_format(path, config.format) == "jsonl":
            for number, raw in read_capped_lines(stream, config.max_line_bytes):
                if raw is not None and not raw.strip():
                    continue  # blank lines separate nothing and are not documents
                yield parse_jsonl_line(raw, source=path, line=number, id_field=config.id_field,
                                       text_field=config.text_field, cap=config.max_line_bytes)
        else:
            data = stream.read(config.max_line_bytes + 1)
            yield parse_text_file(data if len(data) <= config.max_line_bytes else None, source=path,
                                  cap=config.max_line_bytes)


class _ParseFile(beam.DoFn):
    def __init__(self, config: InputConfig):
        self._config = config
        self._read = Metrics.counter(NAMESPACE, "docs_read")

    def process(self, readable: fileio.ReadableFile):
        path = readable.metadata.path
        try:
            open_raw = lambda: readable.open(compression_type=CompressionTypes.UNCOMPRESSED)  # noqa: E731
            for record in file_records(open_raw, path, self._config):
                self._read.inc()
                yield record if isinstance(record, Document) else beam.pvalue.TaggedOutput(REJECTED_TAG, record)
        except Exception as e:  # an unreadable or corrupt file is one rejection, not a crashed job
            self._read.inc()
            yield beam.pvalue.TaggedOutput(REJECTED_TAG, Rejected(
                path, None, None, "unreadable_file", f"{type(e).__name__}: {e} (records before the failure were kept)"))


def keep_first_of_duplicates(item) -> Iterator:
    """Of documents sharing an id, the first by (source, line) is kept; the rest are rejected."""
    doc_id, docs = item
    ordered = sorted(docs, key=lambda d: (d.source, d.line or 0))
    yield ordered[0]
    for dup in ordered[1:]:
        yield beam.pvalue.TaggedOutput(REJECTED_TAG, Rejected(
            dup.source, dup.line, doc_id, "duplicate_id",
            f"id {doc_id!r} already used at {ordered[0].source}:{ordered[0].line}"))


class ReadDocuments(beam.PTransform):
    """Outputs ``documents`` (unique ids), ``rejected`` and ``docs_read`` (one count)."""

    def __init__(self, config: InputConfig):
        super().__init__()
        self._config = config

    def expand(self, pbegin):
        patterns = [p.strip() for p in self._config.path.split(",") if p.strip()]
        parsed = (
            pbegin
            | "Patterns" >> beam.Create(patterns)
            | "Match" >> fileio.MatchAll(fileio.EmptyMatchTreatment.DISALLOW)
            | "Open" >> fileio.ReadMatches(skip_directories=True)
            | "SpreadFiles" >> beam.Reshuffle()
            | "Parse" >> beam.ParDo(_ParseFile(self._config)).with_outputs(REJECTED_TAG, main="documents"))
        unique = (
            parsed.documents
            | "KeyById" >> beam.Map(lambda d: (d.id, d))
            | "GroupById" >> beam.GroupByKey()
            | "DropDuplicates" >> beam.FlatMap(keep_first_of_duplicates).with_outputs(REJECTED_TAG, main="documents"))
        rejected = (parsed[REJECTED_TAG], unique[REJECTED_TAG]) | "AllRejected" >> beam.Flatten()
        # Counted before de-duplication, independently of what later stages emit: the check on them.
        docs_read = ((parsed.documents, parsed[REJECTED_TAG]) | "AllParsed" >> beam.Flatten()
                     | "CountRead" >> beam.combiners.Count.Globally())
        return {"documents": unique.documents, "rejected": rejected, "docs_read": docs_read}

"""ReadDocuments: files (local or gs://, globs) → Documents, and Rejected records for bad input.

Nothing is dropped silently: each matched path is read once, and every JSONL line, every text file and every
path that is not a readable file becomes exactly one Document or one Rejected, so
``docs_read == docs_embedded + docs_rejected`` holds by construction downstream.
"""
from __future__ import annotations

import codecs
import errno
import gzip
import json
import os
import re
import stat
from typing import BinaryIO, Callable, Iterator

import apache_beam as beam
from apache_beam.io.filesystem import CompressedFile, CompressionTypes, FileSystem
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from pipeline.config import InputConfig
from pipeline.observe import METRICS_NAMESPACE, StageClock
from pipeline.records import Document, Rejected

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.bz2", ".ndjson", ".ndjson.gz")  # README lists these
REJECTED_TAG = "rejected"


def file_format(path: str, configured: str) -> str:
    if configured != "auto":
        return configured
    return "jsonl" if path.lower().endswith(JSONL_SUFFIXES) else "text"


def read_capped_lines(stream, cap: int, block: int = 1 << 20) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; ``None`` for a line over ``cap`` bytes, whose bytes are never held.

    Reads fixed blocks because Beam's compressed streams have no ``readline(limit)``; with ``read1`` where the
    stream has it, since ``GzipFile.read(n)`` raises at a damaged tail without returning what it decompressed.
    """
    read = getattr(stream, "read1", stream.read)
    number, pending, oversized = 0, bytearray(), False
    while True:
        data = read(block)
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
        decoded = raw.decode("utf-8-sig")  # a BOM (a file's first line, or a file concatenated on) is not JSON
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
        text = data.decode("utf-8-sig")  # a leading BOM is not text
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
    """Every record of one file, in order: a Document or a Rejected per JSONL line, one per text file, and a
    ``truncated_file`` Rejected where compressed data ends early. ``open_raw`` opens the bytes as stored."""
    jsonl, lines_read = file_format(path, config.format) == "jsonl", 0
    try:
        with open_decompressed(open_raw, path) as stream:
            if jsonl:
                for lines_read, raw in read_capped_lines(stream, config.max_line_bytes):
                    if raw is not None and not raw.removeprefix(codecs.BOM_UTF8).strip():
                        continue  # blank lines separate nothing and are not documents
                    yield parse_jsonl_line(raw, source=path, line=lines_read, id_field=config.id_field,
                                           text_field=config.text_field, cap=config.max_line_bytes)
            else:
                data = stream.read(config.max_line_bytes + 1)
                yield parse_text_file(data if len(data) <= config.max_line_bytes else None, source=path,
                                      cap=config.max_line_bytes)
    except EOFError as e:  # gzip's word for a stream cut short; the incomplete last line was never parsed
        kept = (f"it breaks after line {lines_read}; the records before it were kept" if jsonl
                else "the text is incomplete and was not kept")
        yield Rejected(path, None, None, "truncated_file", f"compressed data ends early ({e}): {kept}")


def match_local(pattern: str) -> list[str]:
    """Local paths matching ``pattern`` as Beam's LocalFileSystem matches them (``*`` within a folder, ``**``
    across folders), but keeping what its listing drops: it stats every file and silently skips broken symlinks
    and symlink loops (apache_beam/io/localfilesystem.py ``_list``). Directories are not inputs."""
    if pattern.endswith(os.sep):
        pattern += "*"
    prefix = re.match(r"^[^[*?]*", pattern).group(0)
    if prefix == pattern:
        return [pattern] if os.path.lexists(pattern) and not os.path.isdir(pattern) else []
    is_match = re.compile(FileSystem.translate_pattern(pattern)).match
    # os.walk lists FIFOs, sockets, broken symlinks and loops among the files, symlinked folders among the folders.
    return sorted(path for folder, _, names in os.walk(os.path.dirname(prefix))
                  for path in (os.path.join(folder, name) for name in names) if is_match(path))


def match_paths(pattern: str) -> list[str]:
    """Every path ``pattern`` matches, each to become records (none is opened here)."""
    if FileSystems.get_scheme(pattern) is None:
        paths = match_local(pattern)
    else:  # object stores: every object is a regular file; "folder/" placeholders are not inputs
        paths = [m.path for m in FileSystems.match([pattern])[0].metadata_list if not m.path.endswith("/")]
    if not paths:
        raise FileNotFoundError(f"input.path pattern {pattern!r} matches no file")
    return paths


def same_file_key(path: str) -> str:
    """One key per file however a pattern spelled it (``in/a.jsonl``, ``./in/a.jsonl``), so it is read once."""
    return os.path.abspath(path) if FileSystems.get_scheme(path) is None else path


_SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                  (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def unopenable(path: str) -> tuple[str, str] | None:
    """(kind, reason) for a local path that must not be opened (a FIFO would block the reader forever, a device
    never ends); None for a regular file or any gs:// object."""
    if FileSystems.get_scheme(path) is not None:
        return None
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if not os.path.islink(path):
            raise  # removed since the match: an unreadable file
        return "broken_symlink", f"{path} is a symlink to {os.readlink(path)!r}, which does not exist"
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        return "symlink_loop", f"{path} is a symlink that never reaches a file ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    what = next((name for is_kind, name in _SPECIAL_FILES if is_kind(mode)), f"of file type {stat.S_IFMT(mode):o}")
    return "not_regular_file", f"{path} is {what}, not a regular file; it was not opened"


def path_records(path: str, config: InputConfig) -> Iterator[Document | Rejected]:
    """The records of one matched path: one Rejected for a path that must not be opened, else ``file_records``.

    No retry here: on gs:// ``FileSystems.open`` reads through ``BeamBlobReader`` (apache_beam/io/gcp/gcsio.py:
    ``GcsIO.open`` passes ``retry=gcsio_retry.get_retry(...)``), whose every ranged download is retried by
    google-cloud-storage, body included, resuming at the last byte received (google/cloud/storage/_media/
    requests/download.py ``retriable_request``), on 408/429/5xx, connection resets and timeouts
    (google/cloud/storage/retry.py ``_RETRYABLE_TYPES``), backing off 1 s → 60 s for up to 120 s. What fails
    after that is an ``unreadable_file`` record."""
    problem = unopenable(path)
    if problem:
        yield Rejected(path, None, None, *problem)
        return
    yield from file_records(lambda: FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED),
                            path, config)


class _ParseFile(beam.DoFn):
    def __init__(self, config: InputConfig):
        self._config = config
        self._read = Metrics.counter(METRICS_NAMESPACE, "docs_read")
        self._clock = StageClock("read")

    def process(self, path: str):
        try:
            for record in self._clock.timed(path_records(path, self._config)):
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
        parsed = (
            pbegin
            | "Patterns" >> beam.Create(self._config.patterns)
            | "Match" >> beam.FlatMap(match_paths)
            | "KeyByFile" >> beam.Map(lambda path: (same_file_key(path), path))
            | "ReadEachFileOnce" >> beam.CombinePerKey(min)  # overlapping patterns; also spreads files over workers
            | "Paths" >> beam.Values()
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

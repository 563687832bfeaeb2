"""ReadDocuments: files (local or gs://, globs) → Documents, and Rejected records for bad input.

Nothing is dropped silently: each matched path is read once, and every JSONL line, every text file and every
path that is not a readable file becomes exactly one Document or one Rejected, so
``docs_read == docs_embedded + docs_rejected`` holds by construction downstream.
"""
from __future__ import annotations

import bz2
import codecs
import errno
import json
import lzma
import os
import re
import stat
import zlib
from typing import BinaryIO, Callable, Iterator

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes, FileSystem
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from pipeline.driver.config import InputConfig
from pipeline.telemetry.observe import METRICS_NAMESPACE, StageClock
from pipeline.records import Document, Rejected, writable

JSONL_SUFFIXES = (".jsonl", ".ndjson")  # README lists these, each also with any compression suffix below
REJECTED_TAG = "rejected"


def file_format(path: str, configured: str) -> str:
    """``auto``: JSONL when the name, less a compression suffix Beam knows (``.gz``, ``.bz2``, ``.zst``, ...),
    ends in a JSONL suffix; text otherwise."""
    if configured != "auto":
        return configured
    name = path.lower()
    if CompressionTypes.detect_compression_type(name) != CompressionTypes.UNCOMPRESSED:
        name = os.path.splitext(name)[0]
    return "jsonl" if name.endswith(JSONL_SUFFIXES) else "text"


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
    except RecursionError:
        return reject("malformed_json", "not parsed: arrays or objects nested too deeply")
    except ValueError as e:  # e.g. an integer of more digits than Python converts (sys.get_int_max_str_digits)
        return reject("malformed_json", f"not parsed: {e}")
    if not isinstance(obj, dict):
        return reject("malformed_json", f"expected a JSON object, got {type(obj).__name__}")
    doc_id = obj.get(id_field)
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or doc_id == "":
        return reject("missing_id", f"field {id_field!r} (input.id_field) is missing or not a string/integer: "
                                    f"{doc_id!r}")
    doc_id = str(doc_id)
    if not_utf8(doc_id):
        return reject("invalid_text", f"field {id_field!r} (input.id_field) {ascii(doc_id)} {not_utf8(doc_id)}")
    if text_field not in obj or obj[text_field] is None:
        return reject("missing_text", f"field {text_field!r} (input.text_field) is missing", doc_id)
    text = obj[text_field]
    if not isinstance(text, str):
        return reject("non_string_text", f"field {text_field!r} is a {type(text).__name__}, not a string", doc_id)
    if not text.strip():
        return reject("empty_text", f"field {text_field!r} is empty", doc_id)
    if not_utf8(text):
        return reject("invalid_text", f"field {text_field!r} {not_utf8(text)}", doc_id)
    return Document(id=doc_id, text=text, source=source, line=line)


def not_utf8(value: str) -> str | None:
    """Why ``value`` cannot be written as UTF-8, or None: JSON's ``\\ud800`` escapes decode to lone UTF-16
    surrogates, which no encoder, tokenizer or Beam coder downstream accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"holds a lone UTF-16 surrogate ({ascii(value[e.start])} at character {e.start}), which is not "
                "text: the producer split or damaged a character")
    return None


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


def _zstd_decompressor():
    import zstandard  # Beam's own dependency for .zst; imported only for such a file

    return zstandard.ZstdDecompressor(max_window_size=1 << 31).decompressobj()  # Beam's window limit


# Each compression Beam reads (apache_beam.io.filesystem.CompressionTypes), as Beam decompresses it: a new
# decompressor per stream, one (compressed bytes per read, whether ``decompress`` takes ``max_length``).
_DECOMPRESSORS = {
    CompressionTypes.GZIP: (lambda: zlib.decompressobj(16 + zlib.MAX_WBITS), 1 << 16, True),
    CompressionTypes.DEFLATE: (zlib.decompressobj, 1 << 16, True),
    CompressionTypes.BZIP2: (bz2.BZ2Decompressor, 1 << 16, True),
    CompressionTypes.LZMA: (lzma.LZMADecompressor, 1 << 16, True),
    # No max_length: small reads bound what one call can produce (a zstd block of 128 kB can be 4 bytes).
    CompressionTypes.ZSTD: (_zstd_decompressor, 1 << 12, False),
}


class DecompressedStream:
    """The decompressed bytes of a stored file, ``read1(n)`` at a time, raising ``EOFError`` where the stored
    bytes end inside a compressed stream (a truncated file).

    Not Beam's ``CompressedFile``: it treats running out of input mid-stream as the end of the file, so a
    truncated ``.bz2``, ``.zst``, ``.xz`` or ``.deflate`` file would read as if whole. Streams one after
    another (``cat a.gz b.gz``) are read as one, as Beam and gzip read them; zero bytes after a gzip
    stream are padding, as gzip treats them.
    """

    def __init__(self, raw: BinaryIO, compression: str):
        self._raw, self._gzip = raw, compression == CompressionTypes.GZIP
        self._new, self._chunk, self._bounded = _DECOMPRESSORS[compression]
        self._decompressor, self._input, self._empty = self._new(), b"", True

    def read1(self, size: int) -> bytes:
        while self._decompressor is not None:
            if self._decompressor.eof:
                self._decompressor = self._next_stream()
                continue
            data = self._decompress(size)
            if data:
                return data
            if not self._input:
                self._input = self._raw.read(self._chunk)
                if not self._input and not self._decompressor.eof:
                    if self._empty:
                        return b""  # an empty file holds nothing, as gzip reads it; not a cut stream
                    raise EOFError("the compressed stream ends before its end marker")
                self._empty = False
        return b""

    def _next_stream(self):
        """A decompressor for the stream after the one that just ended, or None at the end of the file."""
        following = self._decompressor.unused_data + self._input
        while True:
            if self._gzip:
                following = following.lstrip(b"\0")
            if following:
                self._input = following
                return self._new()
            following = self._raw.read(self._chunk)
            if not following:
                return None

    def _decompress(self, size: int) -> bytes:
        if self._decompressor.eof:
            return b""
        if not self._bounded:
            data, self._input = self._decompressor.decompress(self._input), b""
            return data
        data = self._decompressor.decompress(self._input, size)
        # zlib hands back what it did not take; bz2 and lzma keep it and take more only when they need input
        self._input = getattr(self._decompressor, "unconsumed_tail", b"")
        return data

    def read(self, size: int) -> bytes:
        parts, left = [], size
        while left > 0:
            part = self.read1(left)
            if not part:
                break
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    def __enter__(self) -> "DecompressedStream":
        return self

    def __exit__(self, *_) -> None:
        self._raw.close()


def open_decompressed(open_raw: Callable[[], BinaryIO], path: str) -> BinaryIO:
    """The file's bytes, decompressed by its suffix as Beam would (``CompressionTypes.detect_compression_type``)."""
    compression = CompressionTypes.detect_compression_type(path)
    if compression == CompressionTypes.UNCOMPRESSED:
        return open_raw()
    return DecompressedStream(open_raw(), compression)


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
                    yield guarded_line(raw, source=path, line=lines_read, config=config)
            else:
                data = stream.read(config.max_line_bytes + 1)
                yield parse_text_file(data if len(data) <= config.max_line_bytes else None, source=path,
                                      cap=config.max_line_bytes)
    except EOFError as e:  # a compressed stream cut short; the incomplete last line was never parsed
        kept = (f"it breaks after line {lines_read}; the records before it were kept" if jsonl
                else "the text is incomplete and was not kept")
        yield Rejected(path, None, None, "truncated_file", f"compressed data ends early ({e}): {kept}")


def guarded_line(raw: bytes | None, *, source: str, line: int, config: InputConfig) -> Document | Rejected:
    """``parse_jsonl_line``, where a failure no check there foresaw still costs one line, never the rest of
    its file."""
    try:
        return parse_jsonl_line(raw, source=source, line=line, id_field=config.id_field,
                                text_field=config.text_field, cap=config.max_line_bytes)
    except Exception as e:  # noqa: BLE001  one line's rejection, with the reason
        return Rejected(source, line, None, "malformed_json", writable(f"not parsed: {type(e).__name__}: {e}"))


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


def named_path(path: str) -> tuple[str, str]:
    """(name, "") for a path every stage can carry; (its name with ``\\x`` escapes, why it is not read) for a
    local file name that is not UTF-8. The OS hands such a name over with surrogate escapes, which no Beam
    coder encodes: one such file would otherwise fail the whole job."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        return shown, (f"the file name {shown} is not UTF-8 (shown with \\x escapes), so its documents could not be "
                       "named in the output; it was not read. Rename it in UTF-8 and the next run reads it")
    return path, ""


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

    def process(self, named: tuple[str, str]):
        path, bad_name = named
        if bad_name:
            self._read.inc()
            yield beam.pvalue.TaggedOutput(REJECTED_TAG, Rejected(path, None, None, "bad_path", bad_name))
            return
        try:
            for record in self._clock.timed(path_records(path, self._config)):
                self._read.inc()
                yield record if isinstance(record, Document) else beam.pvalue.TaggedOutput(REJECTED_TAG, record)
        except Exception as e:  # an unreadable or corrupt file is one rejection, not a crashed job
            self._read.inc()
            yield beam.pvalue.TaggedOutput(REJECTED_TAG, Rejected(
                path, None, None, "unreadable_file",
                writable(f"{type(e).__name__}: {e} (records before the failure were kept)")))


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
            | "Match" >> beam.FlatMap(lambda pattern: [named_path(path) for path in match_paths(pattern)])
            | "KeyByFile" >> beam.Map(lambda named: ((same_file_key(named[0]), named[1]), named))
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

"""The bytes of one input file → Documents and Rejected records, one per JSONL line or per text file.

Pure functions over bytes (no Beam, no storage), so each rejection kind is tested directly; the file's
bytes come decompressed from pipeline/stages/decompress.py.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import BinaryIO, Callable, Iterator, Mapping

from apache_beam.io.filesystem import CompressionTypes

from docbeam.config import InputConfig
from docbeam.pipeline.records import Document, Rejected, writable
from docbeam.pipeline.stages.decompress import open_decompressed
from docbeam.pipeline.stages.keep import EveryField, KeptFields

JSONL_SUFFIXES = (".jsonl", ".ndjson")  # README lists these, each also with any compression suffix Beam knows


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


def parse_jsonl_line(
    raw: bytes,
    *,
    source: str,
    line: int,
    id_field: str,
    text_field: str,
    cap: int,
    keep: KeptFields | EveryField | None = None,
) -> Document | Rejected:
    """One JSONL line → a Document (with the fields ``keep.take`` keeps, pipeline/stages/keep.py) or a
    Rejected saying why not."""

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
    return document_of_record(obj, source=source, line=line, id_field=id_field, text_field=text_field, keep=keep)


def document_of_record(
    obj: Mapping,
    *,
    source: str,
    line: int | None,
    id_field: str,
    text_field: str,
    keep: KeptFields | EveryField | None = None,
) -> Document | Rejected:
    """A decoded record → a Document, or the Rejected saying why not: an id that is a string or an integer, a
    text that is a non-empty string, both writable as UTF-8. The JSONL reader's checks, which
    docbeam.EmbedDocuments also runs on the dicts of a user's own pipeline."""

    def reject(kind, reason, doc_id=None):
        return Rejected(source=source, line=line, id=doc_id, kind=kind, reason=reason)

    doc_id = obj.get(id_field)
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or doc_id == "":
        return reject(
            "missing_id", f"field {id_field!r} (input.id_field) is missing or not a string/integer: {doc_id!r}"
        )
    try:
        doc_id = str(doc_id)
    except ValueError:  # an integer past Python's 4,300-digit limit for str()
        return reject("missing_id", f"field {id_field!r} (input.id_field) is an integer of over 4,300 digits")
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
    kept = keep.take(dict(obj)) if keep is not None else ()
    if isinstance(kept, str):
        return reject("kept_field_type", kept, doc_id)
    return Document(id=doc_id, text=text, source=source, line=line, kept=kept)


def not_utf8(value: str) -> str | None:
    """Why ``value`` cannot be written as UTF-8, or None: JSON's ``\\ud800`` escapes decode to lone UTF-16
    surrogates, which no encoder, tokenizer or Beam coder downstream accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"holds a lone UTF-16 surrogate ({ascii(value[e.start])} at character {e.start}), which is not "
            "text: the producer split or damaged a character"
        )
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
    # Chunk offsets count the BOM: they index the file as a plain UTF-8 reader (Python's open()) returns it.
    return Document(id=source, text=text, source=source, line=None, text_offset=int(data.startswith(codecs.BOM_UTF8)))


def file_records(
    open_raw: Callable[[], BinaryIO], path: str, config: InputConfig, keep: KeptFields | EveryField | None = None
) -> Iterator[Document | Rejected]:
    """Every record of one file, in order: a Document or a Rejected per JSONL line, one per text file, and a
    ``truncated_file`` Rejected where compressed data ends early. ``open_raw`` opens the bytes as stored; ``keep``
    takes each JSONL record's kept fields (a text file has none)."""
    jsonl, lines_read = file_format(path, config.format) == "jsonl", 0
    try:
        with open_decompressed(open_raw, path) as stream:
            if jsonl:
                for lines_read, raw in read_capped_lines(stream, config.max_line_bytes):
                    if raw is not None and not raw.removeprefix(codecs.BOM_UTF8).strip():
                        continue  # blank lines separate nothing and are not documents
                    yield guarded_line(raw, source=path, line=lines_read, config=config, keep=keep)
            else:
                data = stream.read(config.max_line_bytes + 1)
                yield parse_text_file(
                    data if len(data) <= config.max_line_bytes else None, source=path, cap=config.max_line_bytes
                )
    except EOFError as e:  # a compressed stream cut short; the incomplete last line was never parsed
        kept = (
            f"it breaks after line {lines_read}; the records before it were kept"
            if jsonl
            else "the text is incomplete and was not kept"
        )
        yield Rejected(path, None, None, "truncated_file", f"compressed data ends early ({e}): {kept}")


def guarded_line(
    raw: bytes | None, *, source: str, line: int, config: InputConfig, keep: KeptFields | EveryField | None = None
) -> Document | Rejected:
    """``parse_jsonl_line``, where a failure no check there foresaw still costs one line, never the rest of
    its file."""
    try:
        return parse_jsonl_line(
            raw,
            source=source,
            line=line,
            id_field=config.id_field,
            text_field=config.text_field,
            cap=config.max_line_bytes,
            keep=keep,
        )
    except Exception as e:  # noqa: BLE001  one line's rejection, with the reason
        return Rejected(source, line, None, "malformed_json", writable(f"not parsed: {type(e).__name__}: {e}"))

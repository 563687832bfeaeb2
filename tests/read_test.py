"""pipeline/stages/read.py: every JSONL line and every text file becomes exactly one Document or one Rejected."""

from __future__ import annotations

import gzip
import io
import os

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from docbeam.config import InputConfig
from docbeam.pipeline.records import Document, Rejected
from docbeam.pipeline.stages.parse import file_format, parse_jsonl_line, parse_text_file, read_capped_lines
from docbeam.pipeline.stages.read import ReadDocuments

BLOCK_SIZES = [1, 2, 3, 5, 1 << 20]  # tiny blocks put every line boundary on a block boundary somewhere


def lines(data: bytes, cap: int, block: int) -> list:
    return list(read_capped_lines(io.BytesIO(data), cap, block=block))


# read_capped_lines


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_lines_are_numbered_from_one_and_keep_blank_lines(block):
    assert lines(b"ab\n\ncd\n", cap=10, block=block) == [(1, b"ab"), (2, b""), (3, b"cd")]


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_a_last_line_without_newline_is_still_a_line(block):
    assert lines(b"ab\ncd", cap=10, block=block) == [(1, b"ab"), (2, b"cd")]


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_crlf_lines_keep_the_cr_but_it_does_not_count_against_the_cap(block):
    # The JSON parser treats the \r as trailing whitespace; a line of exactly `cap` bytes plus \r still fits.
    assert lines(b"abc\r\nde\r\n", cap=3, block=block) == [(1, b"abc\r"), (2, b"de\r")]


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_a_line_of_exactly_the_cap_fits_and_one_byte_more_does_not(block):
    assert lines(b"abc\nabcd\n", cap=3, block=block) == [(1, b"abc"), (2, None)]


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_oversized_lines_at_start_middle_and_end_become_none_without_shifting_numbers(block):
    data = b"toolong\nok\nmuchtoolong\nfine\nlastlong"
    assert lines(data, cap=4, block=block) == [(1, None), (2, b"ok"), (3, None), (4, b"fine"), (5, None)]


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_an_oversized_last_line_with_newline_is_one_line(block):
    assert lines(b"ok\ntoolong\n", cap=4, block=block) == [(1, b"ok"), (2, None)]


def test_an_empty_stream_has_no_lines():
    assert lines(b"", cap=4, block=2) == []


# parse_jsonl_line


def parse(raw: bytes | None, cap: int = 1000) -> Document | Rejected:
    return parse_jsonl_line(raw, source="in.jsonl", line=7, id_field="id", text_field="text", cap=cap)


def test_a_good_line_is_a_document_with_its_source_and_line():
    assert parse(b'{"id": "a", "text": "hello", "extra": 1}') == Document(
        id="a", text="hello", source="in.jsonl", line=7
    )


def test_an_integer_id_becomes_a_string():
    assert parse(b'{"id": 42, "text": "hello"}').id == "42"


def test_a_utf8_bom_before_a_line_is_not_part_of_the_json():
    # Editors on Windows write one at the start of a file; `cat` of such files puts one at a line start.
    assert parse(b'\xef\xbb\xbf{"id": "a", "text": "hello"}') == parse(b'{"id": "a", "text": "hello"}')


def test_crlf_line_parses():
    assert parse(b'{"id": "a", "text": "hello"}\r').text == "hello"


def test_custom_field_names_are_used():
    doc = parse_jsonl_line(b'{"key": "k", "body": "b"}', source="s", line=1, id_field="key", text_field="body", cap=100)
    assert (doc.id, doc.text) == ("k", "b")


@pytest.mark.parametrize(
    "raw, kind, rejected_id",
    [
        (b"{not json", "malformed_json", None),
        (b'["id", "text"]', "malformed_json", None),
        (b'"just a string"', "malformed_json", None),
        (b'{"text": "no id"}', "missing_id", None),
        (b'{"id": "", "text": "empty id"}', "missing_id", None),
        (b'{"id": null, "text": "null id"}', "missing_id", None),
        (b'{"id": true, "text": "bool id"}', "missing_id", None),
        (b'{"id": 1.5, "text": "float id"}', "missing_id", None),
        (b'{"id": "a"}', "missing_text", "a"),
        (b'{"id": "a", "text": null}', "missing_text", "a"),
        (b'{"id": "a", "text": 42}', "non_string_text", "a"),
        (b'{"id": "a", "text": ["x"]}', "non_string_text", "a"),
        (b'{"id": "a", "text": ""}', "empty_text", "a"),
        (b'{"id": "a", "text": " \\n\\t "}', "empty_text", "a"),
        (b'{"id": "a", "text": "\xff\xfe"}', "invalid_utf8", None),
        (None, "line_too_large", None),
        (b'{"id": "a", "text": "t", "n": ' + b"9" * 5000 + b"}", "malformed_json", None),  # ValueError, not decode
        (b"[" * 200_000 + b"]" * 200_000, "malformed_json", None),  # RecursionError
        (b'{"id": "a", "text": "half a pair \\ud83d here"}', "invalid_text", "a"),
        (b'{"id": "\\udc80", "text": "fine"}', "invalid_text", None),
    ],
)
def test_each_bad_line_is_rejected_with_its_kind_place_and_known_id(raw, kind, rejected_id):
    rejected = parse(raw)
    assert isinstance(rejected, Rejected)
    assert (rejected.kind, rejected.source, rejected.line, rejected.id) == (kind, "in.jsonl", 7, rejected_id)
    assert rejected.reason


def test_line_too_large_names_the_config_key_and_cap():
    assert "input.max_line_bytes=64" in parse(None, cap=64).reason


def test_missing_id_names_the_config_key():
    assert "input.id_field" in parse(b'{"text": "x"}').reason


def test_lines_json_cannot_parse_say_why():
    assert "4300" in parse(b'{"id": "a", "n": ' + b"1" * 5000 + b"}", cap=10_000).reason  # Python's digit limit
    assert parse(b"[" * 100_000, cap=10**6).reason == "not parsed: arrays or objects nested too deeply"


def test_a_lone_surrogate_is_named_escaped_with_its_field_and_position():
    assert parse(b'{"id": "a", "text": "ab\\ud800"}').reason == (
        "field 'text' holds a lone UTF-16 surrogate ('\\ud800' at character 2), which is not text: the producer "
        "split or damaged a character"
    )
    assert parse(b'{"id": "x\\udfff", "text": "t"}').reason.startswith("field 'id' (input.id_field) 'x\\udfff' holds")


def test_a_surrogate_pair_is_one_character_and_stays_text():
    assert parse(b'{"id": "a", "text": "smile \\ud83d\\ude00"}').text == "smile \U0001f600"


# parse_text_file


def test_a_text_file_is_one_document_named_by_its_path():
    assert parse_text_file("héllo\n".encode(), source="/d/a.txt", cap=100) == Document(
        id="/d/a.txt", text="héllo\n", source="/d/a.txt", line=None
    )


def test_a_utf8_bom_at_the_start_of_a_text_file_is_not_part_of_the_text():
    assert parse_text_file("\ufeffhéllo\n".encode(), source="/d/a.txt", cap=100).text == "héllo\n"


@pytest.mark.parametrize(
    "data, kind",
    [
        (None, "line_too_large"),
        (b"\xef\xbb\xbf \n", "empty_text"),
        (b"\xff\xfe", "invalid_utf8"),
        (b"", "empty_text"),
        (b" \n\t", "empty_text"),
    ],
)
def test_a_bad_text_file_is_rejected_under_its_path(data, kind):
    rejected = parse_text_file(data, source="/d/a.txt", cap=100)
    assert isinstance(rejected, Rejected)
    assert (rejected.kind, rejected.source, rejected.line, rejected.id) == (kind, "/d/a.txt", None, "/d/a.txt")


# file_format


@pytest.mark.parametrize(
    "path, expected",
    [
        ("a.jsonl", "jsonl"),
        ("a.jsonl.gz", "jsonl"),
        ("a.ndjson", "jsonl"),
        ("a.ndjson.gz", "jsonl"),
        ("a.json.gz", "text"),
        ("a.jsonl.bz2", "jsonl"),
        ("gs://b/A.JSONL", "jsonl"),
        ("a.jsonl.zst", "jsonl"),
        ("a.ndjson.xz", "jsonl"),
        ("a.jsonl.deflate", "jsonl"),
        ("a.jsonl.lzma", "jsonl"),
        ("a.txt.zstd", "text"),
        ("a.txt", "text"),
        ("a.json", "text"),
        ("a.md", "text"),
        ("jsonl", "text"),
    ],
)
def test_auto_format_follows_the_suffix(path, expected):
    assert file_format(path, "auto") == expected


@pytest.mark.parametrize("configured", ["jsonl", "text"])
def test_a_configured_format_wins_over_the_suffix(configured):
    assert file_format("a.jsonl", configured) == configured
    assert file_format("a.txt", configured) == configured


# ReadDocuments


def write_lines(path, lines_: list[bytes], compress=False):
    data = b"".join(line + b"\n" for line in lines_)
    with open(path, "wb") as f:
        f.write(gzip.compress(data) if compress else data)


def test_read_documents_keeps_good_documents_and_rejects_everything_else_once(tmp_path):
    cap = 64
    write_lines(
        tmp_path / "a_good.jsonl",
        [b'{"id": "g1", "text": "first"}', b"", b'{"id": "dup", "text": "kept"}', b'{"id": 7, "text": "int id"}'],
    )
    write_lines(
        tmp_path / "b_zipped.jsonl.gz",
        [b'{"id": "z1", "text": "zipped"}', b"   ", b'{"id": "z2", "text": "zipped too"}\r'],
        compress=True,
    )
    write_lines(
        tmp_path / "c_dup.jsonl",
        [
            b'{"id": "dup", "text": "a duplicate from a later file"}',
            b'{"id": "c2", "text": "twice in one file"}',
            b'{"id": "c2", "text": "the later line is the duplicate"}',
        ],
    )
    write_lines(
        tmp_path / "d_bad.jsonl",
        [
            b'{"id": "m1", "text": "the only good line here"}',
            b"{not json",
            b"[1, 2]",
            b'{"text": "no id"}',
            b'{"id": "m5"}',
            b'{"id": "m6", "text": null}',
            b'{"id": "m7", "text": 42}',
            b'{"id": "m8", "text": "   "}',
            b'{"id": "m9", "text": "\xff"}',
            b"",
            b'{"id": "m11", "text": "' + b"x" * cap + b'"}',
        ],
    )
    (tmp_path / "e_note.txt").write_text("A plain text file is one document.\n")
    (tmp_path / "f_empty.txt").write_text("\n")
    (tmp_path / "g_corrupt.jsonl.gz").write_bytes(b"this is not gzip\n")

    expected_ids = ["g1", "dup", "7", "z1", "z2", "c2", "m1", str(tmp_path / "e_note.txt")]
    expected_rejected = [
        ("c_dup.jsonl", 1, "duplicate_id"),
        ("c_dup.jsonl", 3, "duplicate_id"),
        ("d_bad.jsonl", 2, "malformed_json"),
        ("d_bad.jsonl", 3, "malformed_json"),
        ("d_bad.jsonl", 4, "missing_id"),
        ("d_bad.jsonl", 5, "missing_text"),
        ("d_bad.jsonl", 6, "missing_text"),
        ("d_bad.jsonl", 7, "non_string_text"),
        ("d_bad.jsonl", 8, "empty_text"),
        ("d_bad.jsonl", 9, "invalid_utf8"),
        ("d_bad.jsonl", 11, "line_too_large"),
        ("f_empty.txt", None, "empty_text"),
        ("g_corrupt.jsonl.gz", None, "unreadable_file"),
    ]
    config = InputConfig(path=f"{tmp_path}/*", max_line_bytes=cap)

    with TestPipeline() as p:
        out = p | ReadDocuments(config)
        assert_that(out["documents"] | beam.Map(lambda d: d.id), equal_to(expected_ids), label="DocumentIds")
        assert_that(
            out["rejected"] | beam.Map(lambda r: (os.path.basename(r.source), r.line, r.kind)),
            equal_to(expected_rejected),
            label="RejectedKinds",
        )
        assert_that(out["docs_read"], equal_to([len(expected_ids) + len(expected_rejected)]), label="DocsRead")

"""pipeline/stages/read.py: every path the input patterns match is read once or becomes one Rejected, and never hangs."""

from __future__ import annotations

import bz2
import errno
import gzip
import io
import json
import os
import re
import socket
import threading
import time

import apache_beam as beam
import pytest
import requests
import urllib3
from apache_beam.io.filesystems import FileSystems
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from docbeam.config import InputConfig
from docbeam.pipeline.stages.read import ReadDocuments, match_local, unopenable


def jsonl(*ids: str) -> bytes:
    return b"".join(b'{"id": "%s", "text": "text of %s"}\n' % (i.encode(), i.encode()) for i in ids)


def read_and_check(config: InputConfig, *, ids: list[str], rejected: list[tuple], docs_read: int):
    """Runs ReadDocuments; ``rejected`` holds (file name, line, kind, reason fragment), one per file name."""
    fragments = {name: fragment for name, _, _, fragment in rejected}

    def checked(r):
        name = os.path.basename(r.source)
        return name, r.line, r.kind, fragments.get(name, "") in r.reason

    with TestPipeline() as p:
        out = p | ReadDocuments(config)
        assert_that(out["documents"] | beam.Map(lambda d: d.id), equal_to(ids), label="DocumentIds")
        assert_that(
            out["rejected"] | beam.Map(checked),
            equal_to([(name, line, kind, True) for name, line, kind, _ in rejected]),
            label="Rejected",
        )
        assert_that(out["docs_read"], equal_to([docs_read]), label="DocsRead")


def run_unless_blocked_on(fifo: str, run, seconds: float = 300):
    """Runs ``run`` in a thread. A reader that opened ``fifo`` waits for a writer forever; a writer's
    non-blocking open succeeds only while a reader has it open, so that is looked for until the job ends (at
    most ``seconds``): when found, the writer closes at once, which lets the reader see an empty file and the
    job end, and the test fails. A job that is merely slow on a loaded machine is never mistaken for blocked."""
    errors = []

    def target():
        try:
            run()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline, blocked = time.monotonic() + seconds, False
    while thread.is_alive() and time.monotonic() < deadline and not blocked:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            blocked = True
        except OSError as e:  # ENXIO: no reader has it open (yet, or ever)
            assert e.errno == errno.ENXIO, e
            thread.join(0.1)
    thread.join(seconds)
    assert not blocked, f"the job opened the FIFO {fifo} and waited for a writer"
    assert not thread.is_alive(), f"the job did not end within {seconds} s"
    if errors:
        raise errors[0]


# Files that must not be opened


def test_a_fifo_matched_by_a_glob_becomes_a_record_and_the_job_ends(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl("a1"))
    fifo = str(tmp_path / "pipe.jsonl")
    os.mkfifo(fifo)
    config = InputConfig(path=f"{tmp_path}/*.jsonl")

    run_unless_blocked_on(
        fifo,
        lambda: read_and_check(
            config, ids=["a1"], rejected=[("pipe.jsonl", None, "not_regular_file", f"{fifo} is a FIFO")], docs_read=2
        ),
    )


def test_broken_symlinks_and_symlink_loops_matched_by_a_glob_become_records(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl("a1"))
    os.symlink(tmp_path / "deleted.jsonl", tmp_path / "gone.jsonl")
    os.symlink(tmp_path / "loop.jsonl", tmp_path / "loop.jsonl")
    os.symlink(tmp_path / "ping.jsonl", tmp_path / "pong.jsonl")
    os.symlink(tmp_path / "pong.jsonl", tmp_path / "ping.jsonl")

    read_and_check(
        InputConfig(path=f"{tmp_path}/*.jsonl"),
        ids=["a1"],
        rejected=[
            ("gone.jsonl", None, "broken_symlink", f"{tmp_path}/gone.jsonl is a symlink to"),
            ("loop.jsonl", None, "symlink_loop", f"{tmp_path}/loop.jsonl is a symlink"),
            ("ping.jsonl", None, "symlink_loop", f"{tmp_path}/ping.jsonl is a symlink"),
            ("pong.jsonl", None, "symlink_loop", f"{tmp_path}/pong.jsonl is a symlink"),
        ],
        docs_read=5,
    )


def test_a_symlink_to_a_regular_file_is_read_and_a_folder_matched_by_a_glob_is_skipped(tmp_path):
    (tmp_path / "real.data").write_bytes(jsonl("r1"))
    os.symlink(tmp_path / "real.data", tmp_path / "link.jsonl")
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "folder.jsonl" / "deeper.jsonl").write_bytes(jsonl("not matched by *"))
    os.symlink(tmp_path / "folder.jsonl", tmp_path / "linked_folder.jsonl")

    read_and_check(InputConfig(path=f"{tmp_path}/*.jsonl"), ids=["r1"], rejected=[], docs_read=1)


def test_special_files_are_named_for_what_they_are(tmp_path):
    fifo, sock, device = tmp_path / "f", tmp_path / "s", tmp_path / "d"
    os.mkfifo(fifo)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    os.symlink("/dev/null", device)
    (tmp_path / "regular").write_text("x")
    try:
        assert unopenable(str(fifo)) == (
            "not_regular_file",
            f"{fifo} is a FIFO (named pipe), not a regular file; it was not opened",
        )
        assert unopenable(str(sock))[1].startswith(f"{sock} is a socket")
        assert unopenable(str(device))[1].startswith(f"{device} is a character device")
        assert unopenable(str(tmp_path / "regular")) is None
        assert unopenable("gs://bucket/anything.jsonl") is None
    finally:
        server.close()


# Matching


def test_a_file_matched_by_overlapping_patterns_is_read_once(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl("a1", "a2"))
    (tmp_path / "b.jsonl").write_bytes(jsonl("b1"))
    config = InputConfig(path=f"{tmp_path}/*.jsonl, {tmp_path}/a.jsonl, {tmp_path}/./a.jsonl, {tmp_path}/[ab].jsonl")

    read_and_check(config, ids=["a1", "a2", "b1"], rejected=[], docs_read=3)


@pytest.mark.parametrize(
    "pattern",
    [
        "*",
        "*.jsonl",
        "**",
        "**.jsonl",
        "sub/*",
        "sub/**",
        "?.jsonl",
        "[ab].jsonl",
        "a.jsonl",
        "sub/",
        "s*/c.jsonl",
        "nothing*",
    ],
)
def test_local_matching_agrees_with_beams_on_regular_files(tmp_path, pattern):
    for name in ("a.jsonl", "b.txt", "sub/c.jsonl", "sub/deep/d.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    full = f"{tmp_path}/{pattern}"
    assert match_local(full) == sorted(m.path for m in FileSystems.match([full])[0].metadata_list)


# Damaged and marked files


def test_a_line_json_cannot_parse_costs_that_line_and_never_the_rest_of_its_file(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(
        jsonl("a1")
        + b'{"id": "big", "n": '
        + b"7" * 5000
        + b"}\n"
        + jsonl("a2")
        + b"[" * 200_000
        + b"]" * 200_000
        + b"\n"
        + jsonl("a3")
    )

    read_and_check(
        InputConfig(path=str(tmp_path / "a.jsonl")),
        ids=["a1", "a2", "a3"],
        rejected=[("a.jsonl", 2, "malformed_json", "not parsed"), ("a.jsonl", 4, "malformed_json", "not parsed")],
        docs_read=5,
    )


def test_lone_surrogates_in_ids_and_texts_are_rejected_as_invalid_text(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(
        jsonl("a1") + b'{"id": "s", "text": "x \\ud800 y"}\n' + b'{"id": "\\udfff", "text": "fine"}\n' + jsonl("a2")
    )

    with TestPipeline() as p:
        out = p | ReadDocuments(InputConfig(path=str(tmp_path / "a.jsonl")))
        assert_that(out["documents"] | beam.Map(lambda d: d.id), equal_to(["a1", "a2"]), label="DocumentIds")
        assert_that(
            out["rejected"] | beam.Map(lambda r: (r.line, r.id, r.kind)),
            equal_to([(2, "s", "invalid_text"), (3, None, "invalid_text")]),
            label="Rejected",
        )


def test_a_file_name_that_is_not_utf8_is_one_bad_path_record_and_the_other_files_are_read(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl("a1"))
    with open(os.fsencode(tmp_path) + b"/caf\xe9.jsonl", "wb") as f:  # Latin-1, as an old system names it
        f.write(jsonl("lost"))

    read_and_check(
        InputConfig(path=f"{tmp_path}/*.jsonl"),
        ids=["a1"],
        rejected=[("caf\\xe9.jsonl", None, "bad_path", f"the file name {tmp_path}/caf\\xe9.jsonl is not UTF-8")],
        docs_read=2,
    )


def test_a_utf8_bom_at_the_start_of_a_file_is_skipped(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + jsonl("a1", "a2"))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(bom + jsonl("b1")))
    (tmp_path / "c.txt").write_bytes(bom + "héllo".encode())
    (tmp_path / "d.jsonl.bz2").write_bytes(bz2.compress(bom + jsonl("d1")))
    (tmp_path / "e_empty.jsonl").write_bytes(bom)  # what an editor saves for an empty file

    with TestPipeline() as p:
        out = p | ReadDocuments(InputConfig(path=f"{tmp_path}/*"))
        assert_that(
            out["documents"] | beam.Map(lambda d: (d.id, d.text)),
            equal_to(
                [
                    ("a1", "text of a1"),
                    ("a2", "text of a2"),
                    ("b1", "text of b1"),
                    (str(tmp_path / "c.txt"), "héllo"),
                    ("d1", "text of d1"),
                ]
            ),
        )
        assert_that(out["rejected"], equal_to([]), label="NoneRejected")


# Transient errors on gs://


class _ResetMidway(io.RawIOBase):
    """A response body that breaks like a dropped connection halfway through."""

    def __init__(self, data: bytes):
        self._data, self._pos = data, 0

    def readable(self):
        return True

    def readinto(self, buffer):
        if self._pos >= len(self._data) // 2:
            raise ConnectionResetError(104, "Connection reset by peer")
        n = min(len(buffer), len(self._data) // 2 - self._pos)
        buffer[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


class _FlakyGcs(requests.Session):
    """Serves one object over GCS's JSON API; media requests fail as ``failures`` says (503, "reset"), in order."""

    is_mtls = False

    def __init__(self, data: bytes, failures: list):
        super().__init__()
        self.data, self.failures, self.served = data, list(failures), []

    def request(self, method, url, headers=None, **kwargs):
        response = requests.Response()
        response.url, response.request = url, requests.Request(method, url).prepare()
        if "alt=media" not in url:  # the metadata Beam's reader loads first
            response.status_code, response._content = (
                200,
                json.dumps(
                    {"name": "docs.jsonl.gz", "bucket": "b", "size": str(len(self.data)), "generation": "1"}
                ).encode(),
            )
            return response
        start = int(re.match(r"bytes=(\d+)-", headers["range"]).group(1))
        if start >= len(self.data):  # how GCS answers a read at the end
            response.status_code, response._content = 416, b""
            return response
        body, failure = self.data[start:], self.failures.pop(0) if self.failures else None
        self.served.append((start, failure))
        response.status_code = 503 if failure == 503 else 206
        response.headers["content-range"] = f"bytes {start}-{len(self.data) - 1}/{len(self.data)}"
        stream = io.BufferedReader(_ResetMidway(body)) if failure == "reset" else io.BytesIO(body)
        response.raw = urllib3.HTTPResponse(body=stream, status=response.status_code, preload_content=False)
        return response


def test_gs_reads_are_retried_by_beams_gcs_reader_resuming_where_they_broke():
    """Why pipeline/stages/read.py has no retry of its own: the reader FileSystems.open gives for gs:// retries a 503
    and resumes a body cut mid-stream, so every record arrives once."""
    from apache_beam.io.gcp.gcsio import GcsIO
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from docbeam.pipeline.stages.parse import file_records

    ids = [f"g{i}" for i in range(20_000)]
    data = gzip.compress(jsonl(*ids))
    server = _FlakyGcs(data, failures=[503, "reset"])
    client = storage.Client(project="p", credentials=AnonymousCredentials(), _http=server)
    open_raw = lambda: GcsIO(storage_client=client).open("gs://b/docs.jsonl.gz")  # noqa: E731

    records = list(file_records(open_raw, "gs://b/docs.jsonl.gz", InputConfig(path="gs://b/*")))
    assert [r.id for r in records] == ids
    assert [failure for _, failure in server.served] == [503, "reset", None]
    assert 0 < server.served[-1][0] <= len(data) // 2  # resumed where the body broke, not from the start

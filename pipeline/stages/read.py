"""ReadDocuments: files (local or gs://, globs) → Documents, and Rejected records for bad input.

Nothing is dropped silently: each matched path is read once, and every JSONL line, every text file and every
path that is not a readable file becomes exactly one Document or one Rejected, so
``docs_read == docs_embedded + docs_rejected`` holds by construction downstream.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Iterable, Iterator

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes, FileSystem
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from docbeam.config import InputConfig
from docbeam.pipeline.records import REJECTED_TAG, Document, Rejected, writable
from docbeam.pipeline.stages import keep
from docbeam.pipeline.stages.keep import EveryField, KeptFields
from docbeam.pipeline.stages.parse import file_records
from docbeam.pipeline.store import storage
from docbeam.pipeline.telemetry.observe import METRICS_NAMESPACE, StageClock


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
    return sorted(
        path
        for folder, _, names in os.walk(os.path.dirname(prefix))
        for path in (os.path.join(folder, name) for name in names)
        if is_match(path)
    )


def match_paths(pattern: str) -> list[str]:
    """Every path ``pattern`` matches, each to become records (none is opened here)."""
    if not storage.is_remote(pattern):
        paths = match_local(pattern)
    else:  # object stores: every object is a regular file; "folder/" placeholders are not inputs
        paths = [m.path for m in FileSystems.match([pattern])[0].metadata_list if not m.path.endswith("/")]
    if not paths:
        raise FileNotFoundError(f"input.path pattern {pattern!r} matches no file")
    return paths


def same_file_key(path: str) -> str:
    """One key per file however a pattern spelled it (``in/a.jsonl``, ``./in/a.jsonl``), so it is read once."""
    return path if storage.is_remote(path) else os.path.abspath(path)


def named_path(path: str) -> tuple[str, str]:
    """(name, "") for a path every stage can carry; (its name with ``\\x`` escapes, why it is not read) for a
    local file name that is not UTF-8. The OS hands such a name over with surrogate escapes, which no Beam
    coder encodes: one such file would otherwise fail the whole job."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        return shown, (
            f"the file name {shown} is not UTF-8 (shown with \\x escapes), so its documents could not be "
            "named in the output; it was not read. Rename it in UTF-8 and the next run reads it"
        )
    return path, ""


_SPECIAL_FILES = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def unopenable(path: str) -> tuple[str, str] | None:
    """(kind, reason) for a local path that must not be opened (a FIFO would block the reader forever, a device
    never ends); None for a regular file or any gs:// object."""
    if storage.is_remote(path):
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


def path_records(
    path: str, config: InputConfig, keep: KeptFields | EveryField | None = None
) -> Iterator[Document | Rejected]:
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
    yield from file_records(
        lambda: FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED), path, config, keep
    )


class _ParseFile(beam.DoFn):
    def __init__(self, config: InputConfig, keep: KeptFields | None):
        self._config, self._keep = config, keep
        self._read = Metrics.counter(METRICS_NAMESPACE, "docs_read")
        self._clock = StageClock("read")

    def process(self, named: tuple[str, str]):
        path, bad_name = named
        if bad_name:
            self._read.inc()
            yield beam.pvalue.TaggedOutput(REJECTED_TAG, Rejected(path, None, None, "bad_path", bad_name))
            return
        try:
            for record in self._clock.timed(path_records(path, self._config, self._keep)):
                self._read.inc()
                yield record if isinstance(record, Document) else beam.pvalue.TaggedOutput(REJECTED_TAG, record)
        except Exception as e:  # an unreadable or corrupt file is one rejection, not a crashed job
            self._read.inc()
            yield beam.pvalue.TaggedOutput(
                REJECTED_TAG,
                Rejected(
                    path,
                    None,
                    None,
                    "unreadable_file",
                    writable(f"{type(e).__name__}: {e} (records before the failure were kept)"),
                ),
            )


def keep_first_of_duplicates(item) -> Iterator:
    """Of documents sharing an id, the first by (source, line) is kept; the rest are rejected."""
    doc_id, docs = item
    ordered = sorted(docs, key=lambda d: (d.source, d.line or 0))
    yield ordered[0]
    for dup in ordered[1:]:
        yield beam.pvalue.TaggedOutput(
            REJECTED_TAG,
            Rejected(
                dup.source,
                dup.line,
                doc_id,
                "duplicate_id",
                f"id {doc_id!r} already used at {ordered[0].source}:{ordered[0].line}",
            ),
        )


class ReadDocuments(beam.PTransform):
    """Outputs ``documents`` (unique ids, with the fields ``keep`` keeps), ``rejected`` and ``docs_read`` (one
    count)."""

    def __init__(self, config: InputConfig, keep: KeptFields | None = None):
        super().__init__()
        self._config, self._keep = config, keep

    def expand(self, pbegin):
        parsed = (
            pbegin
            | "Patterns" >> beam.Create(self._config.patterns)
            | "Match" >> beam.FlatMap(lambda pattern: [named_path(path) for path in match_paths(pattern)])
            | "KeyByFile" >> beam.Map(lambda named: ((same_file_key(named[0]), named[1]), named))
            | "ReadEachFileOnce" >> beam.CombinePerKey(min)  # overlapping patterns; also spreads files over workers
            | "Paths" >> beam.Values()
            | "Parse" >> beam.ParDo(_ParseFile(self._config, self._keep)).with_outputs(REJECTED_TAG, main="documents")
        )
        unique = (
            parsed.documents
            | "KeyById" >> beam.Map(lambda d: (d.id, d))
            | "GroupById" >> beam.GroupByKey()
            | "DropDuplicates" >> beam.FlatMap(keep_first_of_duplicates).with_outputs(REJECTED_TAG, main="documents")
        )
        rejected = (parsed[REJECTED_TAG], unique[REJECTED_TAG]) | "AllRejected" >> beam.Flatten()
        # Counted before de-duplication, independently of what later stages emit: the check on them.
        docs_read = (
            (parsed.documents, parsed[REJECTED_TAG])
            | "AllParsed" >> beam.Flatten()
            | "CountRead" >> beam.combiners.Count.Globally()
        )
        return {"documents": unique.documents, "rejected": rejected, "docs_read": docs_read}


def sample_records(config: InputConfig, paths: Iterable[str]) -> list[dict]:
    """The fields (id and text aside) of the first keep.SAMPLE_RECORDS documents, read as the job reads them."""
    every = EveryField(config.id_field, config.text_field)
    sample = []
    for path in paths:
        for record in path_records(path, config, every):
            if isinstance(record, Document):
                sample.append(dict(record.kept))
                if len(sample) == keep.SAMPLE_RECORDS:
                    return sample
    return sample

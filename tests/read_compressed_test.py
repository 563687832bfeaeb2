"""pipeline/stages/decompress.py: every compression Beam knows is read whole, and a file cut short keeps the lines before the cut and becomes one truncated record."""

from __future__ import annotations

import bz2
import gzip
import lzma
import random
import zlib

import zstandard
from read_inputs_test import jsonl, read_and_check

from docbeam.config import InputConfig


def test_a_truncated_gzip_keeps_every_complete_line_before_the_damage_and_reports_it_once(tmp_path):
    # Incompressible 50 kB lines span many deflate blocks, so the cut falls well inside the file.
    rng = random.Random(0)
    data = b"".join(b'{"id": "t%d", "text": "%s"}\n' % (i, rng.randbytes(25_000).hex().encode()) for i in range(10))
    cut = gzip.compress(data)[: len(gzip.compress(data)) * 6 // 10]
    (tmp_path / "cut.jsonl.gz").write_bytes(cut)
    complete = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(cut).count(b"\n")  # lines fully before the cut
    assert 3 <= complete < 10

    read_and_check(
        InputConfig(path=str(tmp_path / "cut.jsonl.gz")),
        ids=[f"t{i}" for i in range(complete)],
        rejected=[
            ("cut.jsonl.gz", None, "truncated_file", f"breaks after line {complete}; the records before it were kept")
        ],
        docs_read=complete + 1,
    )


def test_a_truncated_gzip_text_file_is_one_truncated_record(tmp_path):
    data = gzip.compress(random.Random(0).randbytes(200_000).hex().encode())
    (tmp_path / "cut.txt.gz").write_bytes(data[: len(data) // 2])

    read_and_check(
        InputConfig(path=str(tmp_path / "cut.txt.gz")),
        ids=[],
        rejected=[("cut.txt.gz", None, "truncated_file", "the text is incomplete and was not kept")],
        docs_read=1,
    )


# Every compression Beam reads (apache_beam.io.filesystem.CompressionTypes): suffix → (compress, a decompressor
# that hands over what a cut file holds, to count the lines complete before the cut).
COMPRESSIONS = {
    ".gz": (gzip.compress, lambda: zlib.decompressobj(16 + zlib.MAX_WBITS)),
    ".bz2": (bz2.compress, bz2.BZ2Decompressor),
    ".deflate": (zlib.compress, zlib.decompressobj),
    ".zst": (
        lambda data: zstandard.ZstdCompressor().compress(data),
        lambda: zstandard.ZstdDecompressor().decompressobj(),
    ),
    ".xz": (lzma.compress, lzma.LZMADecompressor),
    ".lzma": (lambda data: lzma.compress(data, format=lzma.FORMAT_ALONE), lzma.LZMADecompressor),
}


def test_every_compression_beam_knows_is_covered():
    from apache_beam.io.filesystem import CompressionTypes

    known = {
        CompressionTypes.detect_compression_type(f"a{suffix}")
        for suffix in (".bz2", ".deflate", ".gz", ".zst", ".zstd", ".xz", ".lzma")
    }
    assert known == {CompressionTypes.detect_compression_type(f"a{suffix}") for suffix in COMPRESSIONS}


def test_a_truncated_file_in_every_compression_keeps_the_lines_before_the_cut_and_is_one_record(tmp_path):
    rng = random.Random(0)
    ids, rejected = [], []
    for n, (suffix, (compress, partial)) in enumerate(COMPRESSIONS.items()):
        # Incompressible 8 kB lines: the cut at 60 % falls inside the data (for bz2, inside its first block).
        stored = compress(
            b"".join(
                b'{"id": "%d-t%d", "text": "%s"}\n' % (n, i, rng.randbytes(4_000).hex().encode()) for i in range(25)
            )
        )
        cut = stored[: len(stored) * 6 // 10]
        (tmp_path / f"cut.jsonl{suffix}").write_bytes(cut)
        complete = partial().decompress(cut).count(b"\n")
        assert complete < 25
        ids += [f"{n}-t{i}" for i in range(complete)]
        rejected.append(
            (
                f"cut.jsonl{suffix}",
                None,
                "truncated_file",
                f"breaks after line {complete}; the records before it were kept",
            )
        )

    read_and_check(
        InputConfig(path=f"{tmp_path}/*"), ids=ids, rejected=rejected, docs_read=len(ids) + len(COMPRESSIONS)
    )


def test_whole_files_and_streams_one_after_another_are_read_whole_in_every_compression(tmp_path):
    ids = []
    for suffix, (compress, _) in COMPRESSIONS.items():
        name = suffix[1:]
        (tmp_path / f"one.jsonl{suffix}").write_bytes(compress(jsonl(f"{name}1", f"{name}2")))
        (tmp_path / f"two.jsonl{suffix}").write_bytes(compress(jsonl(f"{name}3")) + compress(jsonl(f"{name}4")))
        (tmp_path / f"empty.jsonl{suffix}").write_bytes(b"")  # as gzip reads an empty file: no lines, no damage
        (tmp_path / f"whole.txt{suffix}").write_bytes(compress("héllo".encode()))
        ids += [f"{name}1", f"{name}2", f"{name}3", f"{name}4", f"{tmp_path}/whole.txt{suffix}"]

    read_and_check(InputConfig(path=f"{tmp_path}/*"), ids=ids, rejected=[], docs_read=len(ids))


# Lines and names that must cost one record

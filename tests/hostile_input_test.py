"""A daily run over a corpus with one record of every hostile kind: each costs itself, never its file or the day.

Through docbeam's command line (``cli.main``, what ``python -m docbeam run`` calls) on the tiny
checkpoint, as a scheduler runs it; in this process, since a subprocess's import of Beam and JAX was a
quarter of the test's time and the exit code, the files and summary.json are the same either way.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import json
import os
import random
import zlib

import pyarrow.parquet as pq
import pytest
from cli_test import LOCAL

from docbeam.pipeline.driver import cli


def line(doc_id: str, text: str) -> bytes:
    return json.dumps({"id": doc_id, "text": text}).encode() + b"\n"


def complete_lines_before_the_cut(stored: bytes, decompressor) -> list[str]:
    """The ids on the lines a reader can decompress whole from a cut file."""
    return [json.loads(raw)["id"] for raw in decompressor.decompress(stored).split(b"\n")[:-1]]


def hostile_corpus(folder) -> tuple[set[str], dict[str, int]]:
    """Writes the corpus; returns the ids that must be embedded and the rejections expected, by kind."""
    (folder / "a.jsonl").write_bytes(
        line("a1", "before the huge integer")
        + b'{"id": "huge", "text": "t", "n": '
        + b"9" * 5000
        + b"}\n"  # ValueError in int(), not a decode error
        + line("a2", "between the hostile lines")
        + b"[" * 200_000
        + b"]" * 200_000
        + b"\n"  # RecursionError
        + line("a3", "after the deep nesting")
        + b'{"id": "sur-text", "text": "half a pair \\ud83d"}\n'  # a lone surrogate in the text
        + b'{"id": "\\udc80", "text": "a lone surrogate in the id"}\n'
        + line("a4", "the last line of a")
    )
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(b"".join(line(f"b{i}", f"text of b{i}") for i in range(1, 5))))
    with open(os.fsencode(folder) + b"/caf\xe9.jsonl", "wb") as f:  # a Latin-1 file name
        f.write(line("latin1", "never read: its name is not UTF-8"))
    good = {"a1", "a2", "a3", "a4", "b1", "b2", "b3", "b4"}
    rng = random.Random(0)  # incompressible text, so the cut falls inside the data
    for suffix, compress, decompressor in (
        (".bz2", bz2.compress, bz2.BZ2Decompressor()),
        (".gz", gzip.compress, zlib.decompressobj(16 + zlib.MAX_WBITS)),
    ):
        stored = compress(b"".join(line(f"cut{suffix}-{i}", rng.randbytes(3000).hex()) for i in range(20)))
        cut = stored[: len(stored) // 2]
        (folder / f"cut.jsonl{suffix}").write_bytes(cut)
        good |= set(complete_lines_before_the_cut(cut, decompressor))
    return good, {"malformed_json": 2, "invalid_text": 2, "bad_path": 1, "truncated_file": 2}


def embedded_ids(output) -> set[str]:
    return set(pq.read_table(sorted(glob.glob(f"{output}/embeddings/*.parquet")), columns=["id"])["id"].to_pylist())


@pytest.mark.slow
def test_a_daily_run_with_every_hostile_kind_embeds_the_rest_exits_0_and_counts_each(
    tmp_path, tiny_checkpoint_dir, capsys
):
    corpus = tmp_path / "in"
    corpus.mkdir()
    good, rejected = hostile_corpus(corpus)
    common = [
        "--config",
        LOCAL,
        "--set",
        f"input.path={corpus}/*",
        "--set",
        f"model.path={tiny_checkpoint_dir}",
        "--set",
        "input.max_rejected_fraction=0.5",
    ]
    first = tmp_path / "day1"
    assert cli.main(["run", *common, "--set", f"output.path={first}"]) == 0, capsys.readouterr().err

    summary = json.loads((first / "summary.json").read_text())
    assert embedded_ids(first) == good
    assert summary["rejected_by_kind"] == rejected
    assert summary["docs_read"] == summary["docs_embedded"] + summary["docs_rejected"]

    # The next day reuses the first: the lines after a hostile one are still there, carried over.
    second = tmp_path / "day2"
    assert cli.main(["run", *common, "--set", f"output.path={second}", "--set", f"input.reuse_from={first}"]) == 0, (
        capsys.readouterr().err
    )
    assert embedded_ids(second) == embedded_ids(first)
    assert json.loads((second / "summary.json").read_text())["docs_reused"] == len(embedded_ids(first))

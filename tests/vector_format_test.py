"""The ``embedding`` column people load: a fixed_size_list whose dimension and dtype the manifest states, readable
from the manifest's file list by pyarrow, pandas and DuckDB; ``output.vector_dtype`` quantized exactly as
sentence-transformers' ``quantize_embeddings`` does, with the run-wide calibration recorded; reuse never mixes
dtypes or scales."""

from __future__ import annotations

import gzip
import json

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from conftest import SAMPLE, job_config

from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.stages import vectors
from docbeam.pipeline.stages.reuse import KEY_FIELDS, key_differences
from docbeam.pipeline.store.output import upgrade_manifest

DIM = 32  # the tiny checkpoint's hidden size


def st_quantize(vectors_NxD, precision, ranges=None):
    from sentence_transformers.util.quantization import quantize_embeddings

    if precision == "float16":  # quantize_embeddings has no float16: the reference is numpy's cast
        return np.asarray(vectors_NxD, np.float32).astype(np.float16)
    return quantize_embeddings(np.asarray(vectors_NxD, np.float32), precision=precision, ranges=ranges)


def embedding_files(output: str) -> list[str]:
    """What docs/outputs.md tells a reader to do: the manifest lists the run's files."""
    with open(f"{output}/_manifest.json") as f:
        manifest = json.load(f)
    return [f"{output}/{f['path']}" for f in manifest["files"] if f["path"].startswith("embeddings/")]


def manifest(output: str) -> dict:
    with open(f"{output}/_manifest.json") as f:
        return json.load(f)


def by_id(output: str) -> dict[str, np.ndarray]:
    table = pq.read_table(embedding_files(output))
    return {i: np.asarray(v) for i, v in zip(table["id"].to_pylist(), table["embedding"].to_pylist())}


def test_the_column_type_is_a_fixed_size_list_of_the_dtype():
    assert vectors.embedding_type(384) == pa.list_(pa.float32(), 384)
    assert vectors.embedding_type(384, "float16") == pa.list_(pa.float16(), 384)
    assert vectors.embedding_type(384, "uint8") == pa.list_(pa.uint8(), 384)
    assert vectors.embedding_type(36, "binary") == pa.list_(pa.int8(), 5)  # 36 signs, zero-padded to 40 bits
    with pytest.raises(ValueError, match=r"output.vector_dtype: 'int4' is not one of float32, float16, int8"):
        vectors.embedding_type(384, "int4")


@pytest.mark.parametrize("precision", ["float16", "int8", "uint8", "binary"])
def test_quantize_equals_sentence_transformers(precision):
    rng = np.random.default_rng(0)
    calibration_NxD = rng.normal(size=(200, 36)).astype(np.float32)
    vectors_NxD = rng.normal(size=(50, 36)).astype(np.float32) * 1.5  # some fall outside the ranges: clipped
    ranges = np.vstack([calibration_NxD.min(0), calibration_NxD.max(0)])
    ranges[:, 3] = 0.25  # a constant dimension (step 0)
    ours = vectors.quantize(vectors_NxD, precision, ranges)
    reference = st_quantize(vectors_NxD, precision, ranges)
    assert ours.dtype == reference.dtype and np.array_equal(ours, reference)


def test_the_calibration_is_the_min_and_max_over_every_bundle():
    rng = np.random.default_rng(1)
    rows_NxD = rng.normal(size=(40, 4)).astype(np.float32)
    expected = {"ranges": [rows_NxD.min(0).tolist(), rows_NxD.max(0).tolist()], "vectors": 40, "run_id": "r"}
    with TestPipeline() as p:
        got = p | beam.Create([list(r) for r in rows_NxD], reshuffle=True) | beam.CombineGlobally(vectors.RangesFn("r"))
        assert_that(got, equal_to([expected]))


def test_a_vector_beyond_float16s_range_is_rejected_not_written_as_inf():
    row = {"id": "big", "embedding": [1.0, 70000.0], "num_tokens": 3}
    with TestPipeline() as p:
        out = (
            p
            | beam.Create([{"id": "ok", "embedding": [0.5, -2.0], "num_tokens": 3}, row])
            | vectors.QuantizeVectors("float16", "r")
        )
        assert_that(out["rows"], equal_to([{"id": "ok", "embedding": [0.5, -2.0], "num_tokens": 3}]), label="rows")
        assert_that(
            out["rejected"] | beam.Map(lambda r: (r.id, r.kind)), equal_to([("big", "non_finite")]), label="rejected"
        )
    assert "float16's range (largest magnitude 70000)" in vectors.quantize_row(row, "float16").reason


def test_a_run_before_vector_dtype_existed_counts_as_float32():
    key = {name: None for name in KEY_FIELDS if name != "vector_dtype"}
    old = upgrade_manifest({"run_id": "r", "reuse_key": key}, "old/_manifest.json")["reuse_key"]
    assert key_differences(old, {**old, "vector_dtype": "float32"}) == []
    assert key_differences(old, {**old, "vector_dtype": "int8"}) == ["vector_dtype: 'float32' then, 'int8' now"]


def write_corpus(path, docs: list[dict]) -> str:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A: 30 sample documents; B: A's first 20 unchanged and 5 new."""
    folder = tmp_path_factory.mktemp("vector-corpora")
    with gzip.open(SAMPLE, "rt") as f:
        sample = [json.loads(line) for _, line in zip(range(35), f)]
    return write_corpus(folder / "a.jsonl", sample[:30]), write_corpus(folder / "b.jsonl", sample[:20] + sample[30:])


@pytest.fixture(scope="module")
def runs(corpora, tiny_checkpoint_dir, tmp_path_factory):
    """Corpus A in every dtype, same model and batches: the float32 run is the others' reference."""
    root = tmp_path_factory.mktemp("vector-runs")
    for dtype in vectors.VECTOR_DTYPES:
        run_job(job_config(corpora[0], str(root / dtype), tiny_checkpoint_dir, output={"vector_dtype": dtype}))
    return root


@pytest.mark.slow
def test_pyarrow_pandas_and_duckdb_read_the_fixed_size_lists_from_the_manifest(runs):
    import duckdb
    import pandas as pd

    output = str(runs / "float32")
    block = manifest(output)["embedding"]
    assert block == {"dim": DIM, "dtype": "float32", "list_size": DIM, "value_type": "float"}
    files = embedding_files(output)
    table = pq.read_table(files)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), DIM)
    assert pq.ParquetFile(files[0]).schema.column(1).path == "embedding.list.element"  # the standard LIST layout
    matrix = table["embedding"].combine_chunks().flatten().to_numpy().reshape(len(table), block["list_size"])
    assert matrix.shape == (30, DIM) and matrix.dtype == np.float32
    frame = pd.concat([pd.read_parquet(f) for f in files])
    assert len(frame) == 30 and np.stack(frame["embedding"]).shape == (30, DIM)
    rows = duckdb.sql(f"SELECT id, embedding::FLOAT[{block['dim']}] AS e FROM read_parquet({files!r})").fetchall()
    assert len(rows) == 30 and {len(e) for _, e in rows} == {DIM}
    expected = by_id(output)
    assert all(np.array_equal(np.asarray(e, np.float32), expected[i]) for i, e in rows)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "int8", "uint8", "binary"])
def test_each_dtype_equals_quantize_embeddings_of_the_float32_run(runs, dtype):
    reference = by_id(str(runs / "float32"))
    ids = sorted(reference)
    float32_NxD = np.stack([reference[i] for i in ids])
    output = str(runs / dtype)
    got = by_id(output)
    expected = st_quantize(float32_NxD, dtype)  # int8/uint8: ranges from these very vectors, as the run's are
    assert sorted(got) == ids
    assert np.array_equal(np.stack([got[i] for i in ids]), expected)
    block = manifest(output)["embedding"]
    assert pq.read_schema(embedding_files(output)[0]).field("embedding").type == vectors.embedding_type(DIM, dtype)
    assert (block["dim"], block["dtype"], block["list_size"]) == (DIM, dtype, expected.shape[1])
    if dtype == "binary":  # docs/outputs.md's unpacking gives the signs back
        matrix = np.stack([got[i] for i in ids])
        bits = np.unpackbits((matrix.astype(np.int16) + 128).astype(np.uint8), axis=-1)[:, :DIM]
        assert np.array_equal(bits, float32_NxD > 0)
    if dtype in vectors.CALIBRATED:
        calibration = block["calibration"]
        assert np.array_equal(
            np.asarray(calibration["ranges"], np.float32), np.vstack([float32_NxD.min(0), float32_NxD.max(0)])
        )
        assert calibration["vectors"] == 30 and calibration["run_id"] == manifest(output)["run_id"]
        assert json.load(open(f"{output}/summary.json"))["embedding"] == block
    else:
        assert "calibration" not in block


@pytest.mark.slow
def test_reuse_keeps_the_previous_calibration_and_never_mixes_dtypes(runs, corpora, tiny_checkpoint_dir, tmp_path):
    previous = str(runs / "int8")
    kept = manifest(previous)["embedding"]["calibration"]
    summary = run_job(
        job_config(
            corpora[1],
            str(tmp_path / "int8"),
            tiny_checkpoint_dir,
            input={"reuse_from": previous},
            output={"vector_dtype": "int8"},
        )
    )
    assert (summary["docs_reused"], summary["docs_encoded"]) == (20, 5)
    assert summary["embedding"]["calibration"] == kept  # one output, one scale: the previous run's
    got, before = by_id(str(tmp_path / "int8")), by_id(previous)
    new = sorted(set(got) - set(before))
    assert len(new) == 5 and all(np.array_equal(got[i], before[i]) for i in set(got) & set(before))
    # The same five documents encoded the same way (a float32 run reusing the float32 run of A): the reference.
    run_job(
        job_config(
            corpora[1], str(tmp_path / "float32"), tiny_checkpoint_dir, input={"reuse_from": str(runs / "float32")}
        )
    )
    new_NxD = np.stack([by_id(str(tmp_path / "float32"))[i] for i in new])
    assert np.array_equal(
        np.stack([got[i] for i in new]), st_quantize(new_NxD, "int8", np.asarray(kept["ranges"], np.float32))
    )
    other = run_job(
        job_config(
            corpora[1],
            str(tmp_path / "float16"),
            tiny_checkpoint_dir,
            input={"reuse_from": previous},
            output={"vector_dtype": "float16"},
        )
    )
    assert other["docs_reused"] == 0 and "vector_dtype: 'int8' then, 'float16' now" in other["reuse"]["reason"]
    assert pq.read_schema(embedding_files(str(tmp_path / "float16"))[0]).field("embedding").type == pa.list_(
        pa.float16(), DIM
    )


@pytest.mark.slow
def test_an_output_of_the_previous_format_is_still_reused(runs, corpora, tiny_checkpoint_dir, tmp_path):
    """Before fixed-size lists: ``embedding`` a variable list<float>, no ``embedding`` block in the manifest, no
    ``vector_dtype`` in its reuse key. Its rows carry over, and are written as the fixed-size list."""
    import shutil

    from docbeam.pipeline.store import storage

    old = tmp_path / "old"
    shutil.copytree(runs / "float32", old)
    record = manifest(str(old))
    for entry in record["files"]:
        if entry["path"].startswith("embeddings/"):
            path = f"{old}/{entry['path']}"
            table = pq.read_table(path)
            column = table["embedding"].cast(pa.list_(pa.float32()))
            pq.write_table(table.set_column(1, "embedding", column), path)
            entry.update(size=(old / entry["path"]).stat().st_size, checksum=storage.checksum(path))
    del record["embedding"], record["reuse_key"]["vector_dtype"], record["format_version"]  # version 1 had none
    (old / "_manifest.json").write_text(json.dumps(record))
    assert pq.read_schema(embedding_files(str(old))[0]).field("embedding").type == pa.list_(pa.float32())
    summary = run_job(
        job_config(corpora[1], str(tmp_path / "new"), tiny_checkpoint_dir, input={"reuse_from": str(old)})
    )
    assert (summary["docs_reused"], summary["docs_encoded"]) == (20, 5), summary["reuse"]
    got, before = by_id(str(tmp_path / "new")), by_id(str(old))
    assert all(np.array_equal(got[i], before[i]) for i in set(got) & set(before))
    assert pq.read_schema(embedding_files(str(tmp_path / "new"))[0]).field("embedding").type == pa.list_(
        pa.float32(), DIM
    )


@pytest.mark.parametrize(
    "ranges",
    [[[-1.0], [1.0]], [[1.0] * 4, [-1.0] * 4], [[float("nan")] * 4, [1.0] * 4], "x", [[0.0] * 4]],
    ids=["one-dim-for-four", "min-above-max", "nan", "not-a-list", "one-row"],
)
def test_a_garbled_calibration_of_an_earlier_run_is_never_used_to_quantize(ranges):
    """An earlier run's int8 calibration broadcast over every dimension, or a min above its max, would quantize every
    new vector silently wrong: the run is not reused, with the reason."""
    from docbeam.pipeline.stages.reuse import calibration_problem

    assert calibration_problem({"dim": 4, "calibration": {"ranges": ranges}})
    assert calibration_problem({"dim": 4, "calibration": {"ranges": [[-1.0] * 4, [1.0] * 4]}}) is None
    assert calibration_problem({"dim": 4}) is None  # float32 runs have none

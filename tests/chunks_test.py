"""output.granularity: chunk rows point back into their documents exactly, and carry the vectors pooling used.

The expected spans are computed here, independently of the pipeline's windowing: the whole document is tokenized
once with its offsets, and window k's own tokens are positions [k·(room − stride), … + room) of it."""

from __future__ import annotations

import glob
import gzip
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE, job_config
from pipeline_test import encode_alone, tokenizer_of, windows_by_hand

from docbeam.config import ConfigError, TokenizeConfig
from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.records import Document
from docbeam.pipeline.stages.reuse import decide
from docbeam.pipeline.stages.tokenize import prompt_token_ids, tokenize_documents

pytestmark = pytest.mark.slow

LONG = (
    "Grüße aus Köln! 😀🚀 Das ist ein Satz.\r\n東京は日本の首都です。 café naïve "
    "e\u0301le\u0300ve Zoë's résumé — 한국어 텍스트도 있어요.\r\n"
) * 12


def own_corpus(folder) -> dict[str, str]:
    """Multi-byte text (emoji, CJK, Hangul, combining marks), CRLF, a long document of several windows, and a
    text file with a BOM; returns each document's text as a plain UTF-8 reader sees its source."""
    docs = {
        "emoji": "Launch day 🚀🎉 — we shipped!\r\nThanks 🙏 to everyone.",
        "cjk": "自然言語処理は面白い。\r\n中文分词也很有意思。한국어도 좋아요.",
        "combining": "Cafe\u0301 de\u0301ja\u0300 vu; n\u0303 and a\u030a are combining marks.",
        "long": LONG,
    }
    with open(folder / "docs.jsonl", "w", encoding="utf-8") as f:
        for doc_id, text in docs.items():
            f.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
    bom_text = "Ein Text mit BOM 📄.\r\nZweite Zeile: ñandú, 東京.\r\n" * 6
    (folder / "bom.txt").write_bytes(b"\xef\xbb\xbf" + bom_text.encode("utf-8"))
    docs[str(folder / "bom.txt")] = "\ufeff" + bom_text
    return docs


def read_chunks(output: str) -> list[dict]:
    files = sorted(glob.glob(f"{output}/chunks/*.parquet"))
    return pq.read_table(files).to_pylist() if files else []


def read_embeddings(output: str) -> dict[str, dict]:
    return {r["id"]: r for r in pq.read_table(sorted(glob.glob(f"{output}/embeddings/*.parquet"))).to_pylist()}


def expected_spans(tokenizer, source: str, window_len: int, stride: int) -> list[tuple[int, int]]:
    """Each window's [start, end) in ``source`` from one tokenization of the whole text (a BOM is not text:
    the text after it is tokenized, and the offsets moved past it)."""
    skip = int(source.startswith("\ufeff"))
    encoded = tokenizer(source[skip:], add_special_tokens=False, return_offsets_mapping=True)
    offsets, room = encoded["offset_mapping"], window_len - 2
    spans, start = [], 0
    while True:
        end = min(start + room, len(offsets))
        spans.append((offsets[start][0] + skip, offsets[end - 1][1] + skip))
        if end == len(offsets):
            return spans
        start += room - stride


def by_document(chunks: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for row in sorted(chunks, key=lambda r: (r["document_id"], r["chunk_index"])):
        grouped.setdefault(row["document_id"], []).append(row)
    return grouped


def check_spans(chunks: list[dict], sources: dict[str, str], checkpoint_dir: str, window_len: int) -> None:
    """Every row's text is its source's [char_start, char_end), and the spans are the windows' own."""
    tokenizer = tokenizer_of(checkpoint_dir)
    for doc_id, rows in by_document(chunks).items():
        source = sources[doc_id]
        for row in rows:
            assert source[row["char_start"] : row["char_end"]] == row["chunk_text"], (doc_id, row["chunk_index"])
        spans = [(r["char_start"], r["char_end"]) for r in rows]
        assert spans == expected_spans(tokenizer, source, window_len, 32), doc_id


@pytest.mark.parametrize("prompt", [None, "passage: "])
def test_a_prompt_before_every_window_is_not_part_of_its_span(prompt, real_checkpoint_dir):
    tokenizer = tokenizer_of(real_checkpoint_dir)
    windows, _ = tokenize_documents(
        [Document("d", LONG, "docs.jsonl", 1)], tokenizer, window_len=32, config=TokenizeConfig(stride=8), prompt=prompt
    )
    prompt_tokens = len(prompt_token_ids(tokenizer, prompt))
    assert (prompt_tokens > 0) == bool(prompt) and len(windows) > 10
    spans = [(w.char_start, w.char_end) for w in windows]
    assert spans == expected_spans(tokenizer, LONG, 32 - prompt_tokens, 8)


@pytest.mark.parametrize("prompt", [None, "passage: "])
def test_a_span_ends_after_a_trailing_combining_accent_an_uncased_tokenizer_strips(prompt, real_checkpoint_dir):
    """MiniLM's uncased tokenizer strips accents: its last token of 'cafe\u0301' ends before the U+0301 the 'e'
    carries, so the chunk's text would end on a bare 'e'. The span takes the marks that follow its end."""
    tokenizer = tokenizer_of(real_checkpoint_dir)
    text = "a short note about the cafe\u0301\u0327"  # two combining marks at the very end
    (window,), _ = tokenize_documents(
        [Document("d", text, "docs.jsonl", 1)], tokenizer, window_len=32, config=TokenizeConfig(stride=8), prompt=prompt
    )
    assert (window.char_start, window.char_end) == (0, len(text))
    inner = "cafe\u0301 and tea"  # a mark inside the text is already inside the span: nothing moves
    (window,), _ = tokenize_documents(
        [Document("d", inner, "x", 1)], tokenizer, window_len=32, config=TokenizeConfig(stride=8)
    )
    assert (window.char_start, window.char_end) == (0, len(inner))


@pytest.fixture(scope="module")
def own_runs(tmp_path_factory, tiny_checkpoint_dir):
    """The own corpus written three ways: both (raw window vectors), chunk (normalised, offsets only), document."""
    folder = tmp_path_factory.mktemp("chunk-corpus")
    sources = own_corpus(folder)
    root = tmp_path_factory.mktemp("chunk-runs")
    runs = {}
    for name, output, model in (
        ("both", {"granularity": "both"}, {"normalize": False}),
        ("chunk", {"granularity": "chunk", "chunk_text": False}, {"normalize": True}),
        ("document", {}, {"normalize": False}),
        ("int8", {"granularity": "both", "vector_dtype": "int8"}, {"normalize": False}),
    ):
        runs[name] = (
            str(root / name),
            run_job(job_config(f"{folder}/*", str(root / name), tiny_checkpoint_dir, output=output, model=model)),
        )
    return sources, runs, str(folder)


def test_chunk_text_is_the_original_text_between_its_offsets(own_runs, tiny_checkpoint_dir):
    sources, runs, _ = own_runs
    output, summary = runs["both"]
    chunks = read_chunks(output)
    assert summary["docs_embedded"] == len(sources) == len(by_document(chunks))
    assert len(by_document(chunks)["long"]) >= 3, "the long document makes several windows"
    bom = next(rows for doc_id, rows in by_document(chunks).items() if doc_id.endswith("bom.txt"))
    assert bom[0]["char_start"] == 1, "offsets count a text file's BOM"
    assert any("\r\n" in r["chunk_text"] for r in chunks) and any("🚀" in r["chunk_text"] for r in chunks)
    check_spans(chunks, sources, tiny_checkpoint_dir, summary["window_len"])


def test_chunk_vectors_are_the_window_vectors_the_document_pooled(own_runs):
    _, runs, _ = own_runs
    output, _ = runs["both"]
    documents = read_embeddings(output)
    for doc_id, rows in by_document(read_chunks(output)).items():
        vectors = np.array([r["embedding"] for r in rows], np.float32).astype(np.float64)
        weights = np.array([r["num_tokens"] for r in rows], np.float64)
        pooled = ((vectors * weights[:, None]).sum(0) / weights.sum()).astype(np.float32)
        assert len(rows) == documents[doc_id]["num_windows"]
        np.testing.assert_array_equal(pooled, np.asarray(documents[doc_id]["embedding"], np.float32), err_msg=doc_id)


def test_normalised_chunk_vectors_are_unit_length_windows_and_offsets_only_rows_keep_the_spans(own_runs):
    _, runs, _ = own_runs
    raw = {(r["document_id"], r["chunk_index"]): r for r in read_chunks(runs["both"][0])}
    rows = read_chunks(runs["chunk"][0])
    assert "chunk_text" not in rows[0] and len(rows) == len(raw)
    for row in rows:
        mine = raw[(row["document_id"], row["chunk_index"])]
        assert (row["char_start"], row["char_end"]) == (mine["char_start"], mine["char_end"])
        expected = np.asarray(mine["embedding"], np.float64)
        np.testing.assert_allclose(row["embedding"], expected / np.linalg.norm(expected), rtol=0, atol=1e-6)


def test_int8_chunk_rows_are_quantized_with_the_documents_calibration(own_runs):
    """One scale per output: the chunk rows of an int8 run are quantize_embeddings of the float run's chunk vectors
    with the ranges the manifest records (the documents'), clipped where a chunk lies outside them."""
    from docbeam.pipeline.stages.vectors import quantize

    _, runs, _ = own_runs
    (plain, _), (int8, _) = runs["both"], runs["int8"]
    ranges = np.asarray(json.load(open(f"{int8}/_manifest.json"))["embedding"]["calibration"]["ranges"], np.float32)
    key = lambda r: (r["document_id"], r["chunk_index"])  # noqa: E731
    floats, quantized = sorted(read_chunks(plain), key=key), sorted(read_chunks(int8), key=key)
    assert [key(r) for r in floats] == [key(r) for r in quantized]
    expected = quantize(np.asarray([r["embedding"] for r in floats], np.float32), "int8", ranges)
    np.testing.assert_array_equal(np.asarray([r["embedding"] for r in quantized]), expected)
    assert expected.dtype == np.int8 and len(np.unique(expected)) > 50


def test_each_granularity_writes_its_own_folders_all_in_the_manifest(own_runs):
    _, runs, _ = own_runs
    for name, folders in (("both", {"chunks", "embeddings"}), ("chunk", {"chunks"}), ("document", {"embeddings"})):
        output, summary = runs[name]
        listed = {f["path"].split("/")[0] for f in json.load(open(f"{output}/_manifest.json"))["files"]}
        assert listed & {"chunks", "embeddings"} == folders, name
        assert {d for d in ("chunks", "embeddings") if os.path.isdir(f"{output}/{d}")} == folders, name
        assert summary["granularity"] == name
    assert read_embeddings(runs["both"][0]) == read_embeddings(runs["document"][0])


def test_an_incremental_run_that_writes_chunks_is_refused_with_the_reason(own_runs, tiny_checkpoint_dir, tmp_path):
    _, runs, folder = own_runs
    cfg = job_config(
        f"{folder}/*",
        str(tmp_path / "out"),
        tiny_checkpoint_dir,
        output={"granularity": "both"},
        input={"reuse_from": runs["document"][0], "reuse_mismatch": "fail"},
    )
    with pytest.raises(ConfigError, match="output.granularity=both writes chunk rows"):
        run_job(cfg)
    key = json.load(open(f"{runs['document'][0]}/_manifest.json"))["reuse_key"]
    assert decide(runs["document"][0], key, "encode_all").source is not None  # the same settings reuse it
    assert "writes chunk rows" in decide(runs["document"][0], key, "encode_all", "chunk").reason
    chunk_only = runs["chunk"][0]
    key = json.load(open(f"{chunk_only}/_manifest.json"))["reuse_key"]
    assert "chunk rows only" in decide(chunk_only, key, "encode_all").reason


def sample_sources() -> dict[str, str]:
    with gzip.open(SAMPLE, "rt", encoding="utf-8") as f:
        return {d["id"]: d["text"] for d in map(json.loads, f)}


# The sample's checks run from pipeline_test.py, beside the sample run they read (one run per xdist worker, which
# takes a whole file): test_sample_chunks_point_into_their_documents and the chunk-vector test there call these.


def sample_chunks_point_into_their_documents(sample_run, real_checkpoint_dir):
    output, summary = sample_run
    chunks = read_chunks(output)
    assert len(by_document(chunks)) == summary["docs_embedded"] and len(chunks) > summary["docs_embedded"]
    check_spans(chunks, sample_sources(), real_checkpoint_dir, summary["window_len"])


def sample_chunk_vectors_are_the_models_window_vectors(sample_run, real_checkpoint_dir):
    """A one-window document's chunk is its document vector bit for bit; a long one's chunks are the encoder's
    vectors of its windows (cut by the test itself, encoded one at a time), normalised as the model normalises."""
    output, summary = sample_run
    documents, grouped = read_embeddings(output), by_document(read_chunks(output))
    for doc_id, rows in grouped.items():
        if len(rows) == 1:
            assert rows[0]["embedding"] == documents[doc_id]["embedding"], doc_id
    tokenizer, sources = tokenizer_of(real_checkpoint_dir), sample_sources()
    longest = sorted((d for d in grouped if len(grouped[d]) > 1), key=lambda d: -len(grouped[d]))[:2]
    for doc_id in longest:
        ids = tokenizer(sources[doc_id], add_special_tokens=False)["input_ids"]
        windows = windows_by_hand(ids, tokenizer.cls_token_id, tokenizer.sep_token_id, summary["window_len"], 32)
        vectors = encode_alone(real_checkpoint_dir, windows)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        np.testing.assert_allclose([r["embedding"] for r in grouped[doc_id]], vectors, atol=2e-5, err_msg=doc_id)


def test_a_chunk_row_left_out_is_counted_in_the_jobs_metrics(tmp_path):
    """A written document's chunk whose vector is NaN (a late chunk's context window gone wrong) is not written,
    and the job's metrics say how many and why: nothing disappears unseen."""
    import apache_beam as beam
    from apache_beam.metrics.metric import MetricsFilter

    from docbeam.models.heads.embedding import EmbeddingHead
    from docbeam.pipeline.records import WindowEmbedding
    from docbeam.pipeline.stages.window_chunks import WriteChunks
    from docbeam.pipeline.telemetry.observe import CHUNKS_NOT_WRITTEN, METRICS_NAMESPACE, metric_name

    def window(index, vector):
        return WindowEmbedding("d", index, 2, 3, 6, False, np.asarray(vector, np.float32), 32, "native", 0, 1, True)

    p = beam.Pipeline()
    inputs = {
        "windows": p | "Windows" >> beam.Create([window(0, [0.6, 0.8]), window(1, [np.nan, 0.0])]),
        "documents": p | "Documents" >> beam.Create([Document("d", "abc def", "x.jsonl", 1)]),
        "embedded": p | "Embedded" >> beam.Create([{"id": "d"}]),
    }
    head = EmbeddingHead(
        name="embedding", pooling="mean", layers=(), width=2, folder="embeddings", normalize=False, truncate_dim=None
    )
    _ = inputs | WriteChunks(str(tmp_path), "r1", 1, head=head, with_text=False)
    result = p.run()
    result.wait_until_finish()
    rows = [r for f in glob.glob(f"{tmp_path}/chunks/*.parquet") for r in pq.read_table(f).to_pylist()]
    assert [(r["chunk_index"], r["embedding"]) for r in rows] == [(0, pytest.approx([0.6, 0.8]))]
    counters = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
    assert {c.key.metric.name: c.committed for c in counters} == {metric_name(CHUNKS_NOT_WRITTEN, "non_finite"): 1}

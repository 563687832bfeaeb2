"""Prompts: a checkpoint's config_sentence_transformers.json prompts reach every window, as sentence-transformers
applies them (held to its vectors through `docbeam run`); model.prompt picks another, a literal or none; the
prompt is part of the reuse key and the content hash; what docbeam cannot reproduce is refused (exit 2)."""

from __future__ import annotations

import glob
import gzip
import json
import os
import subprocess

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_runner import run_docbeam
from conftest import SAMPLE, write_tiny_checkpoint

from docbeam.config import ModelConfig, TokenizeConfig
from docbeam.models.checkpoint import CheckpointError, load_tokenizer, open_checkpoint
from docbeam.models.checkpoint.sentence_transformers.settings import document_prompt
from docbeam.pipeline.records import Document
from docbeam.pipeline.stages.reuse import content_hash, key_differences
from docbeam.pipeline.stages.tokenize import framing, prompt_token_ids, prompted_windows, tokenize_documents

PROMPTS = {"query": "query: ", "document": "passage: "}
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]
DOCS = 120  # of the sample corpus, some longer than the window (truncated as sentence-transformers truncates)
LONG = " ".join(f"Sentence {i} talks about beams, batches and buckets." for i in range(30))


def add_sentence_transformers_files(folder: str, st_config: dict, pooling: dict | None = None) -> str:
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(MODULES, f)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling or {"embedding_dimension": 32, "pooling_mode": "mean", "include_prompt": True}, f)
    with open(os.path.join(folder, "config_sentence_transformers.json"), "w") as f:
        json.dump(st_config, f)
    return folder


@pytest.fixture(scope="module")
def prompted_checkpoint(tmp_path_factory, real_checkpoint_dir) -> str:
    """A tiny BERT whose default_prompt_name is query: documents must still get the document prompt."""
    folder = write_tiny_checkpoint(str(tmp_path_factory.mktemp("prompted")), real_checkpoint_dir)
    return add_sentence_transformers_files(folder, {"prompts": PROMPTS, "default_prompt_name": "query"})


@pytest.fixture(scope="module")
def tokenizer(real_checkpoint_dir):
    return load_tokenizer(real_checkpoint_dir)


def sample_texts(n: int) -> dict[str, str]:
    with gzip.open(SAMPLE, "rt") as f:
        docs = [json.loads(line) for line in f][:n]
    return {d["id"]: d["text"] for d in docs}


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def docbeam_run(tmp_path, model: str, *sets: str) -> subprocess.CompletedProcess:
    config, docs = tmp_path / "job.yaml", tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in sample_texts(DOCS).items()))
    config.write_text(
        json.dumps(
            {
                "input": {"path": str(docs)},
                "output": {"path": str(tmp_path / "out")},
                "model": {"path": model},
                "tokenize": {"long_documents": "truncate"},
                "batching": {"buckets": [32, 64, 128], "tokens_per_batch": 2048},
            }
        )
    )
    args = [a for s in sets for a in ("--set", s)]
    return run_docbeam("run", "--config", str(config), *args, cwd=tmp_path)


# --- which prompt ---------------------------------------------------------------------------------------------


def test_auto_is_the_prompt_sentence_transformers_encode_document_applies(prompted_checkpoint):
    from sentence_transformers import SentenceTransformer

    settings = open_checkpoint(prompted_checkpoint).settings
    assert document_prompt(settings, "auto", prompted_checkpoint) == "passage: "
    model = SentenceTransformer(prompted_checkpoint, device="cpu")
    texts = list(sample_texts(4).values())
    np.testing.assert_allclose(model.encode_document(texts), model.encode(texts, prompt="passage: "), atol=1e-6)


@pytest.mark.parametrize(
    "prompts, default, expected",
    [
        ({"query": "q: ", "passage": "p: "}, None, "p: "),  # e5: passage
        ({"query": "q: ", "corpus": "c: "}, "query", "c: "),  # a named document prompt wins over the default
        ({"query": "q: ", "classification": "k: "}, "classification", "k: "),  # else default_prompt_name
        ({"query": "q: "}, None, None),  # a query prompt alone is not for documents
        ({"document": ""}, "document", None),  # an empty prompt is none
    ],
)
def test_auto_follows_encode_documents_rule(tmp_path, prompts, default, expected):
    folder = add_sentence_transformers_files(str(tmp_path), {"prompts": prompts, "default_prompt_name": default})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(
            {
                "model_type": "bert",
                "vocab_size": 100,
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 64,
            },
            f,
        )
    assert document_prompt(open_checkpoint(folder).settings, "auto", folder) == expected


@pytest.mark.parametrize(
    "choice, expected",
    [("query", "query: "), ({"text": "search_document: "}, "search_document: "), (None, None), ("auto", "passage: ")],
)
def test_model_prompt_names_a_prompt_gives_a_text_or_none(prompted_checkpoint, choice, expected):
    settings = open_checkpoint(prompted_checkpoint).settings
    assert document_prompt(settings, ModelConfig(prompt=choice).prompt, prompted_checkpoint) == expected


def test_an_unknown_prompt_name_is_refused_with_the_checkpoints_names(prompted_checkpoint):
    with pytest.raises(CheckpointError) as e:
        document_prompt(open_checkpoint(prompted_checkpoint).settings, "passage", prompted_checkpoint)
    assert "model.prompt: 'passage' is not a prompt of this checkpoint" in str(e.value)
    assert "config_sentence_transformers.json defines ['query', 'document']" in str(e.value)


def test_include_prompt_false_is_refused_when_a_prompt_applies(tmp_path, tiny_checkpoint_dir):
    import shutil

    folder = str(tmp_path / "instructor")
    shutil.copytree(tiny_checkpoint_dir, folder)
    add_sentence_transformers_files(
        folder, {"prompts": PROMPTS}, {"embedding_dimension": 32, "pooling_mode": "mean", "include_prompt": False}
    )
    settings = open_checkpoint(folder).settings
    with pytest.raises(CheckpointError, match="sets include_prompt: false"):
        document_prompt(settings, "auto", folder)
    assert document_prompt(settings, None, folder) is None  # without a prompt there is nothing to leave out


# --- where it goes --------------------------------------------------------------------------------------------


def doc(doc_id: str, text: str) -> Document:
    return Document(id=doc_id, text=text, source="in.jsonl", line=1)


def test_the_first_window_is_exactly_the_prompted_text_as_sentence_transformers_truncates_it(tokenizer):
    for text, window_len in ((LONG, 32), ("A short text.", 32)):
        first = tokenize_documents(
            [doc("d", text)], tokenizer, window_len=window_len, config=TokenizeConfig(stride=8), prompt="passage: "
        )[0][0]
        assert (
            first.token_ids.tolist()
            == tokenizer("passage: " + text, max_length=window_len, truncation=True)["input_ids"]
        )


def test_every_window_starts_with_the_prompt_and_counts_only_the_documents_tokens(tokenizer):
    prompt = prompt_token_ids(tokenizer, "passage: ")
    assert len(prompt) == 2
    windows, _ = tokenize_documents(
        [doc("d", LONG)], tokenizer, window_len=32, config=TokenizeConfig(stride=8), prompt="passage: "
    )
    assert len(windows) > 2 and all(w.length <= 32 for w in windows)
    assert all(
        tuple(w.token_ids[1:3]) == prompt
        and w.token_ids[0] == tokenizer.cls_token_id
        and w.token_ids[-1] == tokenizer.sep_token_id
        for w in windows
    )
    own = tokenizer(LONG, add_special_tokens=False)["input_ids"]
    contents = [w.token_ids[3:-1].tolist() for w in windows]
    assert contents[0] + [t for c in contents[1:] for t in c[8:]] == own  # overlap by stride, nothing lost
    assert {w.doc_tokens for w in windows} == {len(own)}


@pytest.mark.parametrize("window_len, stride", [(32, 8), (32, 0), (16, 13), (128, 32)])
def test_windows_are_cut_as_the_tokenizers_own_overflow_cuts_them(tokenizer, window_len, stride):
    texts = list(sample_texts(120).values())
    overflow = tokenizer(texts, max_length=window_len, truncation=True, stride=stride, return_overflowing_tokens=True)
    expected: dict[int, list] = {}
    for ids, i in zip(overflow["input_ids"], overflow["overflow_to_sample_mapping"]):
        expected.setdefault(i, []).append(list(ids))
    frame = framing(tokenizer)
    for i, ids in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):
        assert prompted_windows(list(ids), (), frame, window_len=window_len, stride=stride)[0] == expected[i]


def test_a_prompt_that_merges_with_the_text_is_kept_in_the_first_window_only(tokenizer):
    # "pass" + "age ..." tokenizes as "passage": the prompt's tokens cannot be repeated apart from the text.
    windows, _ = tokenize_documents(
        [doc("d", "age " + LONG)], tokenizer, window_len=32, config=TokenizeConfig(stride=8), prompt="pass"
    )
    assert windows[0].token_ids.tolist() == tokenizer("passage " + LONG, max_length=32, truncation=True)["input_ids"]
    contents = [w.token_ids[1:-1].tolist() for w in windows]
    assert len(windows) > 2 and all(w.length <= 32 for w in windows)
    assert (
        contents[0] + [t for c in contents[1:] for t in c[8:]]
        == tokenizer("passage " + LONG, add_special_tokens=False)["input_ids"]
    )  # the later windows are the text's alone


def test_the_prompts_tokens_count_against_the_stride_check(tokenizer):
    with pytest.raises(ValueError, match=r"tokenize\.stride=28 .* \(28 tokens for window 32\)"):
        tokenize_documents(
            [doc("d", LONG)], tokenizer, window_len=32, config=TokenizeConfig(stride=28), prompt="passage: "
        )


LONG_PROMPT = "Represent this passage, with all of its many words, for retrieval: " * 8  # > 32 tokens


def test_a_prompt_that_fills_the_window_is_refused_naming_the_prompt_and_the_window(tokenizer):
    with pytest.raises(ValueError) as refused:
        tokenize_documents(
            [doc("d", LONG)], tokenizer, window_len=32, config=TokenizeConfig(stride=8), prompt=LONG_PROMPT
        )
    message = str(refused.value)
    assert "model.prompt" in message and "window of 32 tokens" in message and "model.max_seq_len" in message
    assert "tokenize.stride" not in message


def test_a_job_whose_prompt_fills_the_window_is_refused_at_start_about_the_prompt(tiny_checkpoint_dir, tmp_path):
    from conftest import job_config

    from docbeam.config import ConfigError
    from docbeam.pipeline.driver.run import run_job

    (tmp_path / "in.jsonl").write_text('{"id": "a", "text": "hello"}\n')
    cfg = job_config(
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "out"),
        tiny_checkpoint_dir,
        model={"prompt": {"text": LONG_PROMPT * 3}},
    )  # ~ 390 tokens for a window of 128
    with pytest.raises(ConfigError, match=r"model\.prompt.*window of 128 tokens") as refused:
        run_job(cfg)
    assert "stride" not in str(refused.value) and not (tmp_path / "out").exists()


# --- what it changes ------------------------------------------------------------------------------------------


def test_the_prompt_is_part_of_the_content_hash_and_no_prompt_hashes_as_before():
    import hashlib

    assert content_hash("text") == hashlib.sha256(b"text").hexdigest()[:32]  # runs before prompts stay reusable
    assert len({content_hash("text"), content_hash("text", "passage: "), content_hash("text", "query: ")}) == 3
    assert content_hash("passage: text") != content_hash("text", "passage: ")


def test_a_changed_prompt_is_a_reuse_key_difference():
    before = {
        "weights_digest": "w",
        "tokenizer_digest": "t",
        "window_len": 128,
        "stride": 32,
        "long_documents": "window",
        "pooling": "mean",
        "normalize": False,
        "dtype": "float32",
    }
    assert key_differences(before, {**before, "prompt": None}) == []  # a run before prompts embedded with none
    assert key_differences({**before, "prompt": None}, {**before, "prompt": "passage: "}) == [
        "prompt: None then, 'passage: ' now"
    ]


# --- through docbeam run --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "sets, reference",
    [
        ((), {"prompt_name": "document"}),
        # A named prompt and a text reach the run as the text the tests above resolve them to; each whole run again:
        pytest.param(("model.prompt=query",), {"prompt_name": "query"}, marks=pytest.mark.extra),
        pytest.param(
            ('model.prompt={text: "search_document: "}',), {"prompt": "search_document: "}, marks=pytest.mark.extra
        ),
        (("model.prompt=null",), {"prompt": ""}),
    ],
)
def test_docbeam_run_gives_sentence_transformers_vectors_with_the_prompt(
    prompted_checkpoint, tmp_path, sets, reference
):
    from sentence_transformers import SentenceTransformer

    result = docbeam_run(tmp_path, prompted_checkpoint, *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["id"]: r for r in pq.read_table(sorted(glob.glob(f"{tmp_path}/out/embeddings/*.parquet"))).to_pylist()}
    texts = sample_texts(DOCS)
    ids = sorted(rows)
    assert len(ids) == DOCS
    model = SentenceTransformer(prompted_checkpoint, device="cpu")
    expected = model.encode([texts[i] for i in ids], batch_size=64, **reference)
    ours = np.array([rows[i]["embedding"] for i in ids], np.float32)
    assert cosines(ours, expected).min() >= 0.99999
    # The test can fail: without (or with another) prompt the vectors are measurably other vectors.
    other = model.encode(
        [texts[i] for i in ids[:50]], batch_size=64, prompt="" if sets != ("model.prompt=null",) else "passage: "
    )
    assert cosines(ours[:50], other).min() < 0.9999


@pytest.mark.parametrize(
    "change, named",
    [
        ({"sets": ("model.prompt=passage",)}, "model.prompt: 'passage' is not a prompt of this checkpoint"),
        ({"st": {"prompts": PROMPTS, "truncate_dim": 64}}, "model.truncate_dim: 64 (auto, from"),
        ({"pooling": {"pooling_mode": "mean", "include_prompt": False}}, "config.json sets include_prompt: false"),
    ],
)
def test_an_unknown_prompt_or_an_unsupported_setting_exits_2_naming_it(prompted_checkpoint, tmp_path, change, named):
    import shutil

    model = str(tmp_path / "model")
    shutil.copytree(prompted_checkpoint, model)
    if "st" in change or "pooling" in change:
        add_sentence_transformers_files(model, change.get("st", {"prompts": PROMPTS}), change.get("pooling"))
    result = docbeam_run(tmp_path, model, *change.get("sets", ()))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "docbeam: cannot start:" in result.stderr and named in result.stderr
    assert not (tmp_path / "out").exists()

"""A checkpoint's JSON files as a hostile or careless hand leaves them: each wrongly typed value is refused at start
as a CheckpointError (exit 2) naming the file and the key, never a Python error from deep in the plan. One row per
reader and key: sentence-transformers' files (models/checkpoint/sentence_transformers/keys.py KEY_KINDS) and
config.json (models/families)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import job_config

from docbeam.errors import Refused
from docbeam.models.families.encoder_config import CheckpointError
from docbeam.pipeline.driver.plan import make_plan

MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]


@pytest.mark.parametrize(
    ("file", "content", "named"),
    [
        (
            "sentence_bert_config.json",
            {"max_seq_length": "256"},
            r"sentence_bert_config.json sets max_seq_length: \"256\"",
        ),
        (
            "sentence_bert_config.json",
            {"max_seq_length": 0},
            "max_seq_length: 0; it must be a whole number of at least 1",
        ),
        ("sentence_bert_config.json", [128], "sentence_bert_config.json must be a JSON object"),
        ("config_sentence_transformers.json", {"model_type": ["SentenceTransformer"]}, "sets model_type"),
        ("config_sentence_transformers.json", {"prompts": ["query: "]}, "sets prompts"),
        ("config_sentence_transformers.json", {"prompts": {"query": 5}}, "sets prompts"),
        ("config_sentence_transformers.json", {"truncate_dim": 1.5}, "sets truncate_dim: 1.5"),
        ("modules.json", {"0": MODULES[0]}, "modules.json must be a list of module objects"),
        ("modules.json", ["0_Transformer"], "modules.json must be a list of module objects"),
        ("modules.json", [{**MODULES[0], "idx": "0"}, MODULES[1]], r"module 0: idx: \"0\""),
        ("modules.json", [MODULES[0], {**MODULES[1], "path": 1}], "module 1: path: 1"),
        (
            "1_Pooling/config.json",
            {"word_embedding_dimension": "32", "pooling_mode_mean_tokens": True},
            "word_embedding_dimension",
        ),
        (
            "1_Pooling/config.json",
            {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": "true"},
            "pooling_mode_mean_tokens",
        ),
        ("config.json", {"model_type": ["bert"]}, r"model_type \['bert'\] in .*config.json is not supported"),
        ("config.json", {"vocab_size": 1e30}, "sets vocab_size: 1e\\+30"),
        ("config.json", {"hidden_size": "64"}, "sets hidden_size"),
    ],
)
def test_a_wrongly_typed_checkpoint_file_is_refused_naming_the_file_and_key(
    tiny_checkpoint_dir, tmp_path, file, content, named
):
    model = str(tmp_path / "model")
    shutil.copytree(tiny_checkpoint_dir, model)
    if file.startswith("1_Pooling") or file == "modules.json" and isinstance(content, list) and len(content) == 2:
        with open(os.path.join(model, "modules.json"), "w") as f:
            json.dump(MODULES if file.startswith("1_Pooling") else content, f)
    path = os.path.join(model, file)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if file == "config.json":
        with open(path) as f:
            content = {**json.load(f), **content}
    with open(path, "w") as f:
        json.dump(content, f)
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"id": "a", "text": "a river"}\n')
    cfg = job_config(str(docs), str(tmp_path / "out"), model)
    with pytest.raises(CheckpointError, match=named) as refused:
        make_plan(cfg, probe_backends=False)
    assert isinstance(refused.value, Refused)  # exit 2
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("value", ["512", [512], True])
def test_a_tokenizer_config_length_that_is_no_number_is_refused_naming_it(tiny_checkpoint_dir, tmp_path, value):
    """Read where a checkpoint sets no max_seq_length (sentence-transformers 6 writes none): a string or a list is
    named, not a TypeError."""
    model = str(tmp_path / "model")
    shutil.copytree(tiny_checkpoint_dir, model)
    os.remove(os.path.join(model, "sentence_bert_config.json"))
    path = os.path.join(model, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "model_max_length": value}, f)
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"id": "a", "text": "a river"}\n')
    with pytest.raises(CheckpointError, match="tokenizer_config.json sets model_max_length"):
        make_plan(job_config(str(docs), str(tmp_path / "out"), model), probe_backends=False)

"""models/checkpoint/sentence_transformers/settings.py: every key of sentence-transformers' files is honoured,
harmless, or refused at start naming the file and key; none is ignored. What sentence-transformers 6.2.0 itself saves is accepted."""

from __future__ import annotations

import json
import os

import pytest

from docbeam.models.checkpoint import CheckpointError, open_checkpoint

BERT = {
    "model_type": "bert",
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]
POOLING = {"embedding_dimension": 32, "pooling_mode": "mean", "include_prompt": True}


def folder_with(
    tmp_path,
    *,
    st: dict | None = None,
    modules: list | None = None,
    pooling: dict | None = None,
    transformer: dict | None = None,
) -> str:
    os.makedirs(tmp_path / "1_Pooling", exist_ok=True)
    files = {
        "config.json": BERT,
        "modules.json": modules or MODULES,
        "1_Pooling/config.json": pooling or POOLING,
        "config_sentence_transformers.json": st or {},
        "sentence_bert_config.json": transformer or {},
    }
    for name, value in files.items():
        (tmp_path / name).write_text(json.dumps(value))
    return str(tmp_path)


@pytest.mark.parametrize(
    "where, key, value",
    [
        ("st", "truncate_dim", 0),
        ("st", "model_type", "SparseEncoder"),
        ("st", "a_key_from_the_future", 1),
        ("pooling", "include_prompt_tokens", True),
        ("pooling", "embedding_dimension", 64),
        ("transformer", "do_lower_case", True),
        ("transformer", "processing_kwargs", {"text": {"padding_side": "left"}}),
        ("transformer", "transformer_task", "text-generation"),
        ("transformer", "module_output_name", "hidden"),
        ("transformer", "document_length", 180),
        ("transformer", "model_args", {"torch_dtype": "float16"}),
        ("transformer", "tokenizer_args", {"model_max_length": 64}),
    ],
)
def test_a_setting_docbeam_does_not_reproduce_is_refused_naming_file_and_key(tmp_path, where, key, value):
    files = {
        "st": "config_sentence_transformers.json",
        "pooling": "1_Pooling/config.json",
        "transformer": "sentence_bert_config.json",
    }
    base = {"st": {}, "pooling": dict(POOLING), "transformer": {}}[where]
    folder = folder_with(tmp_path, **{where: {**base, key: value}})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(folder)
    assert f"{folder}/{files[where]} sets {key}: " in str(e.value)


def test_a_module_argument_is_refused_naming_modules_json(tmp_path):
    modules = [MODULES[0], {**MODULES[1], "kwargs": ["task"]}]
    with pytest.raises(CheckpointError, match=r"modules\.json sets kwargs: \[\"task\"\]"):
        open_checkpoint(folder_with(tmp_path, modules=modules))


def test_a_module_named_like_ours_from_another_package_is_refused(tmp_path):
    modules = [MODULES[0], {**MODULES[1], "type": "custom_code.Pooling"}]
    with pytest.raises(CheckpointError, match="of type 'custom_code.Pooling'"):
        open_checkpoint(folder_with(tmp_path, modules=modules))


def test_a_default_prompt_name_that_is_not_a_prompt_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="sets default_prompt_name: 'document', which is not among its prompts"):
        open_checkpoint(folder_with(tmp_path, st={"prompts": {"query": "q: "}, "default_prompt_name": "document"}))


def test_harmless_keys_and_defaults_are_accepted(tmp_path):
    st = {
        "__version__": {"sentence_transformers": "2.0.0"},
        "similarity_fn_name": "dot",
        "truncate_dim": None,
        "requirements": {"transformers": ">=4.0"},
        "model_type": "SentenceTransformer",
        "prompts": {"query": "q: "},
        "default_prompt_name": None,
    }
    transformer = {
        "max_seq_length": 64,
        "do_lower_case": False,
        "unpad_inputs": True,
        "query_length": None,
        "model_args": {"trust_remote_code": True},
        "config_kwargs": {},
    }
    settings = open_checkpoint(
        folder_with(tmp_path, st=st, transformer=transformer, modules=[MODULES[0], {**MODULES[1], "kwargs": []}])
    ).settings
    assert (settings.max_seq_len, settings.pooling, settings.prompts) == (64, "mean", (("query", "q: "),))


def test_what_sentence_transformers_saves_is_accepted_with_its_prompts(tiny_checkpoint_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(
        tiny_checkpoint_dir,
        device="cpu",
        prompts={"query": "query: ", "document": "passage: "},
        default_prompt_name="query",
    )
    model.save(str(tmp_path / "saved"))
    settings = open_checkpoint(str(tmp_path / "saved")).settings
    assert dict(settings.prompts) == {"query": "query: ", "document": "passage: "}
    assert (settings.document_prompt_name, settings.include_prompt, settings.pooling) == ("document", True, "mean")

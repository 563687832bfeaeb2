"""models/checkpoint/__init__.py: sentence-transformers settings docbeam cannot honour are refused at start, naming the
file, the module and the setting (they used to be read as mean pooling: other embeddings, silently)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from cli_runner import run_docbeam

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
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
LAYER_NORM = {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}
MEAN = {
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": True,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
}


def checkpoint(folder, modules=None, pooling=None) -> str:
    """The files model_settings reads: config.json, and sentence-transformers' modules.json and pooling config."""
    os.makedirs(folder / "1_Pooling", exist_ok=True)
    (folder / "config.json").write_text(json.dumps(BERT))
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(folder)


@pytest.mark.parametrize(
    "modules, pooling, expected",
    [
        (None, None, ("mean", False)),
        ([TRANSFORMER, POOLING, NORMALIZE], MEAN, ("mean", True)),
        (
            [TRANSFORMER, POOLING],
            {**MEAN, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True},
            ("cls", False),
        ),
        ([TRANSFORMER, POOLING], {"embedding_dimension": 32, "pooling_mode": "cls"}, ("cls", False)),  # ST >= 5
        ([TRANSFORMER, POOLING], {"pooling_mode": ["mean"]}, ("mean", False)),
        ([TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode": "lasttoken"}, ("lasttoken", True)),  # Qwen3-Embedding
        (
            [TRANSFORMER, POOLING],
            {**MEAN, "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True},
            ("lasttoken", False),
        ),
    ],
)
def test_supported_settings_give_pooling_and_normalisation(tmp_path, modules, pooling, expected):
    settings = open_checkpoint(checkpoint(tmp_path, modules, pooling)).settings
    assert (settings.pooling, settings.normalize) == expected


@pytest.mark.parametrize(
    "flag", ["pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"]
)
def test_an_unsupported_pooling_flag_is_refused_naming_file_module_and_setting(tmp_path, flag):
    folder = checkpoint(tmp_path, [TRANSFORMER, POOLING], {**MEAN, "pooling_mode_mean_tokens": False, flag: True})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(folder)
    assert f"{folder}/1_Pooling/config.json (the Pooling module) sets {flag}: true" in str(e.value)
    assert "docbeam pools by exactly one of mean, cls, lasttoken" in str(e.value)


@pytest.mark.parametrize(
    "pooling, setting",
    [
        ({"pooling_mode": "max"}, "pooling_mode: 'max'"),
        ({"pooling_mode": ["lasttoken", "mean"]}, "pooling_mode: ['lasttoken', 'mean']"),
        ({"pooling_mode": ["cls", "mean"]}, "pooling_mode: ['cls', 'mean']"),  # concatenated
        ({**MEAN, "pooling_mode_cls_token": True}, "pooling_mode_cls_token: true, pooling_mode_mean_tokens: true"),
    ],
)
def test_other_pooling_modes_and_concatenations_are_refused(tmp_path, pooling, setting):
    with pytest.raises(CheckpointError, match="the Pooling module") as e:
        open_checkpoint(checkpoint(tmp_path, [TRANSFORMER, POOLING], pooling))
    assert f"sets {setting};" in str(e.value)


def test_a_module_docbeam_does_not_run_is_refused_naming_it(tmp_path):
    folder = checkpoint(tmp_path, [TRANSFORMER, POOLING, LAYER_NORM], MEAN)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(folder)
    assert (
        f"{folder}/modules.json lists module '2' of type 'sentence_transformers.models.LayerNorm' (path "
        "'2_LayerNorm'), which docbeam does not run"
    ) in str(e.value)


def test_a_listed_dense_module_without_its_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="lists a Dense module at '2_Dense', but 2_Dense/config.json is missing"):
        open_checkpoint(checkpoint(tmp_path, [TRANSFORMER, POOLING, DENSE], MEAN))


def test_a_listed_pooling_module_without_its_config_is_refused(tmp_path):
    with pytest.raises(
        CheckpointError, match="lists a Pooling module at '1_Pooling', but 1_Pooling/config.json is missing"
    ):
        open_checkpoint(checkpoint(tmp_path, [TRANSFORMER, POOLING]))


def test_the_job_refuses_such_a_checkpoint_at_start_with_exit_2(tmp_path):
    model = checkpoint(tmp_path / "model", [TRANSFORMER, POOLING, LAYER_NORM], MEAN)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "text": "hello"}\n')
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps({"input": {"path": "in.jsonl"}, "output": {"path": "out"}, "model": {"path": model}}))
    result = run_docbeam("run", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "docbeam: cannot start: model.path:" in result.stderr and "LayerNorm" in result.stderr
    assert not (tmp_path / "out").exists()


# --- config.json and model.safetensors held against each other at start ---------------------------------------


def tiny_copy(tmp_path, tiny_checkpoint_dir, config_changes=None, tensors=None, config_text=None) -> str:
    """The tiny checkpoint (2 layers, hidden 32) copied, its config.json changed by ``config_changes`` (or
    replaced by ``config_text``) and its tensors by ``tensors(dict) -> dict``."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = str(tmp_path / "model")
    shutil.copytree(tiny_checkpoint_dir, folder)
    if config_changes is not None or config_text is not None:
        with open(f"{folder}/config.json") as f:
            config = json.load(f)
        with open(f"{folder}/config.json", "w") as f:
            f.write(config_text if config_text is not None else json.dumps({**config, **config_changes}))
    if tensors is not None:
        save_file(
            tensors(load_file(f"{folder}/model.safetensors")), f"{folder}/model.safetensors", metadata={"format": "pt"}
        )
    return folder


def changed(name, value):
    return lambda tensors: {**tensors, name: value}


NAN = float("nan")


@pytest.mark.parametrize(
    "config_changes, named",
    [
        (
            {"num_hidden_layers": 1},
            "holds tensors of 2 layers (indices 0 to 1), but config.json sets 1 layers: layers 1 to 1 would not run",
        ),
        ({"num_hidden_layers": 3}, "holds no tensors of layer 2"),
        ({"num_hidden_layers": -1}, "sets num_hidden_layers: -1; it must be a whole number of at least 1"),
        ({"num_hidden_layers": 0}, "sets num_hidden_layers: 0; it must be a whole number of at least 1"),
        ({"hidden_size": "32"}, 'sets hidden_size: "32"; it must be a whole number'),
        ({"num_attention_heads": 0}, "sets num_attention_heads: 0; it must be a whole number of at least 1"),
        (
            {"num_attention_heads": 3},
            "describes no model docbeam can build: hidden_size 32 is not divisible by num_heads 3",
        ),
        ({"layer_norm_eps": "tiny"}, 'sets layer_norm_eps: "tiny"; it must be a positive number'),
        ({"intermediate_size": 64}, "the parameter layer_0/mlp/wi/kernel"),
        ({"vocab_size": 1000}, "the parameter embed/word/embedding"),
    ],
    ids=[
        "fewer-layers",
        "more-layers",
        "minus-one-layers",
        "no-layers",
        "size-a-string",
        "no-heads",
        "heads-not-dividing",
        "eps-a-string",
        "intermediate-other",
        "vocab-other",
    ],
)
def test_a_config_json_that_disagrees_with_its_weights_is_refused_naming_file_and_key(
    tmp_path, tiny_checkpoint_dir, config_changes, named
):
    folder = tiny_copy(tmp_path, tiny_checkpoint_dir, config_changes)
    with pytest.raises(CheckpointError) as refused:
        open_checkpoint(folder)
    assert f"model.path: {folder}/" in str(refused.value) and named in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "config_text, named",
    [
        ("{", "config.json is not valid JSON"),
        ("[]", "config.json holds a JSON list, not an object"),
        ("\xff\xfe", "config.json is not valid JSON"),
    ],
)
def test_a_config_json_that_is_no_object_is_refused_naming_the_file(tmp_path, tiny_checkpoint_dir, config_text, named):
    folder = tiny_copy(tmp_path, tiny_checkpoint_dir, config_text=config_text)
    with pytest.raises(CheckpointError, match=f"model.path: {folder}/{named}"):
        open_checkpoint(folder)


@pytest.mark.parametrize(
    "tensors, named",
    [
        (
            changed("encoder.layer.1.intermediate.dense.weight", np.zeros((96, 32), np.float32)),
            "the tensors read for the parameter layer_1/mlp/wi/kernel (encoder.layer.1.intermediate.dense.weight [96, 32]",
        ),
        (
            changed("encoder.layer.0.attention.self.key.weight", np.zeros((16, 32), np.float32)),
            "the parameter layer_0/attn/qkv/kernel",
        ),
        (
            changed("encoder.layer.0.attention.self.query.weight", np.zeros((32, 16), np.float32)),
            "cannot be put together",
        ),
        (
            changed("encoder.layer.1.output.dense.weight", np.full((32, 128), NAN, np.float32)),
            "holds NaN or infinite values in the tensor encoder.layer.1.output.dense.weight",
        ),
        (
            changed("embeddings.word_embeddings.weight", np.full((30522, 32), np.inf, np.float16)),
            "holds NaN or infinite values in the tensor embeddings.word_embeddings.weight",
        ),
        (
            changed("encoder.layer.0.output.dense.bias", np.zeros(32, np.int64)),
            "holds encoder.layer.0.output.dense.bias as I64; a weight must be one of F16, F32, F64, BF16",
        ),
        (
            lambda t: {k: v for k, v in t.items() if k != "encoder.layer.0.output.LayerNorm.weight"},
            "has no tensor 'encoder.layer.0.output.LayerNorm.weight'",
        ),
    ],
    ids=[
        "shape-one-layer",
        "shape-key",
        "shape-not-joinable",
        "nan-tensor",
        "inf-embedding-f16",
        "int-weight",
        "missing-tensor",
    ],
)
def test_weights_of_the_wrong_shape_dtype_or_values_are_refused_naming_the_tensor(
    tmp_path, tiny_checkpoint_dir, tensors, named
):
    folder = tiny_copy(tmp_path, tiny_checkpoint_dir, tensors=tensors)
    with pytest.raises(CheckpointError) as refused:
        open_checkpoint(folder)
    assert f"model.path: {folder}/model.safetensors" in str(refused.value) and named in str(refused.value), str(
        refused.value
    )


def _gap(data: bytes) -> bytes:
    """The first tensor's data moved 4 bytes on: the header's offsets then leave a gap (and the end uncovered)."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    for raw in header.values():
        if isinstance(raw, dict) and "data_offsets" in raw and raw["data_offsets"][0] > 0:
            raw["data_offsets"] = [raw["data_offsets"][0] + 4, raw["data_offsets"][1] + 4]
            break
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + length :] + bytes(4)


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("garbage", "its first 8 bytes"),
        ("cut", "inside the file"),
        ("trailing bytes", "the header does not cover the file"),  # safetensors' loader refuses it on the workers
        ("a gap", "they overlap or leave a gap"),
    ],
)
def test_a_damaged_safetensors_file_is_refused_naming_it(tmp_path, tiny_checkpoint_dir, damage, why):
    folder = tiny_copy(tmp_path, tiny_checkpoint_dir)
    path = f"{folder}/model.safetensors"
    data = open(path, "rb").read()
    damaged = {
        "garbage": lambda: os.urandom(4096),
        "cut": lambda: data[: len(data) // 2],
        "trailing bytes": lambda: data + bytes(100),
        "a gap": lambda: _gap(data),
    }[damage]()
    open(path, "wb").write(damaged)
    with pytest.raises(CheckpointError, match=f"model.path: {path} is not a readable safetensors file: .*{why}"):
        open_checkpoint(folder)


def test_a_garbage_tokenizer_is_refused_naming_the_file(tmp_path, tiny_checkpoint_dir):
    from docbeam.models.checkpoint import load_tokenizer

    folder = tiny_copy(tmp_path, tiny_checkpoint_dir)
    (tmp_path / "model" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"}}')
    with pytest.raises(CheckpointError, match=f"model.path: {folder}/tokenizer.json cannot be read by the tokenizers"):
        load_tokenizer(folder)


def test_the_tiny_and_the_default_checkpoint_pass_the_checks(tiny_checkpoint_dir, real_checkpoint_dir):
    assert open_checkpoint(tiny_checkpoint_dir).config.num_layers == 2
    assert open_checkpoint(real_checkpoint_dir).config.num_layers == 6


@pytest.mark.parametrize("case", ["fewer-layers", "garbage-tokenizer"])
def test_docbeam_run_refuses_a_checkpoint_at_odds_with_itself_with_exit_2(tmp_path, tiny_checkpoint_dir, case):
    model = tiny_copy(tmp_path, tiny_checkpoint_dir, {"num_hidden_layers": 1} if case == "fewer-layers" else None)
    if case == "garbage-tokenizer":
        (tmp_path / "model" / "tokenizer.json").write_bytes(b"\x00garbage")
    (tmp_path / "in.jsonl").write_text('{"id": "a", "text": "hello"}\n')
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps({"input": {"path": "in.jsonl"}, "output": {"path": "out"}, "model": {"path": model}}))
    result = run_docbeam("run", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    named = "model.safetensors holds tensors of 2 layers" if case == "fewer-layers" else "tokenizer.json cannot be read"
    assert f"docbeam: cannot start: model.path: {model}/" in result.stderr and named in result.stderr
    assert not (tmp_path / "out").exists()

"""models/checkpoint.py: sentence-transformers settings docbeam cannot honour are refused at start, naming the
file, the module and the setting (they used to be read as mean pooling: other embeddings, silently)."""
from __future__ import annotations

import json
import os

import pytest

from cli_runner import run_docbeam
from docbeam.models.checkpoint import CheckpointError, open_checkpoint

BERT = {"model_type": "bert", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128}
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
LAYER_NORM = {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}
MEAN = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}


def checkpoint(folder, modules=None, pooling=None) -> str:
    """The files model_settings reads: config.json, and sentence-transformers' modules.json and pooling config."""
    os.makedirs(folder / "1_Pooling", exist_ok=True)
    (folder / "config.json").write_text(json.dumps(BERT))
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(folder)


@pytest.mark.parametrize("modules, pooling, expected", [
    (None, None, ("mean", False)),
    ([TRANSFORMER, POOLING, NORMALIZE], MEAN, ("mean", True)),
    ([TRANSFORMER, POOLING], {**MEAN, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True},
     ("cls", False)),
    ([TRANSFORMER, POOLING], {"embedding_dimension": 32, "pooling_mode": "cls"}, ("cls", False)),  # ST >= 5
    ([TRANSFORMER, POOLING], {"pooling_mode": ["mean"]}, ("mean", False)),
    ([TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode": "lasttoken"}, ("lasttoken", True)),  # Qwen3-Embedding
    ([TRANSFORMER, POOLING], {**MEAN, "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True},
     ("lasttoken", False)),
])
def test_supported_settings_give_pooling_and_normalisation(tmp_path, modules, pooling, expected):
    settings = open_checkpoint(checkpoint(tmp_path, modules, pooling)).settings
    assert (settings.pooling, settings.normalize) == expected


@pytest.mark.parametrize("flag", ["pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                  "pooling_mode_weightedmean_tokens"])
def test_an_unsupported_pooling_flag_is_refused_naming_file_module_and_setting(tmp_path, flag):
    folder = checkpoint(tmp_path, [TRANSFORMER, POOLING], {**MEAN, "pooling_mode_mean_tokens": False, flag: True})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(folder)
    assert f"{folder}/1_Pooling/config.json (the Pooling module) sets {flag}: true" in str(e.value)
    assert "docbeam pools by exactly one of mean, cls, lasttoken" in str(e.value)


@pytest.mark.parametrize("pooling, setting", [
    ({"pooling_mode": "max"}, "pooling_mode: 'max'"),
    ({"pooling_mode": ["lasttoken", "mean"]}, "pooling_mode: ['lasttoken', 'mean']"),
    ({"pooling_mode": ["cls", "mean"]}, "pooling_mode: ['cls', 'mean']"),  # concatenated
    ({**MEAN, "pooling_mode_cls_token": True}, "pooling_mode_cls_token: true, pooling_mode_mean_tokens: true"),
])
def test_other_pooling_modes_and_concatenations_are_refused(tmp_path, pooling, setting):
    with pytest.raises(CheckpointError, match="the Pooling module") as e:
        open_checkpoint(checkpoint(tmp_path, [TRANSFORMER, POOLING], pooling))
    assert f"sets {setting};" in str(e.value)


def test_a_module_docbeam_does_not_run_is_refused_naming_it(tmp_path):
    folder = checkpoint(tmp_path, [TRANSFORMER, POOLING, LAYER_NORM], MEAN)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(folder)
    assert (f"{folder}/modules.json lists module '2' of type 'sentence_transformers.models.LayerNorm' (path "
            "'2_LayerNorm'), which docbeam does not run") in str(e.value)


def test_a_listed_dense_module_without_its_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="lists a Dense module at '2_Dense', but 2_Dense/config.json is missing"):
        open_checkpoint(checkpoint(tmp_path, [TRANSFORMER, POOLING, DENSE], MEAN))


def test_a_listed_pooling_module_without_its_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="lists a Pooling module at '1_Pooling', but 1_Pooling/config.json is "
                                              "missing"):
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

"""sentence-transformers' output heads: Dense modules run on every pooled window inside the jitted forward, and
Matryoshka's truncate_dim cuts each document's vector before it is normalised; both held to sentence-transformers'
own vectors (the checkpoint saved by sentence-transformers itself) through `docbeam run`. What docbeam cannot
reproduce (another activation, a residual Dense, a truncate_dim wider than the vector) is refused naming the key."""

from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import write_tiny_checkpoint
from prompts_test import DOCS, cosines, docbeam_run, sample_texts

from docbeam.models.checkpoint import CheckpointError, dense_digest, load_dense, open_checkpoint

HIDDEN, MIDDLE, OUT = 32, 24, 16


def save_with_heads(folder: str, base: str, truncate_dim: int | None = None) -> str:
    """Transformer → mean Pooling → Dense(32→24, tanh) → Dense(24→16, identity) → Normalize, saved by
    sentence-transformers; weights large enough that each Dense (and tanh) moves the vectors."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(1)
    modules = [
        Transformer(base, max_seq_length=128),
        Pooling(HIDDEN, "mean"),
        Dense(
            HIDDEN,
            MIDDLE,
            activation_function=torch.nn.Tanh(),
            init_weight=torch.randn(MIDDLE, HIDDEN) * 0.3,
            init_bias=torch.randn(MIDDLE) * 0.5,
        ),
        Dense(
            MIDDLE,
            OUT,
            activation_function=torch.nn.Identity(),
            init_weight=torch.randn(OUT, MIDDLE) * 0.3,
            init_bias=torch.randn(OUT),
        ),
        Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu", truncate_dim=truncate_dim).save(folder)
    return folder


@pytest.fixture(scope="module")
def headed_checkpoint(tmp_path_factory, real_checkpoint_dir) -> str:
    base = write_tiny_checkpoint(str(tmp_path_factory.mktemp("base")), real_checkpoint_dir)
    return save_with_heads(str(tmp_path_factory.mktemp("headed")), base)


def reference(folder: str, texts: list[str], **kwargs) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu", **kwargs).encode(texts, batch_size=64)


def docbeam_vectors(tmp_path, model: str, *sets: str) -> tuple[list[str], np.ndarray]:
    result = docbeam_run(tmp_path, model, *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["id"]: r for r in pq.read_table(sorted(glob.glob(f"{tmp_path}/out/embeddings/*.parquet"))).to_pylist()}
    ids = sorted(rows)
    assert len(ids) == DOCS
    return ids, np.array([rows[i]["embedding"] for i in ids], np.float32)


# --- what the checkpoint says ---------------------------------------------------------------------------------


def test_the_dense_modules_are_read_in_order_with_their_shapes_and_activations(headed_checkpoint):
    settings = open_checkpoint(headed_checkpoint).settings
    assert [(d.in_features, d.out_features, d.bias, d.activation) for d in settings.dense] == [
        (HIDDEN, MIDDLE, True, "tanh"),
        (MIDDLE, OUT, True, "identity"),
    ]
    assert settings.width(HIDDEN) == OUT and settings.normalize and settings.truncate_dim is None
    layers = load_dense(headed_checkpoint, settings)
    assert [layer["kernel"].shape for layer in layers] == [(HIDDEN, MIDDLE), (MIDDLE, OUT)]


def with_dense_config(tmp_path, headed_checkpoint, **changes) -> str:
    model = str(tmp_path / "model")
    shutil.copytree(headed_checkpoint, model)
    path = open_checkpoint(model).settings.dense[0].path
    with open(os.path.join(model, path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(model, path, "config.json"), "w") as f:
        json.dump({**cfg, **changes}, f)
    return model


@pytest.mark.parametrize(
    "changes, named",
    [
        (
            {"activation_function": "torch.nn.modules.activation.ReLU"},
            'sets activation_function: "torch.nn.modules.activation.ReLU"',
        ),
        ({"use_residual": True}, "sets use_residual: true"),
        ({"in_features": 48}, "sets in_features: 48"),
    ],
)
def test_a_dense_module_docbeam_cannot_reproduce_is_refused_naming_the_key(tmp_path, headed_checkpoint, changes, named):
    with pytest.raises(CheckpointError, match=named.replace("(", r"\(")):
        open_checkpoint(with_dense_config(tmp_path, headed_checkpoint, **changes))


def test_a_pickle_only_dense_folder_is_refused_like_a_pickle_checkpoint(tmp_path, headed_checkpoint):
    model = str(tmp_path / "model")
    shutil.copytree(headed_checkpoint, model)
    settings = open_checkpoint(model).settings
    folder = os.path.join(model, settings.dense[0].path)
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "pytorch_model.bin"))
    with pytest.raises(CheckpointError, match="is a pickle checkpoint"):
        load_dense(model, settings)


def test_dense_after_normalize_is_refused(tmp_path, headed_checkpoint):
    model = str(tmp_path / "model")
    shutil.copytree(headed_checkpoint, model)
    with open(os.path.join(model, "modules.json")) as f:
        modules = json.load(f)
    with open(os.path.join(model, "modules.json"), "w") as f:
        json.dump(modules[:2] + [modules[-1]] + modules[2:-1], f)
    with pytest.raises(CheckpointError, match="Transformer, Pooling, Dense..., Normalize"):
        open_checkpoint(model)


def test_a_changed_dense_weight_changes_the_reuse_keys_digest(tmp_path, headed_checkpoint):
    before = dense_digest(headed_checkpoint, open_checkpoint(headed_checkpoint).settings)
    model = str(tmp_path / "model")
    shutil.copytree(headed_checkpoint, model)
    assert dense_digest(model, open_checkpoint(model).settings) == before  # of the files, not of where they are
    path = open_checkpoint(model).settings.dense[1].path
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(model, path, "model.safetensors"))
    tensors["linear.bias"] = tensors["linear.bias"] + 1
    save_file(tensors, os.path.join(model, path, "model.safetensors"))
    assert dense_digest(model, open_checkpoint(model).settings) != before


# --- the vectors ----------------------------------------------------------------------------------------------


def jitted_vectors(folder: str, texts: list[str], activations=None) -> np.ndarray:
    """docbeam's embed_fn on unpadded single windows (truncated to the model's window), normalised."""
    import jax

    from docbeam.attention import registry
    from docbeam.models import checkpoint, encoder

    ck = checkpoint.open_checkpoint(folder, with_weights=True)
    from docbeam.models.heads import HeadLayer

    params = {
        "encoder": checkpoint.load_params(ck.folder, ck.config),
        "head": checkpoint.load_dense(ck.folder, ck.settings),
    }
    activations = activations or tuple(d.activation for d in ck.settings.dense)
    layers = tuple(HeadLayer("dense", a) for a in activations)
    embed = jax.jit(encoder.embed_fn(ck.config, registry.get("native").bind(), "mean", layers))
    tokenizer = checkpoint.load_tokenizer(ck.folder)
    out = []
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=ck.settings.max_seq_len)["input_ids"]
        out.append(np.asarray(embed(params, np.array([ids], np.int32), np.array([len(ids)], np.int32)))[0])
    out = np.array(out)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_the_jitted_forward_runs_the_dense_modules_and_fails_without_the_activation(headed_checkpoint):
    texts = list(sample_texts(12).values())
    expected = reference(headed_checkpoint, texts)
    assert cosines(jitted_vectors(headed_checkpoint, texts), expected).min() >= 0.99999
    # The check can fail: without tanh the vectors are other vectors.
    assert cosines(jitted_vectors(headed_checkpoint, texts, ("identity", "identity")), expected).min() < 0.999


@pytest.mark.slow
def test_docbeam_run_gives_sentence_transformers_vectors_through_the_dense_modules(headed_checkpoint, tmp_path):
    ids, ours = docbeam_vectors(tmp_path, headed_checkpoint)
    texts = sample_texts(DOCS)
    expected = reference(headed_checkpoint, [texts[i] for i in ids])
    assert ours.shape == (DOCS, OUT)
    assert cosines(ours, expected).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["embedding_dim"] == OUT and summary["reuse_key"]["dense_digest"].startswith("sha256:")
    # An incremental run reuses these vectors: they are checked against the output's width (16), not the
    # encoder's hidden size (32).
    again = docbeam_run(
        tmp_path, headed_checkpoint, f"input.reuse_from={tmp_path / 'out'}", f"output.path={tmp_path / 'again'}"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["docs_reused"] == DOCS


def test_truncate_dim_and_the_dense_modules_are_reuse_key_fields():
    from docbeam.pipeline.stages.reuse import key_differences

    key = {"truncate_dim": None, "dense_digest": "sha256:aa"}
    assert key_differences(key, {**key, "truncate_dim": 8}) == ["truncate_dim: None then, 8 now"]
    assert key_differences(key, {**key, "dense_digest": "sha256:bb"}) == [
        "dense_digest: 'sha256:aa' then, 'sha256:bb' now"
    ]


@pytest.mark.slow
def test_model_truncate_dim_gives_sentence_transformers_matryoshka_vectors(headed_checkpoint, tmp_path):
    ids, ours = docbeam_vectors(tmp_path, headed_checkpoint, "model.truncate_dim=8")
    texts = [sample_texts(DOCS)[i] for i in ids]
    assert ours.shape == (DOCS, 8)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)  # normalised after the cut
    assert cosines(ours, reference(headed_checkpoint, texts, truncate_dim=8)).min() >= 0.99999
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["embedding_dim"] == 8 and summary["reuse_key"]["truncate_dim"] == 8


def test_the_checkpoints_truncate_dim_is_the_default(tmp_path, headed_checkpoint):
    from docbeam.config import ModelConfig
    from docbeam.models.heads.registry import resolve

    model = str(tmp_path / "model")
    shutil.copytree(headed_checkpoint, model)
    path = os.path.join(model, "config_sentence_transformers.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump({**cfg, "truncate_dim": 12}, f)

    def widths(**settings):
        head = resolve(ck, "auto", ModelConfig(path=model, **settings))
        return head.truncate_dim, head.dim

    ck = open_checkpoint(model)
    assert widths() == (12, 12)
    assert widths(truncate_dim=4) == (4, 4)
    assert widths(truncate_dim=None) == (None, OUT)


@pytest.mark.parametrize(
    "sets, st_truncate_dim, named",
    [
        (("model.truncate_dim=17",), None, "model.truncate_dim: 17 is larger than the model's 16-dimensional"),
        ((), 40, "model.truncate_dim: 40 (auto, from"),
    ],
)
def test_a_truncate_dim_wider_than_the_vector_exits_2_naming_the_key(
    tmp_path, headed_checkpoint, sets, st_truncate_dim, named
):
    model = str(tmp_path / "model")
    shutil.copytree(headed_checkpoint, model)
    if st_truncate_dim:
        path = os.path.join(model, "config_sentence_transformers.json")
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump({**cfg, "truncate_dim": st_truncate_dim}, f)
    result = docbeam_run(tmp_path, model, *sets)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "docbeam: cannot start:" in result.stderr and named in result.stderr
    assert not (tmp_path / "out").exists()


# --- fetched with the checkpoint ------------------------------------------------------------------------------


def dense_files(folder: str) -> list[str]:
    return sorted(os.path.relpath(p, folder) for p in glob.glob(os.path.join(folder, "*_Dense*", "*")))


@pytest.mark.gcs
@pytest.mark.slow
@pytest.mark.extra
def test_the_dense_modules_are_fetched_from_gcs_with_the_metadata(headed_checkpoint):
    from gcs_emulator import gcs_emulator
    from gcs_pipeline_test import upload_folder

    from docbeam.pipeline.store import storage

    storage.pipeline_options([])
    with gcs_emulator() as gcs:
        upload_folder(gcs, headed_checkpoint, "models/headed")
        planned = open_checkpoint(gcs.url("models", "headed"))
        layers = load_dense(planned.folder, planned.settings)
    assert dense_files(planned.folder) == dense_files(headed_checkpoint) != []
    assert planned.settings.width(HIDDEN) == OUT and len(layers) == 2
    assert not os.path.exists(os.path.join(planned.folder, "model.safetensors"))  # the encoder's: not for planning


@pytest.mark.slow
def test_the_dense_modules_are_fetched_from_the_hub(headed_checkpoint, tmp_path):
    import hashlib
    import subprocess
    import sys

    from hub_server import hub_server, repo_from_folder
    from hub_test import hub_env

    commit = hashlib.sha1(b"docbeam/headed").hexdigest()
    script = (
        "import json, sys; from models.checkpoint import open_checkpoint; ck = open_checkpoint(sys.argv[1]); "
        "print(json.dumps([ck.folder, [d.out_features for d in ck.settings.dense]]))"
    )
    with hub_server({"docbeam/headed": repo_from_folder(headed_checkpoint, commit)}) as hub:
        # A subprocess on purpose: huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT when it is imported.
        result = subprocess.run(
            [sys.executable, "-c", script, "hf://docbeam/headed@main"],
            capture_output=True,
            text=True,
            timeout=300,
            env=hub_env(tmp_path, hub.url),
        )
    assert result.returncode == 0, result.stderr[-3000:]
    folder, widths = json.loads(result.stdout.splitlines()[-1])
    assert widths == [MIDDLE, OUT] and dense_files(folder) == dense_files(headed_checkpoint) != []

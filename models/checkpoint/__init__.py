"""Hugging Face checkpoints (config.json, model.safetensors, tokenizer files) → EncoderConfig + Flax params.

The package's modules each read one part: finding the files (a local folder, ``gs://``, ``hf://``, ``pkg:``)
is source.py's, the tokenizer tokenizer.py's, sentence-transformers' files sentence_transformers/'s, the weights
held against config.json weights_check.py's (reading the header where it lies: weights_file.py), a ``torch.save``
file's tensors torch_tensors.py's. Here the config is read into its family's Config and the weights converted into
its Flax parameters. No torch. The names callers use from those modules are re-exported, so
``from models.checkpoint import ...`` keeps one address.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

from docbeam.models.checkpoint.sentence_transformers.multivector import is_multi_vector, multi_vector_settings
from docbeam.models.checkpoint.sentence_transformers.settings import ModelSettings, model_settings, read_json
from docbeam.models.checkpoint.source import (
    HubId,
    hub_revision,
    parse_hub_id,
    pinned_path,
    refuse_pickle_in,
    resolve_dir,
    weights_digest,
)
from docbeam.models.checkpoint.tokenizer import TOKENIZER_FILES, FastTokenizer, load_tokenizer, tokenizer_digest
from docbeam.models.checkpoint.weights_check import check_weights
from docbeam.models.checkpoint.weights_file import weights_to_check
from docbeam.models.families import family_of, family_of_config
from docbeam.models.families.encoder_config import CheckpointError, EncoderConfig, HubConfig
from docbeam.models.families.tensors import Tensors
from docbeam.models.precision import precision_of, prepare_params

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "FastTokenizer",
    "HubId",
    "ModelSettings",
    "TOKENIZER_FILES",
    "dense_digest",
    "encoder_config",
    "hub_revision",
    "load_dense",
    "load_params",
    "load_tokenizer",
    "open_checkpoint",
    "parse_hub_id",
    "pinned_path",
    "resolve_dir",
    "tokenizer_digest",
    "weights_digest",
]


def encoder_config(folder: str, dtype: str = "float32", task: str | None = None) -> EncoderConfig:
    """config.json → the config of its family (models/families/), read from the Hub's keys or transformers 5's;
    ``task`` (model.task) picks one of a multi-task checkpoint's adapters (None: its default)."""
    hf = read_json(folder, "config.json")
    if hf is None:
        raise CheckpointError(f"model.path: no config.json in {folder}; expected a Hugging Face checkpoint folder")
    where = f"{folder}/config.json"
    if not isinstance(hf, dict):
        raise CheckpointError(
            f"model.path: {where} holds a JSON {type(hf).__name__}, not an object of the "
            "model's settings; copy the checkpoint's own config.json"
        )
    family = family_of_config(hf, where)
    try:
        config = family.read_config(HubConfig(hf, where).check_numbers(), dtype)
    except (ValueError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(
            f"model.path: {where} describes no model docbeam can build: {e}; copy the checkpoint's own config.json"
        ) from None
    if hasattr(family, "with_task"):
        return family.with_task(config, task, where)
    if task is not None:
        raise CheckpointError(
            f"model.task: {task!r} is set, but {where} (model_type {hf.get('model_type')!r}) "
            "has no task adapters; leave model.task out"
        )
    return config


def load_params(folder: str, config: EncoderConfig) -> dict:
    """safetensors (Hugging Face names, torch [out, in] layout) → the family's Flax parameter tree, its
    projections' weights in the config's precision (models/precision.py)."""
    from safetensors.numpy import load_file

    path = os.path.join(folder, "model.safetensors")
    if not os.path.exists(path):
        refuse_pickle_in(folder)
        raise CheckpointError(f"model.path: no model.safetensors in {folder}")
    family = family_of(config)
    # bfloat16 or int8 weights are made here, once, from the float32 ones (no export step).
    return prepare_params(
        family.read_params(Tensors(load_file(path), family.PREFIXES, path), config), precision_of(config.dtype)
    )


def load_dense(folder: str, settings: ModelSettings) -> tuple[dict, ...]:
    """Each Dense module's safetensors → ``{"kernel": [in, out], "bias": [out]}`` in float32 (zeros for a
    module without bias), in the order they run."""
    import numpy as np
    from safetensors.numpy import load_file

    layers = []
    for dense in settings.dense:
        path = os.path.join(folder, dense.path, "model.safetensors")
        if not os.path.exists(path):
            refuse_pickle_in(os.path.join(folder, dense.path))
            raise CheckpointError(
                f"model.path: the Dense module {dense.path!r} has no model.safetensors in "
                f"{folder}/{dense.path} (docbeam never loads pickle weights: save it with "
                "safe_serialization=True)"
            )
        tensors = load_file(path)
        kernel = tensors.get("linear.weight")
        if kernel is None or kernel.shape != (dense.out_features, dense.in_features):
            raise CheckpointError(
                f"model.path: {path} holds no linear.weight of shape "
                f"[{dense.out_features}, {dense.in_features}] (its config.json's out_features, "
                f"in_features); keys: {sorted(tensors)}"
            )
        bias = tensors.get("linear.bias") if dense.bias else None
        if dense.bias and (bias is None or bias.shape != (dense.out_features,)):
            raise CheckpointError(
                f"model.path: {path} holds no linear.bias of shape [{dense.out_features}], "
                "but its config.json sets bias: true"
            )
        layers.append(
            {
                "kernel": np.ascontiguousarray(kernel.T, np.float32),
                "bias": np.zeros(dense.out_features, np.float32) if bias is None else bias.astype(np.float32),
            }
        )
    return tuple(layers)


def dense_digest(folder: str, settings: ModelSettings) -> str | None:
    """Of the Dense modules' config.json and weights as they are (part of the reuse key); None without any."""
    if not settings.dense:
        return None
    digest = hashlib.sha256()
    for dense in settings.dense:
        for name in ("config.json", "model.safetensors"):
            path = os.path.join(folder, dense.path, name)
            digest.update(f"{dense.path}/{name}".encode() + b"\0")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    digest.update(hashlib.sha256(f.read()).digest())
    return f"sha256:{digest.hexdigest()}"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    folder: str
    config: EncoderConfig
    settings: ModelSettings


def open_checkpoint(
    path: str, dtype: str = "float32", with_weights: bool = False, task: str | None = None
) -> Checkpoint:
    """Config and settings (cheap: what the driver needs to plan); ``with_weights`` also makes the weights
    local, for ``load_params``; ``task``: model.task (encoder_config)."""
    folder = resolve_dir(path, with_weights)
    if not os.path.isdir(folder):
        raise CheckpointError(f"model.path {path!r}: {folder} is not a folder")
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise CheckpointError(
            f"model.path {path!r} holds no config.json; expected a Hugging Face checkpoint "
            "(config.json, model.safetensors, tokenizer files)"
        )
    config = encoder_config(folder, dtype, task)
    weights, sample = weights_to_check(path, folder, with_weights)
    if weights is not None:
        check_weights(
            weights,
            family_of(config),
            config,
            read_json(folder, "config.json"),
            os.path.join(folder, "config.json"),
            sample,
        )
    # A MultiVectorEncoder's modules are not a SentenceTransformer's (sentence_transformers/multivector.py).
    settings = (multi_vector_settings if is_multi_vector(folder) else model_settings)(folder, config)
    return Checkpoint(folder=folder, config=config, settings=settings)

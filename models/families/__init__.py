"""Model families: one file each (its config keys, its Flax module built from models/families/blocks.py,
its tensor names), and here the one table that picks a family from config.json's ``model_type``.

A family module exposes ``Config`` (an EncoderConfig), ``Model`` (a blocks.FamilyModel: a Flax module taking
the config and an AttentionFn), ``PREFIXES`` (model prefixes a task head's tensors carry),
``read_config(HubConfig, dtype)`` and ``read_params(Tensors, config)``.
"""
from __future__ import annotations

from types import ModuleType

from docbeam.models.families import bert, gte, modernbert, mpnet, nomic, qwen3, roberta
from docbeam.models.families import distilbert, eurobert
from docbeam.models.families.config import CheckpointError

MODEL_TYPES: dict[str, ModuleType] = {  # config.json model_type → family
    "bert": bert,
    "roformer": bert,
    "xlm-roberta": roberta,
    "roberta": roberta,
    "camembert": roberta,
    "modernbert": modernbert,
    "mpnet": mpnet,
    "gte": gte,
    "nomic_bert": nomic,
    "new": gte,  # GTE on the Hub (remote code there; docbeam reads only config.json and safetensors)
    "qwen3": qwen3,
    "qwen2": qwen3,  # Qwen3's code without the q/k norms, with biased q/k/v (gte-Qwen2)
    "llama": qwen3,  # Qwen2 without its q/k/v biases (llama-embed-nemotron)
    "mistral": qwen3,  # Llama; its sliding window refused
    "llama_bidirec": qwen3,  # NVIDIA's bidirectional Llama (llama-embed-nemotron; remote code there)
    "eurobert": eurobert,
    "distilbert": distilbert,
}


def family_for(model_type: str, where: str) -> ModuleType:
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"model.path: model_type {model_type!r} in {where} is not supported; supported: "
                              f"{', '.join(MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def family_of(config) -> ModuleType:
    """The family whose Config the config is (the most derived one: roberta.Config extends bert's)."""
    for family in MODEL_TYPES.values():
        if type(config) is family.Config:
            return family
    raise TypeError(f"{type(config).__name__} is no registered family's config")

"""Model families: one file each (its config keys, its Flax module built from models/families/blocks.py,
its tensor names), and here the one table that picks a family from config.json's ``model_type``.

A family module exposes ``Config`` (an EncoderConfig), ``Model`` (a blocks.FamilyModel: a Flax module taking
the config and an AttentionFn), ``PREFIXES`` (model prefixes a task head's tensors carry),
``read_config(HubConfig, dtype)`` and ``read_params(Tensors, config)``; a family with task adapters (Jina v3)
also ``with_task(config, task, where)``, which takes model.task.
"""

from __future__ import annotations

from types import ModuleType

from docbeam.models.families import (
    bert,
    deberta,
    distilbert,
    embedding_gemma2,
    eurobert,
    gemma3,
    gte,
    jina,
    modernbert,
    mpnet,
    nomic,
    qwen3,
    roberta,
)
from docbeam.models.families.encoder_config import CheckpointError

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
    "jina_embeddings_v3": jina,
    "deberta-v2": deberta,  # DeBERTa-v2 and -v3
    "gemma3_text": gemma3,
    "embedding_gemma2_text": embedding_gemma2,
    "llama": qwen3,  # Qwen2 without its q/k/v biases (llama-embed-nemotron)
    "mistral": qwen3,  # Llama with a causal sliding window
    "llama_bidirec": qwen3,  # NVIDIA's bidirectional Llama (llama-embed-nemotron; remote code there)
    "eurobert": eurobert,
    "distilbert": distilbert,
}


def family_for(model_type: str, where: str) -> ModuleType:
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:  # a list or a number names no family
        raise CheckpointError(
            f"model.path: model_type {model_type!r} in {where} is not supported; supported: {', '.join(MODEL_TYPES)}"
        )
    return MODEL_TYPES[model_type]


def family_of_config(raw: dict, where: str) -> ModuleType:
    """The family a config.json describes: its ``model_type``, except Jina v3 on the Hub, which is ``xlm-roberta``
    (jinaai's remote code) with rotary positions: no XLM-R of the roberta family has those."""
    if raw.get("position_embedding_type") == "rotary" and raw.get("model_type", "xlm-roberta") == "xlm-roberta":
        return jina
    return family_for(raw.get("model_type", "bert"), where)


def family_of(config) -> ModuleType:
    """The family whose Config the config is (the most derived one: roberta.Config extends bert's)."""
    for family in MODEL_TYPES.values():
        if type(config) is family.Config:
            return family
    raise TypeError(f"{type(config).__name__} is no registered family's config")

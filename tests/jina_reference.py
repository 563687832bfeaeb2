"""A torch reference of jina-embeddings-v3's task adapters as the Hub's remote code runs them
(jinaai/xlm-roberta-flash-implementation, modeling_lora.py's LoRAParametrization), on transformers'
JinaEmbeddingsV3Model: every Linear and Embedding has one LoRA slice per task, applied unmerged
(``x·Wᵀ + b + scale·(x·Aᵀ)·Bᵀ``; an Embedding's ``E[ids] + scale·A[ids]·B``), scale = alpha / rank; and the
checkpoint written in the Hub's layout: ``roberta.`` before every name, q/k/v fused in ``mixer.Wqkv``, each
adapted weight as ``<module>.parametrizations.weight.original`` beside ``.0.lora_A`` and ``.0.lora_B``, whose
first axis is the task (``lora_adaptations``' order)."""

from __future__ import annotations

import contextlib

import numpy as np
from family_fixtures import tiny_model

TASKS = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")
INSTRUCTIONS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
    "separation": "",
    "classification": "",
    "text-matching": "",
}  # as the Hub's config.json has them
RANK, ALPHA = 4, 2.0  # scale 0.5 (the Hub ships alpha 1, rank 4): a merge without the scale is caught
LORA = ".parametrizations.weight"


def tiny_jina():
    return tiny_model(
        "JinaEmbeddingsV3Model",
        model_kwargs={"add_pooling_layer": False},
        num_hidden_layers=2,
        intermediate_size=64,
        type_vocab_size=1,
    )


def lora_targets(model) -> dict[str, list]:
    """Hub module name → [(transformers module, the rows of the Hub weight it computes)]: the Hub fuses q, k
    and v into one Wqkv whose single adapter the three share (A whole, B's rows split in three)."""
    D = model.config.hidden_size
    out = {
        "embeddings.word_embeddings": [(model.embeddings.word_embeddings, slice(None))],
        "embeddings.token_type_embeddings": [(model.embeddings.token_type_embeddings, slice(None))],
    }
    for i, layer in enumerate(model.layers):
        p, attn = f"encoder.layers.{i}", layer.self_attn
        out[f"{p}.mixer.Wqkv"] = [
            (attn.q_proj, slice(0, D)),
            (attn.k_proj, slice(D, 2 * D)),
            (attn.v_proj, slice(2 * D, 3 * D)),
        ]
        out[f"{p}.mixer.out_proj"] = [(attn.o_proj, slice(None))]
        out[f"{p}.mlp.fc1"] = [(layer.mlp.fc1, slice(None))]
        out[f"{p}.mlp.fc2"] = [(layer.mlp.fc2, slice(None))]
    return out


def random_adapters(model, seed: int = 1) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Hub module name → (lora_A, lora_B) in the Hub's shapes: a Linear [out, in] has A [tasks, rank, in] and
    B [tasks, out, rank]; an Embedding [rows, dim] has A [tasks, rows, rank] and B [tasks, rank, dim]. Drawn
    with std 0.3, so that each task moves the output."""
    import torch

    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.normal(0.0, 0.3, (len(TASKS), *shape)).astype(np.float32)  # noqa: E731
    out = {}
    for name, parts in lora_targets(model).items():
        module = parts[0][0]
        if isinstance(module, torch.nn.Embedding):
            out[name] = draw(module.num_embeddings, RANK), draw(RANK, module.embedding_dim)
        else:
            out[name] = draw(RANK, module.in_features), draw(sum(m.out_features for m, _ in parts), RANK)
    return out


@contextlib.contextmanager
def adapters_on(model, adapters: dict, task_index: int):
    """The model computes task ``task_index``'s LoRA beside its weights (forward hooks), as the Hub's
    ``lora_forward`` does with ``adapter_mask`` naming that task, until the block ends."""
    import torch

    scale, handles = ALPHA / RANK, []
    for name, parts in lora_targets(model).items():
        a, b = (torch.tensor(x[task_index]) for x in adapters[name])
        for module, rows in parts:
            embedding = isinstance(module, torch.nn.Embedding)
            handles.append(
                module.register_forward_hook(
                    embedding_lora(a, b, scale) if embedding else linear_lora(a, b[rows], scale)
                )
            )
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def linear_lora(a, b, scale):
    """A Linear's output plus ``scale·(x·Aᵀ)·Bᵀ``: the adapter beside the weight, never merged into it."""
    return lambda module, args, out: out + scale * (args[0] @ a.T) @ b.T


def embedding_lora(a, b, scale):
    """An Embedding's rows plus ``scale·A[ids]·B``."""
    import torch

    return lambda module, args, out: out + scale * torch.nn.functional.embedding(args[0], a) @ b


def hub_config(config: dict) -> dict:
    """transformers 5's config.json → the Hub's (jinaai's remote code reads these keys)."""
    kept = {k: v for k, v in config.items() if k not in ("rope_parameters", "model_type", "architectures")}
    return {
        **kept,
        "model_type": "xlm-roberta",
        "architectures": ["XLMRobertaLoRA"],
        "position_embedding_type": "rotary",
        "rotary_emb_base": 20000.0,
        "lora_adaptations": list(TASKS),
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout_p": 0.0,
        "load_trained_adapters": True,
        "task_instructions": INSTRUCTIONS,
        "use_flash_attn": True,
    }


def hub_tensors(tensors: dict, adapters: dict) -> dict:
    """transformers 5 saves the Hub's module names (emb_ln, mixer.Wqkv, norm1, ...): add ``roberta.``, each
    adapted weight's parametrization names, and the pooler the Hub's checkpoint carries (unused for embeddings)."""
    out = {}
    for name, value in tensors.items():
        module = name.removesuffix(".weight")
        if module in adapters:
            a, b = adapters[module]
            out.update(
                {
                    f"roberta.{module}{LORA}.original": value,
                    f"roberta.{module}{LORA}.0.lora_A": a,
                    f"roberta.{module}{LORA}.0.lora_B": b,
                }
            )
        else:
            out[f"roberta.{name}"] = value
    D = tensors["emb_ln.weight"].shape[0]
    out.update(
        {
            f"roberta.pooler.dense{LORA}.original": np.eye(D, dtype=np.float32),
            "roberta.pooler.dense.bias": np.zeros(D, np.float32),
        }
    )
    return out


def write_hub_st_files(folder: str) -> str:
    """The sentence-transformers files the Hub's checkpoint ships: its task-routing Transformer (custom_st.py),
    mean pooling, Normalize, and each task's instruction as a prompt."""
    import json
    import os

    st = "sentence_transformers.models"
    modules = [
        {"idx": 0, "name": "transformer", "path": "", "type": "custom_st.Transformer", "kwargs": ["task"]},
        {"idx": 1, "name": "pooler", "path": "1_Pooling", "type": f"{st}.Pooling"},
        {"idx": 2, "name": "normalizer", "path": "2_Normalize", "type": f"{st}.Normalize"},
    ]
    pooling = {
        "word_embedding_dimension": 32,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    st_config = {
        "__version__": {"sentence_transformers": "3.1.0"},
        "prompts": INSTRUCTIONS,
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    for name, value in (
        ("modules.json", modules),
        ("1_Pooling/config.json", pooling),
        ("config_sentence_transformers.json", st_config),
    ):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(value, f)
    return folder

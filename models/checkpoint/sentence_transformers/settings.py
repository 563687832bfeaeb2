"""sentence-transformers' files in a checkpoint folder → ModelSettings (window, pooling, normalisation, prompts,
Dense modules, truncation). Each file's keys are first checked against keys.py's classification (beside it)
(honoured, harmless, or refused), so a setting is never silently ignored; what is honoured is read here.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from docbeam.models.checkpoint.sentence_transformers.keys import (
    MODULES,
    POOLING_FLAGS,
    ST_CONFIG,
    TRANSFORMER_CONFIG,
    check_keys,
    read_json,
)
from docbeam.models.families.encoder_config import CheckpointError

# The sentence-transformers modules docbeam reproduces, in the order it runs them; any other (LayerNorm, ...)
# changes the embedding.
SUPPORTED_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
# A SparseEncoder's (SPLADE: models/heads/sparse.py): the masked-LM logits, then log(1 + relu) pooled over tokens.
SPARSE_MODULES = ("MLMTransformer", "SpladePooling")
# Modules of other sparse models, refused with what they are (docbeam runs neither).
WHY_NOT_MODULE = {
    "SparseStaticEmbedding": "inference-free SPLADE's per-token IDF weights (its Router's document side) are not run",
    "SparseAutoEncoder": "a CSR sparse autoencoder is not run",
    "Router": "a Router sends queries and documents through different modules, which docbeam does not run",
}
# A Dense module's activation_function (sentence-transformers saves the class's full name) → docbeam's name.
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
SUPPORTED_POOLING = ("mean", "cls", "lasttoken")
# encode_document's choice when the caller names no prompt: the first of these the checkpoint defines, else
# its default_prompt_name (sentence_transformers/sentence_transformer/model.py, 6.2.0).
DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")
# jina-embeddings-v3's own module (its custom_st.py): sentence-transformers' Transformer, tokenizing as it does,
# that routes encode's ``task`` to the checkpoint's adapters; model.task does that here (models/families/jina.py).
TASK_TRANSFORMER = {"type": "custom_st.Transformer", "kwargs": ["task"]}


@dataclasses.dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers Dense module: ``activation(x @ W.T + b)`` on each pooled vector."""

    path: str  # its folder inside the checkpoint, holding config.json and model.safetensors
    in_features: int
    out_features: int
    bias: bool
    activation: str  # "identity" | "tanh"


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """What the checkpoint folder says about windows, pooling and prompts (sentence-transformers' files if
    present)."""

    max_seq_len: int
    pooling: str  # "mean" | "cls" | "lasttoken"
    normalize: bool
    prompts: tuple[tuple[str, str], ...] = ()  # (name, text) as config_sentence_transformers.json lists them
    document_prompt_name: str | None = None  # the prompt encode_document applies when none is named
    include_prompt: bool = True  # the Pooling module pools the prompt's tokens
    dense: tuple[DenseModule, ...] = ()  # applied in order to every pooled window
    truncate_dim: int | None = None  # config_sentence_transformers.json's: the default of model.truncate_dim
    splade: tuple[str, str] | None = None  # a SparseEncoder's SpladePooling: (pooling_strategy, activation_function)
    token_mask: Any = None  # a MultiVectorEncoder's (multivector.py TokenMask); None for other models

    def width(self, hidden_size: int) -> int:
        """The pooled vector's width after the Dense modules (before any truncation)."""
        return self.dense[-1].out_features if self.dense else hidden_size

    def prompt_text(self, name: str) -> str:
        return dict(self.prompts)[name]


def model_settings(folder: str, config) -> ModelSettings:
    """sentence-transformers' settings decide window length, pooling, normalisation and prompts when present;
    a setting docbeam cannot honour is refused rather than replaced by a default (other embeddings)."""
    st = read_json(folder, TRANSFORMER_CONFIG) or {}
    modules = sentence_transformers_modules(folder, task_adapters=bool(getattr(config, "tasks", ())))
    splade = splade_pooling(folder, modules)
    check_keys(folder, TRANSFORMER_CONFIG, "MLMTransformer" if splade else TRANSFORMER_CONFIG, st)
    max_len = st.get("max_seq_length") or _tokenizer_max_len(folder) or config.max_position
    max_len = min(max_len, config.max_position) if config.position == "absolute" else max_len
    normalize = any(kind == "Normalize" for kind, _ in modules)
    pooling, include_prompt = pooling_mode(folder, modules, config.output_size, default_pooling(config))
    prompts, document_prompt = prompt_settings(
        folder, ("SparseEncoder",) if splade else ("SentenceTransformer", "MultiVectorEncoder")
    )
    task = getattr(config, "task", None)  # Jina v3: the task's instruction goes first, as its encode(task=) puts it
    if task is not None and config.instruction is not None:
        prompts, document_prompt = ((task, config.instruction),) + tuple(p for p in prompts if p[0] != task), task
    dense = dense_modules(folder, modules, config.output_size)
    truncate_dim = (read_json(folder, ST_CONFIG) or {}).get("truncate_dim")
    if truncate_dim is not None and (
        not isinstance(truncate_dim, int) or isinstance(truncate_dim, bool) or truncate_dim < 1
    ):
        raise CheckpointError(
            f"model.path: {folder}/{ST_CONFIG} sets truncate_dim: {json.dumps(truncate_dim)}; "
            "expected a positive number of dimensions or null"
        )
    return ModelSettings(
        max_seq_len=int(max_len),
        pooling=pooling,
        normalize=normalize,
        prompts=prompts,
        document_prompt_name=document_prompt,
        include_prompt=include_prompt,
        dense=dense,
        truncate_dim=truncate_dim,
        splade=splade,
    )


def splade_pooling(folder: str, modules: list[tuple[str, dict]]) -> tuple[str, str] | None:
    """A SparseEncoder's SpladePooling (pooling_strategy, activation_function), or None for a dense model."""
    path = next((m.get("path") for kind, m in modules if kind == "SpladePooling"), None)
    if path is None:
        return None
    name = f"{path}/config.json"
    cfg = read_json(folder, name)
    if cfg is None:
        raise CheckpointError(
            f"model.path: {folder}/{MODULES} lists a SpladePooling module at {path!r}, but {name} "
            "is missing; docbeam reads its pooling_strategy and activation_function from it"
        )
    check_keys(folder, name, "SpladePooling", cfg)
    strategy, activation = cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu")
    if strategy not in ("max", "sum") or activation not in ("relu", "log1p_relu"):
        raise CheckpointError(
            f"model.path: {folder}/{name} sets pooling_strategy: {json.dumps(strategy)} and "
            f"activation_function: {json.dumps(activation)}; SpladePooling pools by max or sum "
            "after relu or log1p_relu"
        )
    return strategy, activation


def dense_modules(
    folder: str, modules: list[tuple[str, dict]], hidden_size: int, keys: str = "Dense"
) -> tuple[DenseModule, ...]:
    """The Dense modules in modules.json's order, each reading the width the one before it writes (``keys``
    TokenDense: a MultiVectorEncoder's, on every token, checked as such)."""
    out, width = [], hidden_size
    for kind, module in modules:
        if kind != "Dense":
            continue
        name = f"{module.get('path')}/config.json"
        cfg = read_json(folder, name)
        if cfg is None:
            raise CheckpointError(
                f"model.path: {folder}/{MODULES} lists a Dense module at {module.get('path')!r}, "
                f"but {name} is missing; docbeam reads its shape and activation from it"
            )
        check_keys(folder, name, keys, cfg)
        activation = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
        if activation not in DENSE_ACTIVATIONS:
            raise CheckpointError(
                f"model.path: {folder}/{name} sets activation_function: {json.dumps(activation)}, "
                f"which docbeam does not run (it runs {', '.join(DENSE_ACTIVATIONS)}), so its "
                "embeddings would not be this model's; use a checkpoint without that module"
            )
        if cfg.get("in_features") != width or not isinstance(cfg.get("out_features"), int):
            raise CheckpointError(
                f"model.path: {folder}/{name} sets in_features: {cfg.get('in_features')} and "
                f"out_features: {cfg.get('out_features')}, but the vector reaching it has {width} "
                "dimensions; the Dense module belongs to another model"
            )
        width = cfg["out_features"]
        out.append(
            DenseModule(
                path=module["path"],
                in_features=cfg["in_features"],
                out_features=width,
                bias=bool(cfg.get("bias", True)),
                activation=DENSE_ACTIVATIONS[activation],
            )
        )
    return tuple(out)


def prompt_settings(
    folder: str, model_types: tuple[str, ...] = ("SentenceTransformer", "MultiVectorEncoder")
) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """The checkpoint's prompts and the one its documents get: what sentence-transformers' ``encode_document``
    applies when no prompt is named (the first of document, passage, corpus it defines, else
    ``default_prompt_name``). docbeam embeds documents, so a default_prompt_name of ``query`` does not apply."""
    cfg = read_json(folder, ST_CONFIG) or {}
    check_keys(folder, ST_CONFIG, ST_CONFIG, cfg)
    if cfg.get("model_type", "SentenceTransformer") not in model_types:
        raise CheckpointError(
            f"model.path: {folder}/{ST_CONFIG} sets model_type: {cfg['model_type']!r}, but its "
            f"{MODULES} makes a {' or '.join(model_types)}; docbeam runs SentenceTransformer "
            "(dense), MultiVectorEncoder and SparseEncoder (MLMTransformer + SpladePooling) "
            "models, not cross encoders"
        )
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise CheckpointError(
            f"model.path: {folder}/{ST_CONFIG} sets prompts: {json.dumps(prompts)}; expected a "
            'mapping of prompt names to texts, e.g. {"query": "query: ", "document": "passage: "}'
        )
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise CheckpointError(
            f"model.path: {folder}/{ST_CONFIG} sets default_prompt_name: {default!r}, which is not "
            f"among its prompts {sorted(prompts)}"
        )
    document = next((name for name in DOCUMENT_PROMPT_NAMES if name in prompts), default)
    return tuple(prompts.items()), document


def sentence_transformers_modules(
    folder: str, task_adapters: bool = False, supported: tuple[str, ...] = SUPPORTED_MODULES
) -> list[tuple[str, dict]]:
    """(class name, entry) per module in modules.json; a module docbeam does not run is a CheckpointError.
    ``task_adapters``: the model has task adapters, so Jina's task-routing Transformer is run as one.
    ``supported``: the modules docbeam runs, in their order (a MultiVectorEncoder's: multivector.py)."""
    modules = read_json(folder, MODULES) or []
    out = []
    for module in modules:
        if task_adapters and {k: module.get(k) for k in TASK_TRANSFORMER} == TASK_TRANSFORMER:
            out.append(("Transformer", {k: v for k, v in module.items() if k != "kwargs"}))
            continue
        module_type = str(module.get("type", ""))
        kind = module_type.rsplit(".", 1)[-1]
        if kind in WHY_NOT_MODULE:
            raise CheckpointError(
                f"model.path: {folder}/{MODULES} lists module {module.get('name')!r} of type "
                f"{module_type!r}: {WHY_NOT_MODULE[kind]}; use a checkpoint without it"
            )
        if kind not in supported + SPARSE_MODULES or not module_type.startswith("sentence_transformers."):
            raise CheckpointError(
                f"model.path: {folder}/{MODULES} lists module {module.get('name')!r} of type "
                f"{module.get('type')!r} (path {module.get('path')!r}), which docbeam does not run: it runs only "
                f"sentence-transformers' {', '.join(supported)}, so its embeddings would not be this "
                "model's; use a checkpoint without that module"
            )
        check_keys(folder, MODULES, MODULES, module)
        out.append((kind, module))
    if any(kind in SPARSE_MODULES for kind, _ in out):
        if [kind for kind, _ in out] not in (list(SPARSE_MODULES), ["Transformer", "SpladePooling"]):
            raise CheckpointError(
                f"model.path: {folder}/{MODULES} lists the modules {[kind for kind, _ in out]}; "
                "docbeam runs a SparseEncoder only as MLMTransformer then SpladePooling"
            )
        return out
    order = [supported.index(kind) for kind, _ in out]
    if order != sorted(order):
        raise CheckpointError(
            f"model.path: {folder}/{MODULES} lists its modules in the order "
            f"{[kind for kind, _ in out]}; docbeam runs them only as "
            f"{', '.join(k + '...' if k == 'Dense' else k for k in supported)}, so its embeddings "
            "would not be this model's"
        )
    return out


def default_pooling(config) -> str:
    """The pooling of a checkpoint without a Pooling module: the last token for a causal model (a decoder's
    only token that has seen its whole window: Qwen3-Embedding, gte-Qwen2), the mean for the rest."""
    return "lasttoken" if any(f.causal for f in config.attention_features) else "mean"


def pooling_mode(
    folder: str, modules: list[tuple[str, dict]], hidden_size: int | None = None, default: str = "mean"
) -> tuple[str, bool]:
    """``mean``, ``cls`` or ``lasttoken`` from the Pooling module's config.json (``default`` when the checkpoint
    has none), and its ``include_prompt``."""
    path = next((m.get("path") or "1_Pooling" for kind, m in modules if kind == "Pooling"), "1_Pooling")
    name = f"{path}/config.json"
    pooling_cfg = read_json(folder, name)
    if pooling_cfg is None:
        if any(kind == "Pooling" for kind, _ in modules):
            raise CheckpointError(
                f"model.path: {folder}/modules.json lists a Pooling module at {path!r}, but "
                f"{name} is missing; docbeam reads the pooling mode from it"
            )
        return default, True
    check_keys(folder, name, "Pooling", pooling_cfg)
    dimension = pooling_cfg.get("embedding_dimension", pooling_cfg.get("word_embedding_dimension"))
    if hidden_size is not None and dimension is not None and dimension != hidden_size:
        raise CheckpointError(
            f"model.path: {folder}/{name} sets embedding_dimension: {dimension}, but the model's "
            f"hidden_size is {hidden_size}; the Pooling module belongs to another model"
        )
    if "pooling_mode" in pooling_cfg:  # sentence-transformers >= 5: a mode name, or a list to concatenate
        mode = pooling_cfg["pooling_mode"]
        modes, settings = ([mode] if isinstance(mode, str) else list(mode)), f"pooling_mode: {mode!r}"
    else:
        flags = [flag for flag in POOLING_FLAGS if pooling_cfg.get(flag)]
        modes, settings = [POOLING_FLAGS[f] for f in flags], ", ".join(f"{f}: true" for f in flags)
    if len(modes) != 1 or modes[0] not in SUPPORTED_POOLING:
        raise CheckpointError(
            f"model.path: {folder}/{name} (the Pooling module) sets {settings or 'no pooling mode'}; docbeam pools "
            f"by exactly one of {', '.join(SUPPORTED_POOLING)}, so its embeddings would not be this model's"
        )
    return modes[0], bool(pooling_cfg.get("include_prompt", True))


def _tokenizer_max_len(folder: str) -> int | None:
    config = read_json(folder, "tokenizer_config.json") or {}
    value = config.get("model_max_length") if isinstance(config, dict) else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise CheckpointError(
            f"model.path: {folder}/tokenizer_config.json sets model_max_length: {json.dumps(value)[:60]}; it must "
            "be a number; write it again, or copy the checkpoint's own"
        )
    return int(value) if value and 1 <= value < 1_000_000 else None


def document_prompt(settings: ModelSettings, choice, folder: str) -> str | None:
    """The text put in front of every document for ``model.prompt`` = ``choice`` (None: no prompt). ``auto``
    is the checkpoint's document prompt; a name must be one of its prompts; ``{text: ...}`` is used as written.
    An empty prompt is no prompt, as in sentence-transformers."""
    names = [name for name, _ in settings.prompts]
    if choice is None:
        text = None
    elif choice == "auto":
        text = settings.prompt_text(settings.document_prompt_name) if settings.document_prompt_name else None
    elif isinstance(choice, str):
        if choice not in names:
            where = (
                f"{folder}/{ST_CONFIG} defines {names}"
                if names
                else f"{folder} defines no prompts (no prompts in {ST_CONFIG})"
            )
            raise CheckpointError(
                f"model.prompt: {choice!r} is not a prompt of this checkpoint: {where}; name one of "
                'those, give a text of your own as {text: "passage: "}, or write null for none'
            )
        text = settings.prompt_text(choice)
    else:
        text = choice.text
    if text and not settings.include_prompt:
        raise CheckpointError(
            f"model.path: {folder}'s Pooling module config.json sets include_prompt: false (pool "
            f"without the prompt's tokens), which docbeam does not reproduce; with model.prompt "
            f"giving {text!r} its embeddings would not be this model's; set model.prompt: null "
            "only if the model is meant to run without its prompt"
        )
    return text or None

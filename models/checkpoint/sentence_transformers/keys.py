"""Which keys of sentence-transformers' files docbeam honours, finds harmless, or refuses (settings.py
reads the honoured ones into ModelSettings).

Every key sentence-transformers 6.2.0 reads or writes in these files is classified below as honoured (docbeam
reproduces it), harmless (it does not change the vectors of documents) or refused; a refused value, and any key
not listed, is a CheckpointError naming the file and key, so a setting is never silently ignored:

- ``config_sentence_transformers.json``: honoured ``prompts``, ``default_prompt_name``, ``model_type``
  (``SentenceTransformer``; ``MultiVectorEncoder``, whose modules multivector.py reads); harmless
  ``__version__``, ``similarity_fn_name`` (how vectors are compared, not made), ``requirements``
  (sentence-transformers' own environment check); honoured ``truncate_dim`` (the default of
  ``model.truncate_dim``: Matryoshka vectors cut to their first N dimensions).
- ``modules.json``: entries ``idx``, ``name``, ``path``, ``type`` (sentence-transformers' Transformer, Pooling,
  any number of Dense, Normalize, in that order); ``kwargs`` (encode arguments routed to a module) refused unless
  empty, but for jina-embeddings-v3's task-routing Transformer in a checkpoint with task adapters
  (settings.py TASK_TRANSFORMER: ``model.task`` is that routing).
- a Dense module's ``config.json``: honoured ``in_features``, ``out_features``, ``bias``,
  ``activation_function`` (``torch.nn.modules.linear.Identity`` or ``torch.nn.modules.activation.Tanh``);
  refused unless at their defaults ``module_input_name`` / ``module_output_name`` (sentence_embedding),
  ``use_residual`` (false). Its weights are read from its folder's model.safetensors (never a pickle).
- the Pooling module's ``config.json``: honoured ``pooling_mode`` (or the ``pooling_mode_*`` flags before v5),
  ``include_prompt`` (false is refused when a prompt applies: docbeam pools the prompt's tokens like any other);
  ``embedding_dimension`` / ``word_embedding_dimension`` checked against the model's hidden size.
- ``sentence_bert_config.json`` (the Transformer module): honoured ``max_seq_length``; harmless ``unpad_inputs``
  (a speed setting); refused unless at their defaults ``do_lower_case`` (false), ``transformer_task``
  (feature-extraction), ``modality_config`` (text through forward's last_hidden_state), ``module_output_name``
  (token_embeddings), ``processing_kwargs`` (empty), ``query_length``, ``document_length``,
  ``query_expansion`` (null); ``model_args``, ``tokenizer_args``, ``config_args`` (before v5; and v5's
  ``model_kwargs``, ``processor_kwargs``, ``config_kwargs``) harmless when they hold at most
  ``trust_remote_code`` (docbeam runs its own code for each family, never the repository's), else refused.
"""

from __future__ import annotations

import json
import os
from typing import Any

from docbeam.models.families.encoder_config import CheckpointError

ST_CONFIG = "config_sentence_transformers.json"
MODULES = "modules.json"
TRANSFORMER_CONFIG = "sentence_bert_config.json"
POOLING_FLAGS = {  # the 1_Pooling/config.json flags of sentence-transformers before v5, and the mode each means
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ANY = object()  # a harmless key: any value
# file → key → the only value docbeam reproduces (_ANY: any value is harmless); keys docbeam reads itself
# (prompts, pooling_mode, max_seq_length, ...) are checked where they are read and listed in HONOURED.
DEFAULTS: dict[str, dict[str, Any]] = {
    ST_CONFIG: {"__version__": _ANY, "similarity_fn_name": _ANY, "requirements": _ANY},
    MODULES: {"kwargs": []},
    "Pooling": {},
    "Dense": {
        "module_input_name": "sentence_embedding",
        "module_output_name": "sentence_embedding",
        "use_residual": False,
    },
    "TokenDense": {
        "module_input_name": "token_embeddings",
        "module_output_name": "token_embeddings",
        "use_residual": False,
    },  # a MultiVectorEncoder's Dense: on every token (multivector.py)
    TRANSFORMER_CONFIG: {
        "unpad_inputs": _ANY,
        "do_lower_case": False,
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings",
        "processing_kwargs": {},
        "query_length": None,
        "document_length": None,
        "query_expansion": None,
    },
}
# A SparseEncoder's MLMTransformer: the masked-LM head's logits per token (models/heads/sparse.py runs it).
DEFAULTS["MLMTransformer"] = {
    **DEFAULTS[TRANSFORMER_CONFIG],
    "transformer_task": "fill-mask",
    "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
}
DEFAULTS["SpladePooling"] = {"embedding_dimension": _ANY, "word_embedding_dimension": _ANY, "chunk_size": _ANY}
# from_pretrained arguments a Transformer module may carry, and the ones that do not change the vectors.
LOADING_KWARGS = ("model_args", "tokenizer_args", "config_args", "model_kwargs", "processor_kwargs", "config_kwargs")
HARMLESS_LOADING_KWARGS = {"trust_remote_code"}
HONOURED = {
    ST_CONFIG: ("prompts", "default_prompt_name", "model_type", "truncate_dim"),
    MODULES: ("idx", "name", "path", "type"),
    "Pooling": ("pooling_mode", *POOLING_FLAGS, "include_prompt", "embedding_dimension", "word_embedding_dimension"),
    TRANSFORMER_CONFIG: ("max_seq_length",),
    "MLMTransformer": ("max_seq_length",),
    "SpladePooling": ("pooling_strategy", "activation_function"),
    "Dense": ("in_features", "out_features", "bias", "activation_function"),
    "TokenDense": ("in_features", "out_features", "bias", "activation_function"),
}
WHY_REFUSED = {
    "kwargs": "docbeam passes no arguments to modules",
    "do_lower_case": "docbeam does not lowercase text",
    "processing_kwargs": "docbeam tokenizes with the tokenizer's own settings",
    "transformer_task": "docbeam runs the encoder's hidden states",
    **{
        key: "docbeam loads the checkpoint as its files are (only trust_remote_code is harmless here)"
        for key in LOADING_KWARGS
    },
}


def _count(value) -> bool:
    return type(value) is int and value >= 1


def _optional(check):
    return lambda value: value is None or check(value)


# What each key docbeam reads from sentence-transformers' files must be, and how to say it: a file of another shape
# is refused here, naming the file and key, before any reader indexes it (a max_seq_length of "256" had been a
# TypeError deep in the plan).
_KINDS = {
    "a whole number of at least 1": _count,
    "a whole number of at least 1, or null": _optional(_count),
    "a string": lambda v: isinstance(v, str),
    "a string, or null": _optional(lambda v: isinstance(v, str)),
    "true or false": lambda v: isinstance(v, bool),
    "an object of names to prompt strings": lambda v: (
        isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, str) for k, t in v.items())
    ),
    "a whole number": lambda v: type(v) is int,
    "a string or a list of strings": lambda v: (
        isinstance(v, str) or isinstance(v, list) and all(isinstance(m, str) for m in v)
    ),
}
KEY_KINDS = {
    "max_seq_length": "a whole number of at least 1, or null",
    "document_length": "a whole number of at least 1, or null",
    "query_length": "a whole number of at least 1, or null",
    "truncate_dim": "a whole number of at least 1, or null",
    "embedding_dimension": "a whole number of at least 1, or null",
    "word_embedding_dimension": "a whole number of at least 1, or null",
    "in_features": "a whole number of at least 1",
    "out_features": "a whole number of at least 1",
    "model_type": "a string",
    "default_prompt_name": "a string, or null",
    "pooling_mode": "a string or a list of strings",
    "prompts": "an object of names to prompt strings",
    "bias": "true or false",
    "include_prompt": "true or false",
    **dict.fromkeys(POOLING_FLAGS, "true or false"),
}
MODULE_KEY_KINDS = {"idx": "a whole number", "name": "a string", "path": "a string", "type": "a string"}
NOT_SENTENCE_TRANSFORMERS = ("config.json", "tokenizer_config.json")  # the model's and tokenizer's: read elsewhere


def read_json(folder: str, name: str) -> Any:
    """A JSON file of the checkpoint, None where it is not there; one of sentence-transformers' files held to the
    shape its readers take (``KEY_KINDS``), so a wrongly typed value is a CheckpointError naming the file and key."""
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(
            f"model.path: {path} is not valid JSON ({e}); write it again, or copy the checkpoint's own"
        ) from None
    if name not in NOT_SENTENCE_TRANSFORMERS:  # the root's; a module's own config.json (1_Pooling/) is checked
        _check_shape(path, os.path.basename(name), data)
    return data


def _check_shape(path: str, name: str, data) -> None:
    fix = "write it again, or copy the checkpoint's own"
    if name == MODULES:
        if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
            raise CheckpointError(
                f"model.path: {path} must be a list of module objects, not {type(data).__name__}; {fix}"
            )
        entries = [
            (f"module {i}: {key}", entry[key], MODULE_KEY_KINDS[key])
            for i, entry in enumerate(data)
            for key in MODULE_KEY_KINDS
            if key in entry
        ]
    elif not isinstance(data, dict):
        raise CheckpointError(f"model.path: {path} must be a JSON object, not a {type(data).__name__}; {fix}")
    else:
        entries = [(key, data[key], KEY_KINDS[key]) for key in KEY_KINDS if key in data]
    for key, value, kind in entries:
        if not _KINDS[kind](value):
            raise CheckpointError(f"model.path: {path} sets {key}: {json.dumps(value)[:80]}; it must be {kind}; {fix}")


def check_keys(folder: str, name: str, kind: str, values: dict) -> None:
    """Every key of ``values`` (file ``name``) is honoured, harmless, or at the one value docbeam reproduces."""
    defaults, honoured = DEFAULTS[kind], HONOURED[kind]
    for key, value in values.items():
        if key in honoured or defaults.get(key, None) is _ANY:
            continue
        if key in LOADING_KWARGS and isinstance(value, dict) and set(value) <= HARMLESS_LOADING_KWARGS:
            continue
        if key in defaults and value == defaults[key]:
            continue
        why = WHY_REFUSED.get(key, "docbeam does not reproduce it, so its embeddings would not be this model's")
        allowed = f" (docbeam reproduces only {json.dumps(defaults[key])})" if key in defaults else ""
        raise CheckpointError(
            f"model.path: {folder}/{name} sets {key}: {json.dumps(value)}, which docbeam does not "
            f"honour{allowed}: {why}; use a checkpoint without that setting"
        )

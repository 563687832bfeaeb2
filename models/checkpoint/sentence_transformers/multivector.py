"""A sentence-transformers ``MultiVectorEncoder`` checkpoint (config_sentence_transformers.json ``model_type:
MultiVectorEncoder``, ColBERT-style) → ModelSettings: its modules are read here, since they differ from a
SentenceTransformer's (no Pooling; Dense modules on every token; a MultiVectorMask), and each is checked as
keys.py (beside it) checks the others, so what docbeam does not reproduce is refused, naming the file and key.

docbeam reproduces, in this order (sentence_transformers/multi_vector_encoder/, 6.2.0): the Transformer; any
number of Dense modules reading and writing ``token_embeddings``; at most one MultiVectorMask (its
``skiplist_words`` for documents, resolved to token ids with the tokenizer as the module does; no
``keep_only_token_ids``); at most one Normalize of ``token_embeddings``. encode_document keeps every real token
(special tokens included) but the skiplist's.
"""

from __future__ import annotations

import dataclasses
import json

from docbeam.models.checkpoint.sentence_transformers.keys import (
    MODULES,
    ST_CONFIG,
    TRANSFORMER_CONFIG,
    check_keys,
    read_json,
)
from docbeam.models.checkpoint.sentence_transformers.settings import (
    ModelSettings,
    _tokenizer_max_len,
    dense_modules,
    prompt_settings,
    sentence_transformers_modules,
)
from docbeam.models.families.encoder_config import CheckpointError

MODEL_TYPE = "MultiVectorEncoder"
MODULE_ORDER = ("Transformer", "Dense", "MultiVectorMask", "Normalize")
TOKENS = "token_embeddings"
# The Transformer's query-side settings change queries only; docbeam embeds documents.
_QUERY_ONLY = ("query_length", "query_expansion")


@dataclasses.dataclass(frozen=True)
class TokenMask:
    """A MultiVectorMask module: the words whose tokens a document's vectors leave out."""

    skiplist_words: tuple[str, ...] = ()


def is_multi_vector(folder: str) -> bool:
    return (read_json(folder, ST_CONFIG) or {}).get("model_type") == MODEL_TYPE


def multi_vector_modules(folder: str) -> tuple[list[tuple[str, dict]], TokenMask | None, bool]:
    """(the Dense modules as (``"Dense"``, entry), the mask or None, whether the vectors are normalised); any
    other module, order or setting is a CheckpointError naming it."""
    kinds = sentence_transformers_modules(folder, supported=MODULE_ORDER)
    once = [kind for kind, _ in kinds if kind != "Dense"]
    if once[:1] != ["Transformer"] or len(once) != len(set(once)):
        raise CheckpointError(
            f"model.path: {folder}/{MODULES} lists {once}; the multi_vector head runs one "
            "Transformer, then at most one MultiVectorMask and one Normalize"
        )
    mask, normalize = None, False
    for kind, module in kinds:
        name = f"{module.get('path')}/config.json"
        cfg = read_json(folder, name) or {}
        if kind == "Normalize":
            _only(folder, name, cfg, {"module_input_name": TOKENS, "module_output_name": TOKENS})
            normalize = True
        elif kind == "MultiVectorMask":
            mask = _mask(folder, name, cfg)
    return [(k, m) for k, m in kinds if k == "Dense"], mask, normalize


def multi_vector_settings(folder: str, config):
    """The ModelSettings of a MultiVectorEncoder checkpoint: its window (``document_length``, else as a
    SentenceTransformer's), prompts, token Dense modules, mask and normalisation; ``pooling`` is ``tokens``."""
    st = transformer_settings(folder)
    dense, mask, normalize = multi_vector_modules(folder)
    max_len = st.get("document_length") or st.get("max_seq_length") or _tokenizer_max_len(folder) or config.max_position
    max_len = min(max_len, config.max_position) if config.position == "absolute" else max_len
    prompts, document_prompt = prompt_settings(folder)
    return ModelSettings(
        max_seq_len=int(max_len),
        pooling="tokens",
        normalize=normalize,
        prompts=prompts,
        document_prompt_name=document_prompt,
        dense=dense_modules(folder, dense, config.output_size, "TokenDense"),
        token_mask=mask or TokenMask(),
    )


def _mask(folder: str, name: str, cfg: dict) -> TokenMask:
    words = cfg.get("skiplist_words") or []
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise CheckpointError(
            f"model.path: {folder}/{name} sets skiplist_words: {json.dumps(words)}; expected a "
            'list of words, e.g. ["!", ","]'
        )
    tasks = cfg.get("skiplist_tasks", ["document"])
    tasks = [tasks] if isinstance(tasks, str) else tasks
    if not isinstance(tasks, list) or "document" not in tasks:
        raise CheckpointError(
            f"model.path: {folder}/{name} sets skiplist_tasks: {json.dumps(tasks)}, which leaves "
            "documents' tokens unskipped; docbeam's multi_vector head applies the skiplist to "
            'documents only, as skiplist_tasks: ["document"] does'
        )
    _only(
        folder,
        name,
        {k: v for k, v in cfg.items() if k not in ("skiplist_words", "skiplist_tasks")},
        {"keep_only_token_ids": None},
    )
    return TokenMask(tuple(words))


def _only(folder: str, name: str, cfg: dict, allowed: dict) -> None:
    for key, value in cfg.items():
        if key not in allowed or value != allowed[key]:
            wanted = f" (it reproduces only {json.dumps(allowed[key])})" if key in allowed else ""
            raise CheckpointError(
                f"model.path: {folder}/{name} sets {key}: {json.dumps(value)}, which docbeam's "
                f"multi_vector head does not reproduce{wanted}; use a checkpoint without it"
            )


def transformer_settings(folder: str) -> dict:
    """sentence_bert_config.json, checked; ``document_length`` (encode_document's truncation) is honoured as
    the window, the query-only keys are harmless."""
    st = read_json(folder, TRANSFORMER_CONFIG) or {}
    checked = {k: v for k, v in st.items() if k not in (*_QUERY_ONLY, "document_length")}
    check_keys(folder, TRANSFORMER_CONFIG, TRANSFORMER_CONFIG, checked)
    length = st.get("document_length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 2):
        raise CheckpointError(
            f"model.path: {folder}/{TRANSFORMER_CONFIG} sets document_length: "
            f"{json.dumps(length)}; expected a number of tokens or null"
        )
    return st

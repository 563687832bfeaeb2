"""The one registry of heads: a name (``model.head``) → what resolves it, and the choice ``auto`` makes.

A registry entry is anything with ``resolve(checkpoint, hf_config, carried, where, model_cfg)`` returning a
``Head`` (models/heads/__init__.py): a module, or a Head subclass with that classmethod. The built-ins are listed
here by import path (imported on use: a head module imports the base); your own head is a
``package.module:Class`` string in ``model.head`` or an entry point of the group ``docbeam.heads``, as your own
attention backend is (attention/registry.py). Which head runs is decided once, at start (``resolve``), from the
checkpoint's own files (config.json's ``architectures``, sentence-transformers' modules.json) or ``model.head``;
a checkpoint whose head docbeam cannot reproduce is refused there, naming the file and key.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging

from docbeam.models.families.encoder_config import CheckpointError

ENTRY_POINT_GROUP = "docbeam.heads"
HEADS = {
    "embedding": "docbeam.models.heads.embedding",
    "classifier": "docbeam.models.heads.classifier",
    "multi_vector": "docbeam.models.heads.multivector",
    "sparse": "docbeam.models.heads.sparse",
    "bge_m3": "docbeam.models.heads.bge_m3",
}
_entry_points: dict[str, str] = {}


class UnknownHeadError(ValueError):
    """``model.head`` names no head: the message lists the valid ones."""


def register(name: str, target: str) -> None:
    """Adds a head under ``name``; ``target`` is its import path (``package.module`` or ``package.module:Class``)."""
    if name in HEADS or name in _entry_points or name == "auto":
        raise ValueError(f"a head named {name!r} is registered already")
    HEADS[name] = target


def _load_entry_points() -> dict[str, str]:
    if not _entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in HEADS:
                logging.getLogger(__name__).warning(
                    "entry point %s = %s (group %s) is ignored: the name is a built-in head",
                    ep.name,
                    ep.value,
                    ENTRY_POINT_GROUP,
                )
                continue
            _entry_points[ep.name] = ep.value
    return _entry_points


def names() -> list[str]:
    """Every registered head's name (built-ins first), for messages and ``model.head``'s choices."""
    return [*HEADS, *sorted(_load_entry_points())]


def _import(target: str):
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def load(name: str):
    """What resolves head ``name``: a registered name or a ``package.module:Class`` string; unknown names and
    imports that fail raise UnknownHeadError naming the value and the choices (the caller names the key)."""
    target = HEADS.get(name) or _load_entry_points().get(name)
    if target is None and ":" not in name:
        raise UnknownHeadError(
            f"{name!r} is not a head; use one of auto, {', '.join(names())}, or your own head as 'package.module:Class'"
        )
    try:
        resolver = _import(target or name)
    except (ImportError, AttributeError) as e:
        raise UnknownHeadError(
            f"cannot import {target or name!r} ({type(e).__name__}: {e}); your own head is written "
            "'package.module:Class', a Head subclass with a classmethod resolve(checkpoint, hf_config, carried, "
            "where, model_cfg)"
        ) from None
    if not callable(getattr(resolver, "resolve", None)):
        raise UnknownHeadError(
            f"{name!r} has no resolve(checkpoint, hf_config, carried, where, model_cfg); a head is "
            "a module or a Head subclass that defines it"
        )
    return resolver


def task_head(hf_config: dict) -> str | None:
    """The task head config.json's ``architectures`` names (``BertForSequenceClassification``), or None for a
    bare backbone or a pre-training head (``BertForMaskedLM``, ``Qwen3ForCausalLM``), which embedders ship."""
    for arch in hf_config.get("architectures") or ():
        if isinstance(arch, str) and any(arch.endswith(t) for t in TASK_SUFFIXES):
            return arch
    return None


# Task heads a checkpoint may carry. SequenceClassification is the classifier head's (models/heads/classifier.py);
# the others give one output per token or per choice, which no docbeam head writes.
TASK_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice")


def auto_choice(checkpoint, choice: str, carried: str | None, where: str) -> str:
    """``model.head`` against what the checkpoint carries. auto takes multi_vector for a MultiVectorEncoder
    checkpoint, sparse for a SparseEncoder, the classifier of a ``*ForSequenceClassification`` checkpoint without
    sentence-transformers' files, the embedding otherwise; a task head no docbeam head reproduces is refused
    unless ``model.head: embedding`` asks for the backbone's embeddings. A head of your own is taken as named."""
    from docbeam.models.checkpoint.sentence_transformers.settings import read_json

    settings = checkpoint.settings
    if choice == "auto" and settings.token_mask is not None:
        return "multi_vector"  # a sentence-transformers MultiVectorEncoder (models/checkpoint/sentence_transformers/multivector.py)
    if settings.token_mask is not None and choice in HEADS and choice != "multi_vector":
        raise CheckpointError(
            f"model.head: {choice}, but {checkpoint.folder}/config_sentence_transformers.json sets "
            "model_type: MultiVectorEncoder, whose output is one vector per token; use model.head: "
            "auto or multi_vector"
        )
    sparse = settings.splade is not None
    if choice == "auto":
        has_st = read_json(checkpoint.folder, "modules.json") is not None
        choice = (
            "sparse"
            if sparse
            else "classifier"
            if carried and carried.endswith("ForSequenceClassification") and not has_st
            else "embedding"
        )
        if carried and choice == "embedding" and not has_st:
            raise CheckpointError(
                f"model.path: {where} sets architectures: [{carried!r}], a head that gives one output per token or "
                "per answer, which docbeam does not write; set model.head: embedding to embed with its backbone "
                "(the head is then not run), or use a sequence classification or embedding checkpoint"
            )
    if sparse and choice in HEADS and choice != "sparse":
        raise CheckpointError(
            f"model.head: {choice}, but {checkpoint.folder}/modules.json makes a SparseEncoder "
            "(MLMTransformer + SpladePooling), whose output is a sparse vector; set model.head: "
            "auto or sparse"
        )
    return choice


def resolve(checkpoint, choice: str, model_cfg, vector_dtype: str = "float32"):
    """The head this run uses (``choice``: ``model.head``), with ``output.vector_dtype`` as it writes it."""
    from docbeam.models.checkpoint.sentence_transformers.settings import read_json

    hf = read_json(checkpoint.folder, "config.json") or {}
    carried = task_head(hf)
    where = f"{checkpoint.folder}/config.json"
    choice = auto_choice(checkpoint, choice, carried, where)
    try:
        resolver = load(choice)
    except UnknownHeadError as e:
        raise CheckpointError(f"model.head: {e}") from None
    head = resolver.resolve(checkpoint, hf, carried, where, model_cfg)
    if HEADS.get(choice) is None and _entry_points.get(choice) is None:
        head = dataclasses.replace(head, name=choice)  # your own head is recorded as the import path it came from
    return dataclasses.replace(head, vector_dtype=vector_dtype)


def described(head: dict, vector_dtype: str = "float32") -> dict:
    """A head as summary.json or a manifest describes it (``Head.describe``), with the ``columns``, ``verb`` and
    ``line`` that a description written before heads declared them lacks: derived here, once, from the
    built-in head it names (``vector_dtype``: the run's output.vector_dtype, which typed its vectors)."""
    if not head or "columns" in head:
        return head
    from docbeam.models.heads import Column

    name, folder, width, carried = head.get("name"), head.get("folder"), head.get("width"), head.get("checkpoint_head")
    dtype = head.get("vector_dtype", vector_dtype)
    columns, line = {
        "embedding": lambda: ([Column("embedding", "vector", head.get("truncate_dim") or width, dtype)], None),
        "classifier": lambda: (
            [
                Column("label", "label"),
                Column("score", "score"),
                Column("scores", "scores", len(head.get("labels") or ())),
            ],
            f"classifier ({carried}, {head.get('function')})",
        ),
        "sparse": lambda: (
            [Column("sparse_embedding", "sparse_vector", width)],
            f"sparse ({carried}, {head.get('pooling')} pooling)",
        ),
        "multi_vector": lambda: ([Column("multi_vector", "multi_vector", width, dtype)], "multi_vector"),
        "bge_m3": lambda: (
            [
                Column("embedding", "vector", head.get("dense_dim"), dtype),
                Column("sparse_embedding", "sparse_vector", head.get("vocab_size")),
                Column("multi_vector", "multi_vector", head.get("colbert_dim"), dtype),
            ],
            "bge_m3 (dense, sparse and ColBERT)",
        ),
    }.get(name, lambda: ([], name))()
    if name == "embedding" and carried:
        line = f"embedding → {folder}/; the checkpoint's {carried} did not run (model.head: classifier scores with it)"
    elif line:
        line = f"{line} → {folder}/"
    return {
        **head,
        "columns": [c.describe() for c in columns],
        "verb": "scored" if name == "classifier" else "embedded",
        **({"line": line} if line else {}),
    }

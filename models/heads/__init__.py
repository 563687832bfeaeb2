"""Heads: what turns the encoder's token states into one kind of output row, and the one registry of them.

A head has two halves. Inside the jitted forward it pools each window's token states (``pooling``) and runs
its ``layers`` (dense projections with an activation, layer norms) on the pooled vector, so a window leaves the
device as one short vector: a sentence embedding, or a classifier's logits. Outside, on the host, it turns a
document's window vectors into its row (``document_row``) and declares that row's columns, the folder they are
written to, its part of the reuse key and what the summary says of it, so the writer, the manifest,
incremental reuse, the report and the sinks read one declaration. Adding a head is one module here, one
``HEADS`` entry and its reference test.

Which head runs is decided once, at start (``resolve``), from the checkpoint's own files (config.json's
``architectures``, sentence-transformers' modules.json) or ``model.head``; a checkpoint whose head docbeam
cannot reproduce is refused there, naming the file and key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

from docbeam.models.families.encoder_config import ACTIVATIONS, CheckpointError

# What a dense layer of a head may apply after its projection (sentence-transformers' Dense modules name
# identity or tanh; classifier heads name the family's activations).
LAYER_ACTIVATIONS = {"identity": lambda x: x, "tanh": jnp.tanh, **ACTIVATIONS}
# The registry: a head's name (``model.head``) → its module, which exposes ``resolve(checkpoint, hf_config,
# carried, where, model_cfg)`` returning its Head. Imported on use (a head module imports this one).
HEADS = {
    "embedding": "docbeam.models.heads.embedding",
    "classifier": "docbeam.models.heads.classifier",
    "multi_vector": "docbeam.models.heads.multivector",
    "sparse": "docbeam.models.heads.sparse",
    "bge_m3": "docbeam.models.heads.bge_m3",
}


@dataclasses.dataclass(frozen=True)
class HeadLayer:
    """One step after pooling: ``dense`` is ``activation(x @ kernel + bias)``, ``norm`` a LayerNorm of ``eps``,
    ``l2`` an L2 normalisation (``x / max(|x|, 1e-12)``, torch's normalize); its parameters are ``{"kernel",
    "bias"}``, ``{"scale", "bias"}`` (a zero bias where the checkpoint has none) or ``{}``."""

    kind: Literal["dense", "norm", "l2"]
    activation: str = "identity"
    eps: float = 1e-5


class NonFinite(str):
    """A document whose window vectors or row hold NaN or inf: the reason, which the pipeline records as its
    ``non_finite`` rejection (a head never writes such a row)."""


@dataclasses.dataclass(frozen=True)
class Head:
    """A resolved head: frozen and hashable, handed to the workers inside the encoder's spec."""

    name: str  # its HEADS entry
    pooling: str  # "mean" | "cls" | "lasttoken": each window's token states → one vector; "tokens": none
    layers: tuple[HeadLayer, ...]  # run on the pooled vector inside the forward
    width: int  # values per window that leave the forward
    folder: str  # the output folder its rows are written to
    carried: str | None = None  # the task head config.json names ("BertForSequenceClassification"), if any
    # A head that needs every token state (sparse.py) defines ``reduce(hidden_BxTxD, lengths_B, segment_ids_BxT,
    # slot_lengths_BxK, params)`` → [B, width] (packed: [B, K, width]; per token, [B, T, ...], for a head with
    # ``window_vectors``: bge_m3.py), which the forward runs instead of pooling and ``layers``; None: pool, then
    # the layers.
    reduce = None

    @property
    def dim(self) -> int:
        """Values per document row's vector column."""
        return self.width

    def load_params(self, folder: str) -> tuple[dict, ...]:
        """The parameters of ``layers``, in float32 (numpy), from the checkpoint ``folder``."""
        raise NotImplementedError

    def compact_window(self, vector_W):
        """What a window's output crosses to ``document_row`` as (the vector itself; the sparse head's nonzero
        terms: its vocabulary-wide vectors are mostly zeros)."""
        return vector_W

    def columns(self) -> list:
        """The row's own columns (pyarrow fields) before id-less bookkeeping; kept fields follow them."""
        raise NotImplementedError

    def document_row(self, windows: list) -> dict | NonFinite:
        """One document's row from its windows (objects with index, num_windows, length, vector, doc_tokens,
        truncated, bucket_len, backend), or why it cannot be written."""
        raise NotImplementedError

    def reuse_key(self) -> Any:
        """What must match for an earlier run's row to be carried over (pipeline/stages/reuse.py)."""
        raise NotImplementedError

    def reusable(self, row: dict) -> bool:
        """Whether an earlier run's row read back is sound enough to carry over (its vector's length, finite)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """What summary.json and the manifest say of the head and its columns."""
        return {
            "name": self.name,
            "pooling": self.pooling,
            "folder": self.folder,
            "width": self.width,
            "checkpoint_head": self.carried,
        }


def apply_layers(pooled_xD: jax.Array, params: tuple[dict, ...], layers: tuple[HeadLayer, ...]) -> jax.Array:
    """A head's layers on pooled vectors [..., D], in float32 at full matmul precision (they are a sliver of the
    work, and a classifier's logits or a Dense projection should not lose digits the encoder kept)."""
    for layer, p in zip(layers, params, strict=True):
        if layer.kind == "dense":
            pooled_xD = LAYER_ACTIVATIONS[layer.activation](
                jnp.einsum("...d,de->...e", pooled_xD, p["kernel"], precision=jax.lax.Precision.HIGHEST) + p["bias"]
            )
        elif layer.kind == "l2":
            pooled_xD = pooled_xD / jnp.maximum(jnp.linalg.norm(pooled_xD, axis=-1, keepdims=True), 1e-12)
        else:
            mean = pooled_xD.mean(-1, keepdims=True)
            var = jnp.square(pooled_xD - mean).mean(-1, keepdims=True)
            pooled_xD = (pooled_xD - mean) * jax.lax.rsqrt(var + layer.eps) * p["scale"] + p["bias"]
    return pooled_xD


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


def resolve(checkpoint, choice: str, model_cfg, vector_dtype: str = "float32") -> Head:
    """The head this run uses: ``model.head`` (``choice``: auto, or a HEADS name) against what the checkpoint
    carries. auto takes multi_vector for a MultiVectorEncoder checkpoint, sparse for a SparseEncoder, the
    classifier of a ``*ForSequenceClassification`` checkpoint without sentence-transformers' files, the embedding
    otherwise; a task head no docbeam head reproduces is refused unless ``model.head: embedding`` asks for the
    backbone's embeddings."""
    import importlib

    from docbeam.models.checkpoint.sentence_transformers.settings import read_json

    hf = read_json(checkpoint.folder, "config.json") or {}
    carried = task_head(hf)
    where = f"{checkpoint.folder}/config.json"
    if choice == "auto" and checkpoint.settings.token_mask is not None:
        choice = "multi_vector"  # a sentence-transformers MultiVectorEncoder (models/st_multivector.py)
    elif checkpoint.settings.token_mask is not None and choice in HEADS and choice != "multi_vector":
        raise CheckpointError(
            f"model.head: {choice}, but {checkpoint.folder}/config_sentence_transformers.json sets "
            "model_type: MultiVectorEncoder, whose output is one vector per token; use model.head: "
            "auto or multi_vector"
        )
    sparse = checkpoint.settings.splade is not None
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
    if sparse and choice != "sparse":
        raise CheckpointError(
            f"model.head: {choice}, but {checkpoint.folder}/modules.json makes a SparseEncoder "
            "(MLMTransformer + SpladePooling), whose output is a sparse vector; set model.head: "
            "auto or sparse"
        )
    if choice not in HEADS:
        raise CheckpointError(f"model.head: {choice!r} is not a head; use one of auto, {', '.join(HEADS)}")
    head = importlib.import_module(HEADS[choice]).resolve(checkpoint, hf, carried, where, model_cfg)
    # output.vector_dtype types the embedding column (a head without vectors has been refused other dtypes).
    return dataclasses.replace(head, vector_dtype=vector_dtype) if hasattr(head, "vector_dtype") else head

"""The sparse head: SPLADE vectors, as sentence-transformers' ``SparseEncoder.encode_document`` makes them.

Inside the forward (``reduce``, on every token state): the family's masked-LM head (a dense layer, its
activation and LayerNorm, then the decoder tied to the word embeddings plus its bias) gives logits over the
vocabulary, ``log(1 + relu(logits))`` (twice log1p for ``log1p_relu``) is pooled over each window's tokens by
max or sum (the checkpoint's SpladePooling). The [tokens, vocabulary] logits are never whole on the device: they
are made one block of ``block`` vocabulary columns at a time and pooled inside the block, so a window leaves the
device as its [vocabulary] vector. Per document, on the host: the first window's vector (SparseEncoder
truncates; the default) or every window's combined as the pooling says (``model.sparse.windows: all``: max
over windows for max, the sum for sum), then the optional lossy pruning (``threshold``, ``max_terms``). Its rows
go to ``embeddings/`` as ``sparse_embedding``: ascending ``indices`` (token ids) and their ``values``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from docbeam.models.families import family_of
from docbeam.models.families.encoder_config import ACTIVATIONS, CheckpointError
from docbeam.models.heads import ROWS_FOLDER, Column, Head, HeadLayer, NonFinite, apply_layers, non_finite, window_facts

BLOCK = 4096  # vocabulary columns whose logits exist at once: [tokens, BLOCK] floats, whatever the vocabulary


@dataclasses.dataclass(frozen=True)
class MlmLayout:
    """Where a family's masked-LM head keeps its tensors (after the family's model prefix is stripped)."""

    steps: tuple[tuple[str, HeadLayer, bool], ...]  # (tensor prefix, layer, has bias): the transform, in order
    decoder: str  # the decoder's tensor prefix (its weight is absent when tied to the word embeddings)
    bias: str | None  # the logits' bias tensor, if the head has one
    embeddings: str  # the word embeddings a tied decoder reads


def _activation(hf: dict, key: str, default: str, where: str) -> str:
    name = hf.get(key, default)
    if name not in ACTIVATIONS:
        raise CheckpointError(
            f"model.path: {where} sets {key}: {json.dumps(name)}, which docbeam does not run in "
            f"the masked-LM head (it runs {', '.join(ACTIVATIONS)})"
        )
    return name


def _bert(hf: dict, where: str) -> MlmLayout:
    return MlmLayout(
        (
            ("cls.predictions.transform.dense", HeadLayer("dense", _activation(hf, "hidden_act", "gelu", where)), True),
            (
                "cls.predictions.transform.LayerNorm",
                HeadLayer("norm", eps=float(hf.get("layer_norm_eps", 1e-12))),
                True,
            ),
        ),
        "cls.predictions.decoder",
        "cls.predictions.bias",
        "embeddings.word_embeddings.weight",
    )


def _distilbert(hf: dict, where: str) -> MlmLayout:
    return MlmLayout(
        (
            ("vocab_transform", HeadLayer("dense", _activation(hf, "activation", "gelu", where)), True),
            ("vocab_layer_norm", HeadLayer("norm", eps=1e-12), True),
        ),
        "vocab_projector",
        "vocab_projector.bias",
        "embeddings.word_embeddings.weight",
    )


def _modernbert(hf: dict, where: str) -> MlmLayout:
    act = _activation(hf, "classifier_activation", "gelu", where)
    return MlmLayout(
        (
            ("head.dense", HeadLayer("dense", act), bool(hf.get("classifier_bias", False))),
            ("head.norm", HeadLayer("norm", eps=float(hf.get("norm_eps", 1e-5))), bool(hf.get("norm_bias", False))),
        ),
        "decoder",
        "decoder.bias" if hf.get("decoder_bias", True) else None,
        "embeddings.tok_embeddings.weight",
    )


# The masked-LM heads docbeam reproduces (each checked against transformers' own class), by architecture.
LAYOUTS = {"BertForMaskedLM": _bert, "DistilBertForMaskedLM": _distilbert, "ModernBertForMaskedLM": _modernbert}


@dataclasses.dataclass(frozen=True)
class SparseTerms:
    """One window's nonzero terms: token ids ascending (int32) and their weights (float32)."""

    indices: np.ndarray
    values: np.ndarray


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseHead(Head):
    activation: str  # SpladePooling's: "relu" | "log1p_relu"
    windows: str  # "first" | "all": which windows make a long document's vector
    max_terms: int | None  # keep the largest values only (lossy)
    threshold: float | None  # drop values below it (lossy)
    layout: MlmLayout
    prefixes: tuple[str, ...] = ()
    tied: bool = True  # config.json's tie_word_embeddings
    block: int = BLOCK
    # The vocabulary blocks one after another in Python rather than in a lax.map: for an exported forward only
    # (for_export), since lax.map exports as an ONNX Loop that OpenVINO 2026.4 does not convert.
    unrolled: bool = False
    chunk_column = "sparse_embedding"  # a chunk row is its window's sparse vector, pruned as a document's

    def load_params(self, folder: str) -> tuple[dict, ...]:
        """The transform's layers, then the decoder as blocks: kernel [blocks, block, D], bias [blocks, block]
        (the vocabulary padded with zero columns, whose log(1 + relu(0)) is 0, cut off after pooling)."""
        from safetensors import safe_open

        from docbeam.models.families.tensors import Tensors

        path = os.path.join(folder, "model.safetensors")
        with safe_open(path, "numpy") as f:
            tensors = Tensors({name: f.get_tensor(name) for name in f.keys()}, self.prefixes, path)
        params = []
        for (prefix, bias), layer in zip(((p, b) for p, _, b in self.layout.steps), self.layers, strict=True):
            p = tensors.dense(prefix, bias=bias) if layer.kind == "dense" else tensors.norm(prefix, bias=bias)
            p.setdefault("bias", np.zeros(p.get("kernel", p.get("scale")).shape[-1], np.float32))
            params.append(p)
        own = f"{self.layout.decoder}.weight"
        weight_VxD = tensors(own if tensors.has(own) or not self.tied else self.layout.embeddings)
        if weight_VxD.shape[0] != self.width:
            raise CheckpointError(
                f"model.path: {path}'s decoder gives {weight_VxD.shape[0]} logits, but config.json "
                f"sets vocab_size: {self.width}; they must agree"
            )
        bias_V = tensors(self.layout.bias) if self.layout.bias else np.zeros(self.width, np.float32)
        block = min(self.block, self.width)
        pad = -self.width % block
        weight_VxD = np.concatenate([weight_VxD, np.zeros((pad, weight_VxD.shape[1]), np.float32)])
        bias_V = np.concatenate([bias_V, np.zeros(pad, np.float32)])
        params.append({"kernel": weight_VxD.reshape(-1, block, weight_VxD.shape[1]), "bias": bias_V.reshape(-1, block)})
        return tuple(params)

    def reduce(self, hidden_BxTxD, lengths_B, segment_ids_BxT, slot_lengths_BxK, params):
        """Token states → [B, V] (packed: [B, K, V]) SPLADE vectors, one vocabulary block at a time."""
        *transform, decoder = params
        B, T, _ = hidden_BxTxD.shape
        states_NxD = apply_layers(hidden_BxTxD.astype(jnp.float32), tuple(transform), self.layers).reshape(B * T, -1)
        if segment_ids_BxT is None:
            K, slot_BxT = 1, jnp.where(jnp.arange(T)[None, :] < lengths_B[:, None], 0, 1)
        else:
            K, slot_BxT = slot_lengths_BxK.shape[1], segment_ids_BxT - 1
        # Each token's window, numbered over the batch; padding goes to one extra segment, dropped below.
        valid_BxT = (slot_BxT >= 0) & (slot_BxT < K)
        segment_N = jnp.where(valid_BxT, jnp.arange(B)[:, None] * K + slot_BxT, B * K).reshape(-1)
        pooled_by = jax.ops.segment_max if self.pooling == "max" else jax.ops.segment_sum

        def one_block(block):
            kernel_VbxD, bias_Vb = block
            logits_NxVb = (
                jnp.einsum("nd,vd->nv", states_NxD, kernel_VbxD, precision=jax.lax.Precision.HIGHEST) + bias_Vb
            )
            weights_NxVb = jnp.log1p(jax.nn.relu(logits_NxVb))
            if self.activation == "log1p_relu":
                weights_NxVb = jnp.log1p(weights_NxVb)
            return pooled_by(weights_NxVb, segment_N, num_segments=B * K + 1)[: B * K]

        if self.unrolled:
            pooled_NBxSxVb = jnp.stack([one_block(block) for block in zip(decoder["kernel"], decoder["bias"])])
        else:
            pooled_NBxSxVb = jax.lax.map(one_block, (decoder["kernel"], decoder["bias"]))
        vectors_SxV = jnp.moveaxis(pooled_NBxSxVb, 0, 1).reshape(B * K, -1)[:, : self.width]
        vectors_SxV = jnp.maximum(vectors_SxV, 0.0)  # an empty slot's max is -inf; every weight is >= 0
        return vectors_SxV.reshape(B, self.width) if segment_ids_BxT is None else vectors_SxV.reshape(B, K, -1)

    def for_export(self) -> SparseHead:
        return dataclasses.replace(self, unrolled=True)

    def compact_window(self, vector_V: np.ndarray) -> SparseTerms:
        """A window's nonzero terms (NaN kept, so a broken window is still seen): what crosses the shuffle."""
        indices = np.flatnonzero(vector_V).astype(np.int32)
        return SparseTerms(indices, np.asarray(vector_V, np.float32)[indices])

    def columns(self) -> list[Column]:
        return [Column("sparse_embedding", "sparse_vector", self.width)]

    def chunk_value(self, terms: SparseTerms) -> dict:
        """A window's nonzero terms as a document's row carries them: the same pruning."""
        vector_V = np.zeros(self.width, np.float32)
        vector_V[terms.indices] = terms.values
        indices, values = prune(vector_V, self.threshold, self.max_terms)
        return {"indices": indices.tolist(), "values": values.tolist()}

    def summary_line(self) -> str:
        return f"sparse ({self.carried}, {self.pooling} pooling) → {self.folder}/"

    def document_row(self, windows: list) -> dict | NonFinite:
        windows = sorted(windows, key=lambda w: w.index)
        used = windows[:1] if self.windows == "first" else windows
        broken = [w for w in used if not np.all(np.isfinite(w.vector.values))]
        if broken:
            return non_finite(used, broken, "sparse vector")
        vector = np.zeros(self.width, np.float32)
        for w in used:  # every weight is >= 0, so a term a window lacks is its 0
            (np.maximum if self.pooling == "max" else np.add).at(vector, w.vector.indices, w.vector.values)
        indices, values = prune(vector, self.threshold, self.max_terms)
        if not np.all(np.isfinite(values)):
            return non_finite(used, [], "sparse vector")
        return {
            "id": windows[0].doc_id,
            "sparse_embedding": {"indices": indices.tolist(), "values": values.tolist()},
            **window_facts(windows),
        }

    def row_stats(self, row: dict) -> dict:
        from docbeam.models.heads.vector_types import sparse_stats

        return {"representations": sparse_stats(row)}

    def reuse_key(self) -> dict:
        return {
            "name": self.name,
            "architecture": self.carried,
            "pooling": self.pooling,
            "activation": self.activation,
            "windows": self.windows,
            "max_terms": self.max_terms,
            "threshold": self.threshold,
            "vocab_size": self.width,
        }

    def reusable(self, row: dict) -> bool:
        sparse = row.get("sparse_embedding") or {}
        indices = np.asarray(sparse.get("indices") or [], np.int64)
        values = np.asarray(sparse.get("values") or [], np.float32)
        return (
            indices.shape == values.shape
            and bool(np.all(np.diff(indices) > 0))
            and bool(np.all((indices >= 0) & (indices < self.width)))
            and bool(np.all(np.isfinite(values)))
            and (self.max_terms is None or len(indices) <= self.max_terms)
        )

    def describe(self) -> dict:
        return {
            **super().describe(),
            "activation": self.activation,
            "windows": self.windows,
            "max_terms": self.max_terms,
            "threshold": self.threshold,
        }


def prune(vector_V: np.ndarray, threshold: float | None, max_terms: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The nonzero terms (ascending token ids, int32) and their values, less those below ``threshold`` and
    beyond the ``max_terms`` largest (ties: the lower token id is kept)."""
    keep = vector_V > 0
    if threshold is not None:
        keep &= vector_V >= np.float32(threshold)
    indices = np.flatnonzero(keep)
    if max_terms is not None and len(indices) > max_terms:
        order = np.lexsort((indices, -vector_V[indices]))[:max_terms]
        indices = np.sort(indices[order])
    return indices.astype(np.int32), vector_V[indices].astype(np.float32)


def resolve(checkpoint, hf: dict, carried: str | None, where: str, model_cfg) -> SparseHead:
    """A SparseEncoder's (MLMTransformer + SpladePooling); named (``model.head: sparse``) on a bare masked-LM
    checkpoint, SpladePooling's defaults (max, relu), as SparseEncoder builds for a fill-mask model."""
    strategy, activation = checkpoint.settings.splade or ("max", "relu")
    architectures = hf.get("architectures") or []
    arch = next((a for a in architectures if a in LAYOUTS), None)
    if arch is None:
        raise CheckpointError(
            f"model.head: sparse, but {where} sets architectures: {json.dumps(architectures)}; "
            f"docbeam runs SPLADE on the masked-LM head of {', '.join(LAYOUTS)} only"
        )
    options = model_cfg.sparse
    layout = LAYOUTS[arch](hf, where)
    return SparseHead(
        name="sparse",
        pooling=strategy,
        layers=tuple(layer for _, layer, _ in layout.steps),
        width=int(hf["vocab_size"]),
        folder=ROWS_FOLDER,
        carried=arch,
        activation=activation,
        windows=options.windows,
        max_terms=options.max_terms,
        threshold=options.threshold,
        layout=layout,
        prefixes=family_of(checkpoint.config).PREFIXES,
        tied=bool(hf.get("tie_word_embeddings", True)),
    )

"""bge-m3's three heads from one encoder pass, as FlagEmbedding's ``BGEM3FlagModel.encode`` computes them: one row
per document with its dense, sparse (lexical weights) and ColBERT representations.

Inside the forward (``reduce``) every token gets ``[w, v]``: ``w = relu(sparse_linear(h))`` its lexical weight,
and ``v`` the window's dense vector ``normalize(h)`` at its first token ([CLS], which has no ColBERT vector) and
``normalize(colbert_linear(h))`` at every other token, zero-padded to one width: [B, T, 1 + max(D, W)], the size of
a multi-vector head's output. On the host each window's tokens are cut as the multi-vector head cuts them (packed
rows by segment), and ``compact_window`` turns them, with their token ids, into the three representations: the
sparse one is, per token id, the max of its weights, the ids of cls/eos/pad/unk dropped and only weights > 0 kept
(then ``model.sparse``'s optional pruning). A long document's row is its first window's (FlagEmbedding truncates
at max_length). Columns: ``embedding``, ``sparse_embedding`` (as the sparse head's), ``multi_vector`` (as the
multi-vector head's; float32 or float16 with ``output.vector_dtype``, which types the dense vector too).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from docbeam.models.families.blocks import segment_starts
from docbeam.models.families.encoder_config import CheckpointError
from docbeam.models.heads import ROWS_FOLDER, Column, Head, HeadLayer, NonFinite, apply_layers, non_finite, window_facts
from docbeam.models.heads.multivector import BGE_M3_COLBERT, VECTOR_DTYPES, file_digest, torch_linear, window_slices
from docbeam.models.heads.sparse import SparseTerms, prune

SPARSE_LINEAR = "sparse_linear.pt"
# The tokens FlagEmbedding leaves out of the lexical weights (its special_tokens_map keys).
UNUSED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")
ID_LIMIT = 2**24  # token ids travel beside the float32 outputs: exact below this


@dataclasses.dataclass(frozen=True)
class M3Window:
    """One window's three representations, what crosses the shuffle: [D] dense, sparse terms, [n, W] ColBERT."""

    dense: np.ndarray
    sparse: SparseTerms
    colbert: np.ndarray

    def finite(self) -> bool:
        return all(bool(np.all(np.isfinite(x))) for x in (self.dense, self.sparse.values, self.colbert))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BgeM3Head(Head):
    hidden: int  # D: the dense vector's width (the model's hidden size)
    vocab_size: int  # the sparse vector's dimension
    unused_ids: tuple[int, ...]  # cls/eos/pad/unk: never lexical terms
    max_terms: int | None
    threshold: float | None
    digests: tuple[str, str]  # of sparse_linear.pt and colbert_linear.pt (the safetensors digests miss them)
    windows: str = "first"  # a long document's row is its first window's (head_plan.tokenize_for truncates)
    vector_dtypes = VECTOR_DTYPES

    @property
    def dim(self) -> int:
        """The dense vector's (``embedding_dim``; ``width`` is the ColBERT vectors')."""
        return self.hidden

    def load_params(self, folder: str) -> tuple[dict, ...]:
        return tuple(
            {"kernel": t["weight"].T, "bias": t["bias"]}
            for t in (torch_linear(folder, SPARSE_LINEAR), torch_linear(folder, BGE_M3_COLBERT))
        )

    def reduce(self, hidden_BxTxD, lengths_B, segment_ids_BxT, slot_lengths_BxK, params):
        """Token states → [B, T, 1 + max(D, W)]: each token's lexical weight, then the dense vector at a window's
        first token and its ColBERT vector elsewhere."""
        sparse, colbert = params
        hidden_BxTxD = hidden_BxTxD.astype(jnp.float32)
        weight_BxTx1 = apply_layers(hidden_BxTxD, (sparse,), (HeadLayer("dense", "relu"),))
        colbert_BxTxW = apply_layers(hidden_BxTxD, (colbert, {}), (HeadLayer("dense"), HeadLayer("l2")))
        dense_BxTxD = apply_layers(hidden_BxTxD, ({},), (HeadLayer("l2"),))
        width = max(self.hidden, self.width)

        def padded(x):
            return jnp.pad(x, ((0, 0), (0, 0), (0, width - x.shape[-1])))

        T = hidden_BxTxD.shape[1]
        first_BxT = (jnp.arange(T)[None, :] == 0) if segment_ids_BxT is None else segment_starts(segment_ids_BxT)
        vectors_BxTxV = jnp.where(first_BxT[..., None], padded(dense_BxTxD), padded(colbert_BxTxW))
        return jnp.concatenate([weight_BxTx1, vectors_BxTxV], axis=-1)

    def window_vectors(self, out_BxTxV: np.ndarray, batch) -> list[np.ndarray]:
        """Each window's tokens [n, 2 + max(D, W)] in ``batch.windows``' order: the token id, then the forward's
        values (a window's tokens as the multi-vector head cuts them)."""
        return [
            np.concatenate([batch.ids_BxT[r, at, None].astype(np.float32), out_BxTxV[r, at]], axis=1)
            for r, at in window_slices(batch)
        ]

    def compact_window(self, tokens_NxV: np.ndarray) -> M3Window:
        return m3_window(tokens_NxV, self.hidden, self.width, self.unused_ids)

    def columns(self) -> list[Column]:
        return [
            Column("embedding", "vector", self.hidden, self.vector_dtype),
            Column("sparse_embedding", "sparse_vector", self.vocab_size),
            Column("multi_vector", "multi_vector", self.width, self.vector_dtype),
        ]

    def summary_line(self) -> str:
        return f"bge_m3 (dense, sparse and ColBERT) → {self.folder}/"

    def document_row(self, windows: list) -> dict | NonFinite:
        windows = sorted(windows, key=lambda w: w.index)
        first: M3Window = windows[0].vector
        if not first.finite():
            return non_finite(windows[:1], windows[:1], "bge-m3 output")
        vector_V = np.zeros(self.vocab_size, np.float32)
        vector_V[first.sparse.indices] = first.sparse.values
        indices, values = prune(vector_V, self.threshold, self.max_terms)
        return {
            "id": windows[0].doc_id,
            "embedding": first.dense.astype(self.vector_dtype).tolist(),
            "sparse_embedding": {"indices": indices.tolist(), "values": values.tolist()},
            "multi_vector": first.colbert.astype(self.vector_dtype).tolist(),
            **window_facts(windows),
        }

    def row_stats(self, row: dict) -> dict:
        from docbeam.models.heads.vector_types import dense_stats, multi_vector_stats, sparse_stats

        return {
            "representations": {
                **dense_stats(self.hidden, self.vector_dtype),
                **sparse_stats(row),
                **multi_vector_stats(row, self.width, self.vector_dtype),
            }
        }

    def reuse_key(self) -> dict:
        return {
            "name": self.name,
            "sparse_linear": self.digests[0],
            "colbert_linear": self.digests[1],
            "unused_ids": list(self.unused_ids),
            "max_terms": self.max_terms,
            "threshold": self.threshold,
            "windows": self.windows,
        }

    def reusable(self, row: dict) -> bool:
        dense = np.asarray(row.get("embedding") or [], np.float32)
        sparse = row.get("sparse_embedding") or {}
        indices = np.asarray(sparse.get("indices") or [], np.int64)
        values = np.asarray(sparse.get("values") or [], np.float32)
        colbert = row.get("multi_vector") or []
        return (
            dense.shape == (self.hidden,)
            and bool(np.all(np.isfinite(dense)))
            and indices.shape == values.shape
            and bool(np.all(np.diff(indices) > 0))
            and bool(np.all((indices >= 0) & (indices < self.vocab_size)))
            and bool(np.all(np.isfinite(values)))
            and all(len(v) == self.width for v in colbert)
            and bool(np.all(np.isfinite(np.asarray(colbert, np.float32))))
        )

    def describe(self) -> dict:
        return {
            **super().describe(),
            "dense_dim": self.hidden,
            "colbert_dim": self.width,
            "vocab_size": self.vocab_size,
            "max_terms": self.max_terms,
            "threshold": self.threshold,
            "windows": self.windows,
            "vector_dtype": self.vector_dtype,
        }


def m3_window(tokens_NxV: np.ndarray, hidden: int, width: int, unused_ids: tuple[int, ...]) -> M3Window:
    """A window's tokens (id, weight, vector) → its three representations. Lexical weights: per token id the max,
    unused ids dropped, weights > 0 kept (a NaN weight too, so a broken window is still seen), ids ascending."""
    ids_N = tokens_NxV[:, 0].astype(np.int64)
    weight_N = tokens_NxV[:, 1]
    keep = ~np.isin(ids_N, np.asarray(unused_ids, np.int64)) & ~(weight_N <= 0)
    indices, where = np.unique(ids_N[keep], return_inverse=True)
    values = np.full(len(indices), -np.inf, np.float32)
    with np.errstate(invalid="ignore"):  # a NaN weight stays NaN, and the row is refused
        np.maximum.at(values, where, weight_N[keep])
    return M3Window(
        dense=tokens_NxV[0, 2 : 2 + hidden].astype(np.float32),
        sparse=SparseTerms(indices.astype(np.int32), values),
        colbert=tokens_NxV[1:, 2 : 2 + width].astype(np.float32),
    )


def unused_token_ids(folder: str) -> tuple[int, ...]:
    """The ids of the tokenizer's cls/eos/pad/unk tokens (special_tokens_map.json, else tokenizer_config.json), as
    FlagEmbedding reads them; a token the checkpoint does not name is not dropped (FlagEmbedding's None)."""
    from docbeam.models.checkpoint import load_tokenizer

    named = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # the map wins where both name a token
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                named.update({k: v for k, v in json.load(f).items() if k in UNUSED_TOKENS and v})
    tokenizer = load_tokenizer(folder)
    ids = {tokenizer.token_id(v["content"] if isinstance(v, dict) else v) for v in named.values()}
    return tuple(sorted(i for i in ids if i is not None))


def resolve(checkpoint, hf: dict, carried: str | None, where: str, model_cfg) -> BgeM3Head:
    """``model.head: bge_m3``: a checkpoint with sparse_linear.pt and colbert_linear.pt beside it (FlagEmbedding's
    layout); ``model.sparse``'s max_terms and threshold prune its lexical weights."""
    folder, hidden = checkpoint.folder, checkpoint.config.output_size
    missing = [n for n in (SPARSE_LINEAR, BGE_M3_COLBERT) if not os.path.exists(os.path.join(folder, n))]
    if missing:
        raise CheckpointError(
            f"model.head: bge_m3, but {folder} has no {' or '.join(missing)}; the head runs "
            "bge-m3's sparse and ColBERT heads as FlagEmbedding saves them beside the model; use "
            "model.head: auto (its dense vector) or a bge-m3 checkpoint with both files"
        )
    sparse, colbert = torch_linear(folder, SPARSE_LINEAR)["weight"], torch_linear(folder, BGE_M3_COLBERT)["weight"]
    for name, weight, rows in ((SPARSE_LINEAR, sparse, 1), (BGE_M3_COLBERT, colbert, colbert.shape[0])):
        if weight.shape != (rows, hidden):
            raise CheckpointError(
                f"model.path: {folder}/{name} holds a weight of shape {list(weight.shape)}, but "
                f"bge-m3's is [{rows}, {hidden}] (hidden_size {hidden}); it belongs to another model"
            )
    vocab_size = int(hf.get("vocab_size", 0))
    if not 0 < vocab_size <= ID_LIMIT:
        raise CheckpointError(
            f"model.path: {where} sets vocab_size: {hf.get('vocab_size')}; the bge_m3 head needs "
            f"1 to {ID_LIMIT} token ids"
        )
    options = model_cfg.sparse
    if options.windows != "first":
        raise CheckpointError(
            f"model.sparse.windows: {options.windows}: the bge_m3 head writes a document's first "
            "window (FlagEmbedding truncates at max_length); set model.sparse.windows: first"
        )
    return BgeM3Head(
        name="bge_m3",
        pooling="tokens",
        layers=(),
        width=int(colbert.shape[0]),
        folder=ROWS_FOLDER,
        carried=carried,
        hidden=hidden,
        vocab_size=vocab_size,
        unused_ids=unused_token_ids(folder),
        max_terms=options.max_terms,
        threshold=options.threshold,
        digests=(file_digest(os.path.join(folder, SPARSE_LINEAR)), file_digest(os.path.join(folder, BGE_M3_COLBERT))),
    )

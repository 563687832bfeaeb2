"""The multi-vector head: one vector per kept token of a document, as sentence-transformers'
``MultiVectorEncoder.encode_document`` gives them (ColBERT-style late interaction).

Inside the forward every token's state goes through the checkpoint's Dense modules and, when it ends in
Normalize, an L2 normalisation (no pooling: the forward returns [B, T, W]). On the host each window keeps its
tokens but those its MultiVectorMask drops (skiplist words resolved to token ids with the tokenizer, as the
module resolves them; special tokens are kept, as encode_document keeps them). A document's row is its first
window's vectors: encode_document truncates at the window, and so does this head (tokenize.long_documents is
set to truncate). Its rows go to ``embeddings/``, column ``multi_vector``: a list of fixed-size lists, float32
or float16 (``output.vector_dtype``). bge-m3's ColBERT head (``colbert_linear.pt``) runs here too (bge_m3_colbert).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from docbeam.models.families.encoder_config import CheckpointError
from docbeam.models.heads import ROWS_FOLDER, Column, Head, HeadLayer, NonFinite, non_finite, window_facts

TOKENS = "tokens"  # the pooling that is none: embed_fn returns every token's vector
VECTOR_DTYPES = ("float32", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiVectorHead(Head):
    normalize: bool
    skip_ids: tuple[int, ...]  # token ids the checkpoint's MultiVectorMask drops from documents
    dense: tuple = ()  # the token Dense modules (checkpoint.sentence_transformers.settings.DenseModule), in the order they run
    windows: str = "first"  # a long document's row is its first window's (head_plan.tokenize_for truncates)
    drop_first: bool = False  # bge-m3: the window's first token ([CLS]) has no vector
    torch_linear: str | None = None  # bge-m3: the projection's torch file (colbert_linear.pt), read as tensors only
    linear_digest: str | None = None  # of that file (the reuse key's: the safetensors digests do not cover it)
    vector_dtypes = VECTOR_DTYPES  # what output.vector_dtype may be (pipeline/driver/head_plan.py)

    def load_params(self, folder: str) -> tuple[dict, ...]:
        from docbeam.models.checkpoint import load_dense

        dense = tuple(load_dense(folder, self))
        if self.torch_linear:
            linear = torch_linear(folder, self.torch_linear)
            dense += ({"kernel": linear["weight"].T, "bias": linear["bias"]},)
        return dense + (({},) if self.normalize else ())

    def kept_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Which of a window's token ids (in order) keep their vector."""
        kept = ~np.isin(ids, np.asarray(self.skip_ids, np.int64))
        kept[:1] &= not self.drop_first
        return kept

    def window_vectors(self, out_BxTxW: np.ndarray, batch) -> list[np.ndarray]:
        """Each window's kept token vectors [n, W], in ``batch.windows``' order."""
        return [out_BxTxW[r, at][self.kept_tokens(batch.ids_BxT[r, at])] for r, at in window_slices(batch)]

    def columns(self) -> list[Column]:
        return [Column("multi_vector", "multi_vector", self.width, self.vector_dtype)]

    def document_row(self, windows: list) -> dict | NonFinite:
        windows = sorted(windows, key=lambda w: w.index)
        first = windows[0]
        if not np.all(np.isfinite(first.vector)):
            return non_finite(windows[:1], [first], "multi-vector")
        vectors = np.asarray(first.vector, np.float32).astype(self.vector_dtype)
        return {"id": first.doc_id, "multi_vector": vectors.tolist(), **window_facts(windows)}

    def row_stats(self, row: dict) -> dict:
        from docbeam.models.heads.vector_types import multi_vector_stats

        return {"representations": multi_vector_stats(row, self.width, self.vector_dtype)}

    def reuse_key(self) -> dict:
        return {
            "name": self.name,
            "skip_ids": list(self.skip_ids),
            "windows": self.windows,
            "drop_first": self.drop_first,
            "torch_linear": self.linear_digest,
        }

    def reusable(self, row: dict) -> bool:
        vectors = row["multi_vector"]
        return all(len(v) == self.width for v in vectors) and bool(np.all(np.isfinite(np.asarray(vectors, np.float32))))

    def describe(self) -> dict:
        return {
            **super().describe(),
            "normalize": self.normalize,
            "skiplist_tokens": len(self.skip_ids),
            "windows": self.windows,
            "vector_dtype": self.vector_dtype,
        }


def window_slices(batch) -> list[tuple[int, slice | np.ndarray]]:
    """Where each window's tokens are, in ``batch.windows``' order: (row, its first ``length`` tokens) unpacked,
    (row, the tokens of its segment id) packed."""
    if not batch.packed:
        return [(r, slice(0, int(n))) for r, n in enumerate(batch.lengths_B[: batch.real_rows])]
    slots = batch.slot_lengths_BxK.shape[1]
    return [
        (row, batch.segment_ids_BxT[row] == k + 1) for row, k in (divmod(int(s), slots) for s in batch.window_slots())
    ]


def skiplist_ids(folder: str, words: tuple[str, ...]) -> tuple[int, ...]:
    """MultiVectorMask.resolve_with_tokenizer: each word's token id; a word that is not one token of the
    vocabulary (transformers would give the unknown token's id) is left out, as the module leaves it out."""
    from docbeam.models.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(folder)
    return tuple(sorted({i for i in map(tokenizer.token_id, words) if i is not None}))


BGE_M3_COLBERT = "colbert_linear.pt"


def torch_linear(folder: str, name: str) -> dict:
    """A torch.nn.Linear's state dict saved beside the checkpoint (bge-m3's heads), as plain tensors."""
    from docbeam.models.checkpoint.torch_tensors import load_tensors

    path = f"{folder}/{name}"
    tensors = load_tensors(path)
    weight, bias = tensors.get("weight"), tensors.get("bias")
    if weight is None or weight.ndim != 2 or bias is None or bias.shape != weight.shape[:1] or len(tensors) != 2:
        raise CheckpointError(
            f"model.path: {path} holds {sorted(tensors)}, not a linear layer's weight [out, in] "
            "and bias [out]; it belongs to another model"
        )
    return tensors


def resolve(checkpoint, hf: dict, carried: str | None, where: str, model_cfg) -> MultiVectorHead:
    settings = checkpoint.settings
    if settings.token_mask is None and os.path.exists(os.path.join(checkpoint.folder, BGE_M3_COLBERT)):
        return bge_m3_colbert(checkpoint, carried)
    if settings.token_mask is None:
        raise CheckpointError(
            f"model.head: multi_vector, but {checkpoint.folder}/config_sentence_transformers.json "
            f"does not set model_type: MultiVectorEncoder, nor is there a {BGE_M3_COLBERT} (bge-m3); "
            "the head reproduces those multi-vector encoders only; use model.head: auto or embedding"
        )
    layers = tuple(HeadLayer("dense", d.activation) for d in settings.dense)
    layers += (HeadLayer("l2"),) if settings.normalize else ()
    return MultiVectorHead(
        name="multi_vector",
        pooling=TOKENS,
        layers=layers,
        width=settings.width(checkpoint.config.output_size),
        folder=ROWS_FOLDER,
        carried=carried,
        normalize=settings.normalize,
        dense=settings.dense,
        skip_ids=skiplist_ids(checkpoint.folder, settings.token_mask.skiplist_words),
    )


def bge_m3_colbert(checkpoint, carried: str | None) -> MultiVectorHead:
    """bge-m3's ColBERT vectors (FlagEmbedding's BGEM3FlagModel): ``normalize(colbert_linear(h[:, 1:]))`` over the
    window's tokens after [CLS], its closing </s> included; its Dense and Normalize sentence-transformers modules
    make the dense vector, not these."""
    weight = torch_linear(checkpoint.folder, BGE_M3_COLBERT)["weight"]
    if weight.shape[1] != checkpoint.config.output_size:
        raise CheckpointError(
            f"model.path: {checkpoint.folder}/{BGE_M3_COLBERT} projects {weight.shape[1]} values, "
            f"but the model's hidden_size is {checkpoint.config.output_size}"
        )
    return MultiVectorHead(
        name="multi_vector",
        pooling=TOKENS,
        layers=(HeadLayer("dense"), HeadLayer("l2")),
        width=int(weight.shape[0]),
        folder=ROWS_FOLDER,
        carried=carried,
        normalize=True,
        skip_ids=(),
        drop_first=True,
        torch_linear=BGE_M3_COLBERT,
        linear_digest=file_digest(os.path.join(checkpoint.folder, BGE_M3_COLBERT)),
    )


def file_digest(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return f"sha256:{hashlib.sha256(f.read()).hexdigest()}"

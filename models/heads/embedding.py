"""The embedding head: a sentence vector per document, as sentence-transformers' ``encode_document`` makes it.

Per window: the Pooling module's mode, then the Dense modules (inside the forward). Per document: the
token-weighted mean of its windows' vectors, cut to ``truncate_dim`` (Matryoshka), then L2-normalised when
the checkpoint ends in Normalize. Its rows go to ``embeddings/``; ``output.vector_dtype`` quantizes them after.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from docbeam.models.families.encoder_config import CheckpointError
from docbeam.models.heads import (
    ROWS_FOLDER,
    Column,
    Head,
    HeadLayer,
    NonFinite,
    non_finite,
    window_facts,
)
from docbeam.models.heads.vector_types import VECTOR_DTYPES


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingHead(Head):
    normalize: bool
    truncate_dim: int | None  # documents' vectors keep their first truncate_dim dimensions (None: all)
    dense: tuple = ()  # sentence-transformers' Dense modules (checkpoint.sentence_transformers.settings.DenseModule), in the order they run
    vector_dtypes = VECTOR_DTYPES  # output.vector_dtype types its column, quantized after this head
    quantized = True
    chunk_column = "embedding"
    chunkings = ("window", "late")
    precision_gated = True

    @property
    def dim(self) -> int:
        """Of every vector written: after the Dense modules and the truncation."""
        return self.truncate_dim or self.width

    def load_params(self, folder: str) -> tuple[dict, ...]:
        from docbeam.models.checkpoint import load_dense

        return load_dense(folder, self)  # reads .dense, as it reads a ModelSettings'

    def columns(self) -> list[Column]:
        return [Column("embedding", "vector", self.dim, self.vector_dtype)]

    def document_row(self, windows: list) -> dict | NonFinite:
        return document_vector(windows, self.normalize, self.truncate_dim)

    def chunk_value(self, window_vector) -> list:
        """A window's vector as a document of that one window would get it: cut, then normalised."""
        out = np.asarray(window_vector, np.float64)[: self.truncate_dim]
        if self.normalize:
            out = out / max(np.linalg.norm(out), 1e-12)
        return out.astype(np.float32).tolist()

    def summary_line(self) -> str | None:
        """Worth a line only where the checkpoint carries a task head that did not run."""
        if not self.carried:
            return None
        return (
            f"embedding → {self.folder}/; the checkpoint's {self.carried} did not run "
            "(model.head: classifier scores with it)"
        )

    def row_stats(self, row: dict) -> dict:
        from docbeam.models.heads.vector_types import dense_stats

        return {"representations": dense_stats(self.dim, self.vector_dtype)}

    def reuse_key(self) -> str:
        return "embedding"  # its settings are the key's own fields (pooling, normalize, truncate_dim, ...)

    def reusable(self, row: dict) -> bool:
        from docbeam.models.heads.vector_types import list_size

        vector = np.asarray(row["embedding"], np.float32)
        return vector.shape == (list_size(self.dim, self.vector_dtype),) and bool(np.all(np.isfinite(vector)))

    def describe(self) -> dict:
        return {**super().describe(), "normalize": self.normalize, "truncate_dim": self.truncate_dim}


def document_vector(windows: list, normalize: bool, truncate_dim: int | None = None) -> dict | NonFinite:
    """Token-weighted mean of a document's window vectors, cut to its first ``truncate_dim`` dimensions (None:
    all), then (optionally) L2-normalised, so a truncated vector is a unit vector too. For mean pooling this is
    the mean over every window token, so a one-window document gets exactly the model's own embedding."""
    windows = sorted(windows, key=lambda w: w.index)
    expected = windows[0].num_windows
    if [w.index for w in windows] != list(range(expected)):
        raise ValueError(f"document {windows[0].doc_id!r}: got windows {[w.index for w in windows]} of {expected}")
    broken = [w for w in windows if not np.all(np.isfinite(w.vector))]
    weights = np.array([w.length for w in windows], np.float64)
    vector = (np.stack([w.vector for w in windows]).astype(np.float64) * weights[:, None]).sum(0) / weights.sum()
    vector = vector[:truncate_dim]
    if normalize and not broken:
        vector = vector / max(np.linalg.norm(vector), 1e-12)
    vector = vector.astype(np.float32)
    if broken or not np.all(np.isfinite(vector)):
        return non_finite(windows, broken, "embedding")
    return {"id": windows[0].doc_id, "embedding": vector.tolist(), **window_facts(windows)}


def resolve(checkpoint, hf: dict, carried: str | None, where: str, model_cfg) -> EmbeddingHead:
    """From the checkpoint's sentence-transformers settings, with ``model.pooling``, ``model.normalize`` and
    ``model.truncate_dim`` overriding them."""
    settings = checkpoint.settings
    pooling = settings.pooling if model_cfg.pooling == "auto" else model_cfg.pooling
    normalize = settings.normalize if model_cfg.normalize == "auto" else model_cfg.normalize
    full = settings.width(checkpoint.config.output_size)
    choice = model_cfg.truncate_dim
    truncate_dim = settings.truncate_dim if choice == "auto" else choice
    if truncate_dim is not None and truncate_dim > full:
        where = (
            f" (auto, from {checkpoint.folder}/config_sentence_transformers.json's truncate_dim)"
            if choice == "auto"
            else ""
        )
        raise CheckpointError(
            f"model.truncate_dim: {truncate_dim}{where} is larger than the model's {full}-"
            f"dimensional vectors; set it to at most {full}, or null for the full vector"
        )
    layers = tuple(HeadLayer("dense", d.activation) for d in settings.dense)
    return EmbeddingHead(
        name="embedding",
        pooling=pooling,
        layers=layers,
        width=full,
        folder=ROWS_FOLDER,
        carried=carried,
        normalize=normalize,
        truncate_dim=truncate_dim,
        dense=settings.dense,
    )


def standalone(checkpoint, pooling: str) -> EmbeddingHead:
    """The embedding head with ``pooling`` and the checkpoint's Dense modules, not normalised (benchmarks and
    tests that compare window vectors)."""
    settings = checkpoint.settings
    return EmbeddingHead(
        name="embedding",
        pooling=pooling,
        layers=tuple(HeadLayer("dense", d.activation) for d in settings.dense),
        width=settings.width(checkpoint.config.output_size),
        folder=ROWS_FOLDER,
        normalize=False,
        truncate_dim=None,
        dense=settings.dense,
    )

"""A document's row under the embedding head, as PoolDocuments writes it, for the tests of pooling."""

from __future__ import annotations

from docbeam.models.heads.embedding import EmbeddingHead
from docbeam.pipeline.records import Rejected, WindowEmbedding
from docbeam.pipeline.stages.write import document_row
from docbeam.pipeline.store.output import EMBEDDINGS


def pool_windows(windows: list[WindowEmbedding], normalize: bool, truncate_dim: int | None = None) -> dict | Rejected:
    """write.document_row with an embedding head of these settings (models/heads/embedding.py document_vector):
    the token-weighted mean of the windows, truncated, normalised; a ``non_finite`` rejection naming the bucket
    and backend otherwise."""
    head = EmbeddingHead(
        name="embedding",
        pooling="mean",
        layers=(),
        width=len(windows[0].vector),
        folder=EMBEDDINGS,
        normalize=normalize,
        truncate_dim=truncate_dim,
    )
    return document_row(head, windows)

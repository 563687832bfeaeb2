"""Pooling (models/heads/embedding.py document_vector, as write.document_row writes it): a document's window
embeddings become one token-weighted, normalised vector."""

from __future__ import annotations

import numpy as np
import pytest
from pool_fixtures import pool_windows

from docbeam.pipeline.records import WindowEmbedding


def embedding(
    index: int, num_windows: int, vector, *, length: int = 4, doc_tokens: int = 10, truncated: bool = False
) -> WindowEmbedding:
    return WindowEmbedding(
        "doc",
        index,
        num_windows,
        length,
        doc_tokens,
        truncated,
        np.asarray(vector, np.float32),
        bucket_len=32,
        backend="native",
    )


def test_one_window_gives_its_own_vector_normalised():
    pooled = pool_windows([embedding(0, 1, [3.0, 4.0], doc_tokens=7)], normalize=True)
    assert pooled == {
        "id": "doc",
        "embedding": pytest.approx([0.6, 0.8]),
        "num_tokens": 7,
        "num_windows": 1,
        "truncated": False,
    }


def test_token_weighted_mean_of_window_means_is_the_mean_over_every_window_token():
    rng = np.random.default_rng(0)
    tokens_per_window = [5, 12, 3]
    token_vectors = [rng.normal(size=(n, 8)) for n in tokens_per_window]
    windows = [embedding(i, 3, t.mean(0), length=len(t)) for i, t in enumerate(token_vectors)]

    pooled = pool_windows(windows[::-1], normalize=False)  # arrival order does not matter

    np.testing.assert_allclose(pooled["embedding"], np.concatenate(token_vectors).mean(0), rtol=1e-6, atol=1e-6)
    assert pooled["num_windows"] == 3


def test_normalize_scales_the_same_direction_to_unit_length():
    windows = [embedding(0, 2, [1.0, 2.0, 2.0], length=2), embedding(1, 2, [4.0, 0.0, 3.0], length=6)]
    raw = np.array(pool_windows(windows, normalize=False)["embedding"])
    unit = np.array(pool_windows(windows, normalize=True)["embedding"])
    np.testing.assert_allclose(raw, [3.25, 0.5, 2.75], rtol=1e-6)
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw), rtol=1e-6)
    assert np.linalg.norm(unit) == pytest.approx(1.0, abs=1e-6)


def test_a_zero_vector_stays_zero_when_normalised():
    assert pool_windows([embedding(0, 1, [0.0, 0.0])], normalize=True)["embedding"] == [0.0, 0.0]


def test_document_fields_come_from_the_windows():
    windows = [
        embedding(0, 2, [1.0], doc_tokens=50, truncated=False),
        embedding(1, 2, [1.0], doc_tokens=50, truncated=False),
    ]
    pooled = pool_windows(windows, normalize=True)
    assert (pooled["num_tokens"], pooled["num_windows"], pooled["truncated"]) == (50, 2, False)
    assert pool_windows([embedding(0, 1, [1.0], truncated=True)], normalize=True)["truncated"] is True


@pytest.mark.parametrize("indices, num_windows", [([0, 2], 3), ([1, 2], 3), ([0, 0], 2), ([0, 1], 3)])
def test_a_missing_or_repeated_window_raises_naming_the_document(indices, num_windows):
    windows = [embedding(i, num_windows, [1.0]) for i in indices]
    with pytest.raises(ValueError, match=rf"document 'doc': got windows \[.*\] of {num_windows}"):
        pool_windows(windows, normalize=True)

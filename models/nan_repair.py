"""Keep one non-finite window from spoiling the other windows packed into its row.

Needed since attention multiplies a masked key's weight (0) by its value: 0 × NaN is NaN, so a NaN in one
packed window reaches every window of its row. Encoding each window of such a row again, alone in a row of
the same compiled shape, leaves non-finite only the window that is non-finite by itself (refused downstream).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

log = logging.getLogger(__name__)


def reencode_row_mates(encode_rows, batch, vectors, window_vectors=None) -> list[int]:
    """``encode_rows(ids_BxT, lengths_B, segment_ids_BxT, slot_lengths_BxK) -> pooled [B, K, D]`` is the
    batch's own compiled forward. Updates ``vectors`` in place; returns the windows encoded again. With a
    multi-vector head's ``window_vectors(out_BxTxW, batch)``, ``vectors`` is a list of each window's token
    vectors, and the forward's output [B, T, W] is read through it."""
    bad = (
        ~np.isfinite(vectors).all(axis=1)
        if window_vectors is None
        else np.array([not np.isfinite(v).all() for v in vectors], bool)
    )
    if not bad.any():
        return []
    slots = batch.slot_lengths_BxK.shape[1]
    where = batch.window_slots()
    row_of = where // slots
    bad_rows, windows_in_row = set(row_of[bad].tolist()), np.bincount(row_of, minlength=batch.rows)
    redo = [i for i in range(len(vectors)) if row_of[i] in bad_rows and windows_in_row[row_of[i]] > 1]
    for start in range(0, len(redo), batch.rows):
        chunk = redo[start : start + batch.rows]
        ids_BxT, segment_ids_BxT = np.zeros_like(batch.ids_BxT), np.zeros_like(batch.segment_ids_BxT)
        slot_lengths_BxK = np.zeros_like(batch.slot_lengths_BxK)
        for r, i in enumerate(chunk):
            row, k = divmod(int(where[i]), slots)
            tokens = batch.ids_BxT[row][batch.segment_ids_BxT[row] == k + 1]
            ids_BxT[r, : len(tokens)], segment_ids_BxT[r, : len(tokens)], slot_lengths_BxK[r, 0] = (
                tokens,
                1,
                len(tokens),
            )
        pooled = np.asarray(
            encode_rows(ids_BxT, slot_lengths_BxK.sum(axis=1, dtype=np.int32), segment_ids_BxT, slot_lengths_BxK)
        )
        if window_vectors is None:
            vectors[chunk] = pooled[: len(chunk), 0]
            continue
        alone = dataclasses.replace(
            batch,
            ids_BxT=ids_BxT,
            lengths_B=slot_lengths_BxK.sum(axis=1, dtype=np.int32),
            windows=tuple(batch.windows[i] for i in chunk),
            segment_ids_BxT=segment_ids_BxT,
            slot_lengths_BxK=slot_lengths_BxK,
        )
        for i, window in zip(chunk, window_vectors(pooled, alone), strict=True):
            vectors[i] = window
    log.warning(
        "batch %s: a non-finite vector in a packed row; encoded its %d row-mates again, each alone",
        batch.batch_id,
        len(redo),
    )
    return redo

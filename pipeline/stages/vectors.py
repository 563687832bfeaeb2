"""The ``embedding`` column: its Arrow type, and vectors quantized to ``output.vector_dtype`` exactly as
sentence-transformers' ``quantize_embeddings`` does, so a user's index built from either agrees.

The column's type is declared with the embedding head (models/heads/vector_types.py). int8 and uint8 map each
dimension's range onto 256 steps; the ranges (the per-dimension min and max) come from all of the run's vectors
(one global combine), because ranges from a bundle would give two documents different scales. They
are recorded in the manifest so a query can be quantized (or a vector restored) the same way.
"""

from __future__ import annotations

import apache_beam as beam
import numpy as np

from docbeam.models.heads.vector_types import VALUE_TYPES, VECTOR_DTYPES, describe, embedding_type, known, list_size  # noqa: F401
from docbeam.pipeline.records import REJECTED_TAG, Rejected

CALIBRATED = ("int8", "uint8")  # the dtypes whose values depend on per-dimension ranges
_known = known


def quantize(vectors_NxD: np.ndarray, vector_dtype: str, ranges_2xD: np.ndarray | None = None) -> np.ndarray:
    """``quantize_embeddings(vectors, precision, ranges)`` of sentence-transformers, step for step (float16, which
    it lacks, is numpy's round-to-nearest cast). ``ranges_2xD``: per-dimension [min, max], for int8 and uint8."""
    vectors_NxD = np.asarray(vectors_NxD, np.float32)
    if _known(vector_dtype) == "float32":
        return vectors_NxD
    if vector_dtype == "float16":
        with np.errstate(over="ignore"):  # beyond ±65504 becomes inf, as numpy's cast does: quantize_row rejects it
            return vectors_NxD.astype(np.float16)
    if vector_dtype == "binary":
        return (np.packbits(vectors_NxD > 0, axis=-1) - 128).astype(np.int8)
    if ranges_2xD is None:
        raise ValueError(f"{vector_dtype} vectors need their calibration ranges (per-dimension min and max)")
    ranges_2xD = np.asarray(ranges_2xD, np.float32)
    starts = ranges_2xD[0, :]
    steps = (ranges_2xD[1, :] - starts) / 255
    steps = np.where(steps == 0, 1, steps)  # a constant dimension: every value maps to step 0
    steps_NxD = np.clip(np.floor((vectors_NxD - starts) / steps), 0, 255)
    return steps_NxD.astype(np.uint8) if vector_dtype == "uint8" else (steps_NxD - 128).astype(np.int8)


def ranges_of(calibration: dict | None) -> np.ndarray | None:
    return None if calibration is None else np.asarray(calibration["ranges"], np.float32)


class RangesFn(beam.CombineFn):
    """Per-dimension min and max over every vector, as the manifest's calibration (``run_id``: who computed it)."""

    def __init__(self, run_id: str):
        super().__init__()
        self._run_id = run_id

    def create_accumulator(self):
        return None

    def add_input(self, acc, vector):
        vector = np.asarray(vector, np.float32)
        return (
            (vector, vector.copy(), 1)
            if acc is None
            else (np.minimum(acc[0], vector), np.maximum(acc[1], vector), acc[2] + 1)
        )

    def merge_accumulators(self, accs):
        out = None
        for acc in accs:
            if acc is not None:
                out = acc if out is None else (np.minimum(out[0], acc[0]), np.maximum(out[1], acc[1]), out[2] + acc[2])
        return out

    def extract_output(self, acc):
        if acc is None:
            return None
        return {"ranges": [acc[0].tolist(), acc[1].tolist()], "vectors": acc[2], "run_id": self._run_id}


def quantize_row(row: dict, vector_dtype: str, calibration: dict | None = None) -> dict | Rejected:
    """The row in ``vector_dtype``; a ``non_finite`` rejection when a value has no float16 (beyond ±65504), since
    an embedding written is always finite."""
    (vector,) = quantize(np.asarray([row["embedding"]], np.float32), vector_dtype, ranges_of(calibration))
    if not np.all(np.isfinite(vector)):
        return Rejected(
            source="",
            line=None,
            id=row["id"],
            kind="non_finite",
            reason=f"the embedding has values beyond {vector_dtype}'s range (largest magnitude "
            f"{np.abs(np.asarray(row['embedding'])).max():.6g}); not written: choose float32",
        )
    return {**row, "embedding": vector.tolist()}


def _quantized(row: dict, vector_dtype: str, calibration: dict | None = None):
    quantized = quantize_row(row, vector_dtype, calibration)
    yield beam.pvalue.TaggedOutput(REJECTED_TAG, quantized) if isinstance(quantized, Rejected) else quantized


class QuantizeVectors(beam.PTransform):
    """Encoded rows (float32) → ``rows`` in ``vector_dtype``, ``rejected`` (float16 overflows) and, for int8/uint8
    only, ``calibration`` (one dict, or None when there were no vectors). ``keep``: an earlier run's calibration
    to quantize with instead of computing one (an incremental run, whose reused rows were quantized with it: one
    output, one scale)."""

    def __init__(self, vector_dtype: str, run_id: str, keep: dict | None = None):
        super().__init__()
        self._dtype, self._run_id, self._keep = _known(vector_dtype), run_id, keep

    def expand(self, rows):
        if self._dtype == "float32":  # pooling already wrote these values, and only finite ones
            return {"rows": rows, "rejected": rows.pipeline | "NothingRejected" >> beam.Create([])}
        calibration, out = None, {}
        if self._dtype in CALIBRATED and self._keep is not None:
            calibration = rows.pipeline | "KeepCalibration" >> beam.Create([self._keep])
        elif self._dtype in CALIBRATED:
            calibration = (
                rows
                | "Vectors" >> beam.Map(lambda row: row["embedding"])
                | "Calibrate" >> beam.CombineGlobally(RangesFn(self._run_id))
            )
        if calibration is not None:
            out["calibration"] = calibration
            calibration = beam.pvalue.AsSingleton(calibration)
        quantized = rows | "Quantize" >> beam.FlatMap(_quantized, self._dtype, calibration).with_outputs(
            REJECTED_TAG, main="rows"
        )
        return {"rows": quantized.rows, "rejected": quantized[REJECTED_TAG], **out}

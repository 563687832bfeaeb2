"""The precision gate every reduced precision must pass before it is chosen: its vectors against float32's on
the same documents. Pure numpy, so the benchmark, ``docbeam validate --verify`` and the tests share it.

Two gates, both needed: the lowest cosine to the float32 vector catches one document gone wrong that a mean
would hide; recall@10 of a nearest-neighbour search (float32's neighbours as the truth) is what a search
index built from these vectors would lose.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from docbeam.models.precision import PrecisionRefused

GATES = {"recall@10": 0.98, "lowest cosine": 0.99}  # a reduced precision passes only at or above both
K = 10


def _unit(x_NxD: np.ndarray) -> np.ndarray:
    x_NxD = np.asarray(x_NxD, np.float64)
    return x_NxD / np.maximum(np.linalg.norm(x_NxD, axis=1, keepdims=True), 1e-12)


def cosines(vectors_NxD: np.ndarray, reference_NxD: np.ndarray) -> np.ndarray:
    """Per document, the cosine between its vector and its float32 vector."""
    if np.shape(vectors_NxD) != np.shape(reference_NxD):
        raise ValueError(f"vectors {np.shape(vectors_NxD)} and reference {np.shape(reference_NxD)} differ in shape")
    return (_unit(vectors_NxD) * _unit(reference_NxD)).sum(axis=1)


def neighbours(vectors_NxD: np.ndarray, k: int) -> np.ndarray:
    """[N, k]: each document's k nearest others by cosine (itself left out), nearest first."""
    unit = _unit(vectors_NxD)
    similarity_NxN = unit @ unit.T
    np.fill_diagonal(similarity_NxN, -np.inf)
    return np.argsort(-similarity_NxN, axis=1, kind="stable")[:, :k]


def recall_at_k(vectors_NxD: np.ndarray, reference_NxD: np.ndarray, k: int = K) -> float:
    """Mean over documents of |top-k by these vectors ∩ top-k by float32's| / k: every document is a query
    against all the others."""
    n = len(reference_NxD)
    if n <= k:
        raise ValueError(f"recall@{k} needs more than {k} documents; got {n}")
    ours_NxK, truth_NxK = neighbours(vectors_NxD, k), neighbours(reference_NxD, k)
    hits = [len(np.intersect1d(a, b, assume_unique=True)) for a, b in zip(ours_NxK, truth_NxK)]
    return float(np.mean(hits)) / k


@dataclasses.dataclass(frozen=True)
class GateResult:
    precision: str
    documents: int
    lowest_cosine: float
    mean_cosine: float
    recall_at_10: float

    @property
    def failures(self) -> list[str]:
        """The gates this precision fails, each with its figure and its threshold."""
        figures = {"recall@10": self.recall_at_10, "lowest cosine": self.lowest_cosine}
        return [f"{name} {figures[name]:.4f} < {floor}" for name, floor in GATES.items() if figures[name] < floor]

    @property
    def passed(self) -> bool:
        return not self.failures

    def describe(self) -> str:
        verdict = "passes" if self.passed else "FAILS " + "; ".join(self.failures)
        return (
            f"{self.precision} vs float32 over {self.documents} vectors: lowest cosine "
            f"{self.lowest_cosine:.5f}, mean {self.mean_cosine:.5f}, recall@{K} {self.recall_at_10:.4f}: "
            f"{verdict}"
        )


def measure(precision: str, vectors_NxD: np.ndarray, reference_NxD: np.ndarray) -> GateResult:
    c = cosines(vectors_NxD, reference_NxD)
    return GateResult(precision, len(c), float(c.min()), float(c.mean()), recall_at_k(vectors_NxD, reference_NxD))


def require(result: GateResult) -> GateResult:
    """The result if it passes; otherwise refused, naming each gate it fails (never chosen silently)."""
    if not result.passed:
        raise PrecisionRefused(
            f"model.dtype: {result.precision} fails the precision gate ({'; '.join(result.failures)}"
            f" over {result.documents} vectors, float32 as the reference); use float32 or "
            "another dtype that passes"
        )
    return result

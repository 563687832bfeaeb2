"""The semantic method's clusters: spherical k-means fitted on a bounded sample of the vectors (never the corpus in
one process), then every vector assigned to its nearest centroid in parallel (steps.py).

A cluster the sample says will outgrow ``max_cluster`` is split with centroids of its own, fitted on its share of
the sample, so the pairwise step's memory (cluster² float32) stays bounded; a pair split across two clusters is not
compared, SemDeDup's own approximation."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np

SAMPLE_SIZE = 20_000  # vectors the centroids are fitted on: 20k × 1024 float32 is 80 MB
MIN_POINTS_PER_CENTROID = 8
ITERATIONS = 25


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """The fitted centroids (unit rows), and for each split cluster its own centroids."""

    centroids_KxD: np.ndarray
    split: dict[int, np.ndarray]
    pieces: dict[str, int] = dataclasses.field(default_factory=dict)  # a cluster still too big: its hash pieces
    requested: int | None = None

    def assign(self, vector_D: np.ndarray, doc_id: str, seed: int) -> tuple[str, float]:
        """The cluster key (``"3"``, ``"3.1"`` for a split one, ``"3.1#2"`` for a piece of one the split could not
        bring under max_cluster: by a seeded hash of the id, so the same every run) and the cosine distance to its
        centroid."""
        c = int(np.argmax(self.centroids_KxD @ vector_D))
        centroids = self.split.get(c)
        if centroids is None:
            key, distance = str(c), float(1.0 - self.centroids_KxD[c] @ vector_D)
        else:
            s = int(np.argmax(centroids @ vector_D))
            key, distance = f"{c}.{s}", float(1.0 - centroids[s] @ vector_D)
        pieces = self.pieces.get(key)
        return (f"{key}#{piece_of(doc_id, seed, pieces)}" if pieces else key), distance

    def describe(self) -> dict:
        return {
            "clusters": len(self.centroids_KxD),
            **({"requested": self.requested} if self.requested is not None else {}),
            "split": {str(c): len(v) for c, v in sorted(self.split.items())},
            "pieces": dict(sorted(self.pieces.items())),
        }


def piece_of(doc_id: str, seed: int, pieces: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:piece:{doc_id}".encode(), digest_size=8).digest(), "big") % pieces


def unit(vectors) -> np.ndarray:
    """Rows scaled to unit length (a zero row stays zero): cosine is then a dot product."""
    v = np.asarray(vectors, np.float32)
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    return v / np.where(norms > 0, norms, 1.0)


def how_many(count: int, sample: int, clusters: int | None, max_cluster: int) -> int:
    """``clusters`` as set, else enough that a cluster averages half of ``max_cluster``; never more than the
    sample can fit (MIN_POINTS_PER_CENTROID each) nor more than the documents."""
    wanted = clusters if clusters is not None else math.ceil(count / max(max_cluster // 2, 1))
    return max(1, min(wanted, max(sample // MIN_POINTS_PER_CENTROID, 1), max(count, 1)))


def kmeans(points_NxD: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Spherical k-means (k-means++ start, Lloyd's steps on cosine): k unit centroids."""
    rng = np.random.default_rng(seed)
    n = len(points_NxD)
    k = min(k, n)
    centroids = [points_NxD[rng.integers(n)]]
    far = 1.0 - points_NxD @ centroids[0]
    for _ in range(1, k):
        weights = np.clip(far, 0, None) ** 2
        total = weights.sum()
        pick = rng.choice(n, p=weights / total) if total > 0 else rng.integers(n)
        centroids.append(points_NxD[pick])
        far = np.minimum(far, 1.0 - points_NxD @ points_NxD[pick])
    c_KxD = np.stack(centroids)
    for _ in range(ITERATIONS):
        nearest = np.argmax(points_NxD @ c_KxD.T, axis=1)
        moved = unit(
            np.stack([points_NxD[nearest == j].sum(0) if (nearest == j).any() else c_KxD[j] for j in range(k)])
        )
        if np.allclose(moved, c_KxD, atol=1e-6):
            break
        c_KxD = moved
    return c_KxD


def fit(sample, count: int, clusters: int | None, max_cluster: int, seed: int) -> ClusterPlan:
    """The plan for ``count`` vectors from a ``sample`` of them (at most SAMPLE_SIZE)."""
    points = unit(sample)
    if len(points) == 0:
        return ClusterPlan(np.zeros((1, 1), np.float32), {}, requested=clusters)
    k = how_many(count, len(points), clusters, max_cluster)
    centroids = kmeans(points, k, seed)
    nearest = np.argmax(points @ centroids.T, axis=1)
    split, pieces = {}, {}
    for c in range(len(centroids)):
        members = points[nearest == c]
        expected = len(members) / len(points) * count
        if expected > max_cluster and len(members) >= 2 * MIN_POINTS_PER_CENTROID:
            parts = how_many(math.ceil(expected), len(members), None, max_cluster)
            if parts > 1:
                split[c] = kmeans(members, parts, seed + 1 + c)
        # what the split leaves above max_cluster (a dense topic k-means cannot cut) goes in hash pieces
        if c in split:
            within = np.argmax(members @ split[c].T, axis=1)
            sizes = {f"{c}.{s}": float(np.sum(within == s)) / len(points) * count for s in range(len(split[c]))}
        else:
            sizes = {str(c): expected}
        pieces |= {key: math.ceil(size / max_cluster) for key, size in sizes.items() if size > max_cluster}
    return ClusterPlan(centroids, split, pieces, requested=clusters)

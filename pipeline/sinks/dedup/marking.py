"""Which documents of a group are marked, as pure functions the Beam steps (steps.py) call.

One rule for every method: documents are ordered by priority (``priority``: the protected ones first, then by
the method's own order) and a document is marked only against one before it that is kept, the most similar such
one (``duplicate_of``), so a marked document never points at a marked one. Protected documents are never marked: the
earlier runs' kept documents (``input.reuse_from``: what was kept yesterday stays kept) and the documents an
earlier method already kept a copy against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

KINDS = ("exact", "near", "semantic")


@dataclasses.dataclass(frozen=True)
class Item:
    """One document as deduplication sees it. ``text`` is None for an earlier run's document (its signature and
    vector were stored, the text was not); ``vector`` is the row's vector, unit length (semantic only)."""

    id: str
    key: str  # signatures.exact_key
    text: str | None = None
    signature: np.ndarray | None = None
    vector: np.ndarray | None = None
    protected: bool = False
    earlier: bool = False  # an earlier run's kept document without a row in this run (not read, or rejected)
    scheme: str = ""  # what ``signature`` was made with (settings.NearOptions.scheme): only equal ones compare


@dataclasses.dataclass(frozen=True)
class Mark:
    """One line of duplicates/: ``id`` duplicates the kept ``duplicate_of`` by ``kind`` with ``similarity`` (1.0 for
    exact, the estimated Jaccard of the word n-grams for near, the cosine of the vectors for semantic)."""

    id: str
    duplicate_of: str
    kind: str
    similarity: float

    def row(self) -> dict:
        return dataclasses.asdict(self)


def priority(item: Item, order=None) -> tuple:
    """Protected first; then ``order`` (the method's: none, the id); the id last, so ties are stable."""
    return (not item.protected, order if order is not None else 0, item.id)


def mark_exact(items: Iterable[Item]) -> Iterator[Item | Mark]:
    """Of documents with the same exact key, the first by priority is kept and each other one not protected is
    marked ``exact`` against it; protected ones stay kept (two of yesterday's documents are never re-judged). The
    first kept is protected from the later methods when a copy was marked against it. Two passes over ``items``
    (a Beam group's values, re-iterable), never held whole: a million copies of one text cost no memory."""
    first = min(items, key=priority)
    copies = False
    for item in items:
        if item.id == first.id:
            continue
        if item.protected:
            yield item
        else:
            copies = True
            yield Mark(item.id, first.id, "exact", 1.0)
    yield dataclasses.replace(first, protected=True) if copies else first


def mark_near(edges: dict[tuple[str, str], float], threshold: float) -> list[Mark]:
    """The near method's rule on its verified pairs ``{(earlier, later): similarity}`` (``earlier`` first by
    priority; a protected document is never ``later``). A *root* is a document with no pair at or above
    ``threshold`` to one before it; every other document is marked ``near`` against its most similar root, or kept
    when none of its earlier neighbours is a root (the fourth link of a chain a–b–c–d). Two local rounds, which
    Beam computes one document at a time (steps.MarkNear), where visiting documents in order would need the
    whole graph in one process; roots are never marked, so ``duplicate_of`` is always kept."""
    close = {pair: sim for pair, sim in edges.items() if sim >= threshold}
    not_roots = {later for _, later in close}
    best: dict[str, tuple[float, str]] = {}
    for (earlier, later), sim in close.items():
        if earlier not in not_roots and (later not in best or (-sim, earlier) < best[later]):
            best[later] = (-sim, earlier)
    return [Mark(later, earlier, "near", round(-neg, 6)) for later, (neg, earlier) in sorted(best.items())]


def mark_cluster(
    ids: list[str], vectors_NxD: np.ndarray, protected: list[bool], eps: float
) -> tuple[list[Mark], list[tuple[str, float]]]:
    """SemDeDup within one cluster, its members already in priority order: each document not protected is marked
    ``semantic`` against its most similar kept predecessor when their cosine is at least ``1 − eps``.

    Also returns, for each document not protected, its greatest cosine to any predecessor (SemDeDup's own measure,
    kept or not): the report's histogram and its sweep of eps. Memory: N × N float32 (the pairwise cosines)."""
    n = len(ids)
    if n == 0:
        return [], []
    cos_NxN = vectors_NxD @ vectors_NxD.T
    kept = np.zeros(n, bool)
    marks, closest = [], []
    for i in range(n):
        if protected[i] or i == 0:
            kept[i] = True
            if not protected[i]:
                closest.append((ids[i], -1.0))
            continue
        before = cos_NxN[i, :i]
        closest.append((ids[i], float(before.max())))
        among_kept = np.where(kept[:i], before, -np.inf)
        j = int(np.argmax(among_kept))
        if among_kept[j] >= 1.0 - eps:
            marks.append(Mark(ids[i], ids[j], "semantic", round(float(min(among_kept[j], 1.0)), 6)))
        else:
            kept[i] = True
    return marks, closest

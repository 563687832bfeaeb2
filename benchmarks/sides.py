"""How a benchmark runs two sides fairly on a shared machine: their timed passes take turns, and each side
reports its best run after the first batch; and how close two sides' vectors are."""

from __future__ import annotations


def best_after_first_batch(runs: list[dict]) -> dict:
    """The run with the shortest wall time after its first batch, for the rates after the first batch; the
    whole-job figures stay the first run's, the only one that loaded and compiled the encoder as a
    `docbeam run` does (later runs in this process find it loaded)."""
    best = min(runs, key=lambda run: run["wall_after_first_batch_s"])
    first = runs[0]
    return {
        **best,
        "wall_seconds": first["wall_seconds"],
        "summary_tokens_per_s": first["summary_tokens_per_s"],
        "compiles": first["compiles"],
        "wall_after_first_batch_every_run_s": [round(run["wall_after_first_batch_s"], 3) for run in runs],
    }


def alternate(*sides) -> list:
    """Drive generator sides round-robin: each loads and warms up, then their timed passes take turns, so a
    machine that speeds up or slows down during the run (these shared VMs swing ±20%) moves both alike. The order
    is reversed every round, so no side always follows the same one (a fixed order once timed two runs of the same
    XLA code 15% apart, benchmarks/results/precision.json of 2026-12-07). Returns what each side returns."""
    results = [None] * len(sides)
    running = dict(enumerate(sides))
    turn = 0
    while running:
        order = list(running.items())
        turn += 1
        for i, side in order if turn % 2 else order[::-1]:
            try:
                next(side)
            except StopIteration as done:
                results[i] = done.value
                del running[i]
    return results


def skipped(reason: str):
    yield
    return {"skipped": reason}


def cosine_agreement(docbeam_vectors: dict, st_embeddings, docs) -> float:
    """Lowest cosine between docbeam's and sentence-transformers' embedding of a document."""
    import numpy as np

    ours = np.stack([docbeam_vectors[d.id] for d in docs]).astype(np.float32)
    theirs = np.asarray(st_embeddings, np.float32)
    ours /= np.linalg.norm(ours, axis=1, keepdims=True)
    theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
    return float((ours * theirs).sum(axis=1).min())

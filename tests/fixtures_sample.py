"""The sample corpus cut to its first documents, for whole-job tests whose point does not depend on 400 of them:
each document is tokenized, batched and encoded, so a job's time grows with the count while what those tests
check (a leak's slope, where compiled code came from) does not."""

from __future__ import annotations

import gzip
import pathlib

from conftest import SAMPLE


def sample_head(folder: pathlib.Path, count: int) -> str:
    """Writes the sample's first ``count`` documents, unchanged, to ``folder``/docs.jsonl and returns its path."""
    path = folder / "docs.jsonl"
    with gzip.open(SAMPLE, "rt") as f:
        lines = [line for _, line in zip(range(count), f)]
    if len(lines) < count:
        raise ValueError(
            f"sample_head: the sample {SAMPLE} holds {len(lines)} documents, not count={count}; ask for fewer"
        )
    path.write_text("".join(lines))
    return str(path)

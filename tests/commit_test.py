"""pipeline/stages/commit.py and the pooling check: what makes a run fail instead of commit, and that no
non-finite vector is ever written."""

from __future__ import annotations

import numpy as np
import pytest
from pool_fixtures import pool_windows

from docbeam.pipeline.records import Rejected, WindowEmbedding
from docbeam.pipeline.stages.commit import run_problems, summarize


def summary(read: int, embedded: int, rejected: int, **by_kind) -> dict:  # all encoded
    return {"docs_read": read, "docs_embedded": embedded, "docs_rejected": rejected, "rejected_by_kind": by_kind}


def test_a_clean_run_and_an_empty_input_may_commit():
    assert run_problems(summary(10, 10, 0), 0.1) == []
    assert run_problems(summary(0, 0, 0), 0.1) == []


def test_a_run_that_embeds_nothing_from_a_non_empty_input_fails_whatever_the_threshold():
    problems = run_problems(summary(40, 0, 40, missing_text=40), 1.0)
    assert problems == ['nothing was embedded from 40 documents read (rejected by kind: {"missing_text": 40})']


def test_rejecting_more_than_the_allowed_fraction_fails_and_exactly_the_fraction_passes():
    assert run_problems(summary(10, 9, 1, malformed_json=1), 0.1) == []
    (problem,) = run_problems(summary(10, 8, 2, malformed_json=2), 0.1)
    assert "2 of 10 documents were rejected (20.0%), more than input.max_rejected_fraction=0.1" in problem


def test_counts_that_do_not_add_up_are_never_committed():
    (problem,) = run_problems(summary(10, 8, 1), 0.5)
    assert problem == "documents do not add up: read 10 != embedded 8 + rejected 1"


def test_the_summary_is_built_from_the_stats_and_the_drivers_plan():
    base = {"run_id": "r1", "started": 100.0, "model": "m"}
    stats = {
        "docs_read": 3,
        "docs_embedded": 2,
        "docs_rejected": 1,
        "real_tokens": 90,
        "padded_tokens": 120,
        "rejected_by_kind": {"no_tokens": 1},
    }
    s = summarize(base, stats, finished=110.0)
    assert s["run_id"] == "r1" and "started" not in s and s["wall_seconds"] == 10.0
    assert s["padding_efficiency"] == 0.75 and s["docs_per_second"] == 0.2
    assert summarize(base, {}, finished=110.0)["padding_efficiency"] is None  # zero batches


def window(index: int, num_windows: int, vector, length: int = 10) -> WindowEmbedding:
    return WindowEmbedding("doc", index, num_windows, length, 20, False, np.asarray(vector, np.float32), 32, "mine")


def test_pooling_weights_windows_by_their_tokens():
    row = pool_windows([window(0, 2, [1.0, 0.0], 30), window(1, 2, [0.0, 1.0], 10)], normalize=False)
    np.testing.assert_allclose(row["embedding"], [0.75, 0.25])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_window_makes_the_document_a_non_finite_error_naming_bucket_and_backend(bad):
    result = pool_windows([window(0, 2, [1.0, 0.0]), window(1, 2, [bad, 1.0])], normalize=True)
    assert isinstance(result, Rejected) and result.kind == "non_finite" and result.id == "doc"
    assert "1 of 2 window(s) non-finite" in result.reason and "bucket 32 with attention mine" in result.reason


def test_every_shard_of_a_sink_is_committed_even_when_a_retried_finalize_reports_only_some(tmp_path):
    from docbeam.pipeline.stages.commit import every_shard

    shards = [str(tmp_path / f"part-r1-{i:05d}-of-00003.parquet") for i in range(3)]
    for path in shards:
        open(path, "wb").close()
    single = str(tmp_path / "errors.jsonl")
    assert every_shard([shards[1], single]) == sorted([*shards, single])
    (tmp_path / "part-r1-00002-of-00003.parquet").unlink()
    with pytest.raises(RuntimeError, match="not their sibling shard"):
        every_shard([shards[1]])

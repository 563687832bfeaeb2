"""benchmarks/vs_mltransform.py's length-aware anchor (benchmarks/mltransform_job.py) batches as docbeam buckets: Beam's lower-inclusive boundaries,
made from docbeam's buckets, never put a document docbeam pads to 128 in a batch with one it pads to 256."""

from __future__ import annotations

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that

from benchmarks.mltransform_job import length_boundaries


def test_docbeams_buckets_become_beams_boundaries_one_token_past_each_bucket():
    assert length_boundaries([128, 256]) == [129]
    assert length_boundaries([512, 64, 128]) == [65, 129]  # sorted, as docbeam's config validator sorts them
    assert length_boundaries([256]) == []  # one bucket: one batch key


LENGTHS = [1, 5, 127, 128, 129, 130, 200, 255, 256] * 3


def run_length_aware_batching(boundaries: list[int]) -> None:
    """Beam's length-aware BatchElements over LENGTHS; fails the pipeline if a batch mixes docbeam's two buckets."""

    def one_bucket_each(batches):
        mixed = [sorted(b) for b in batches if any(n <= 128 for n in b) and any(n > 128 for n in b)]
        assert mixed == [], f"batches holding lengths on both sides of 128: {mixed}"
        assert sorted(n for b in batches for n in b) == sorted(LENGTHS)  # every element batched once

    with TestPipeline() as p:
        batches = (
            p
            | beam.Create(LENGTHS)
            | beam.BatchElements(
                min_batch_size=1,
                max_batch_size=100,
                max_batch_duration_secs=1.0,
                length_fn=lambda n: n,
                bucket_boundaries=boundaries,
            )
        )
        assert_that(batches, one_bucket_each)


def test_beams_length_aware_batches_never_mix_two_of_docbeams_buckets():
    run_length_aware_batching(length_boundaries([128, 256]))


def test_a_boundary_at_docbeams_bucket_itself_mixes_them():
    """Beam's boundary 128 puts a 128-token document with 129..256: the off-by-one length_boundaries avoids."""
    with pytest.raises(Exception, match="both sides of 128"):
        run_length_aware_batching([128])


def test_the_anchors_handler_hands_beam_the_token_length_and_docbeams_boundaries(real_checkpoint_dir):
    """What MLTransform's RunInference receives: the length in the model's tokens (capped at the window, as the
    encoder truncates), docbeam's boundaries and a batch duration (without one Beam ignores length_fn)."""
    from transformers import AutoTokenizer

    from benchmarks.mltransform_job import length_aware_embeddings

    settings = {"model_name": real_checkpoint_dir, "columns": ["text"], "max_seq_length": 256}
    length = {"boundaries": length_boundaries([128, 256]), "max_batch_duration_secs": 1.0}
    kwargs = length_aware_embeddings(settings, length).get_model_handler().batch_elements_kwargs()
    assert kwargs["bucket_boundaries"] == [129] and kwargs["max_batch_duration_secs"] == 1.0
    text = "docbeam batches documents of like length together " * 3
    tokens = len(AutoTokenizer.from_pretrained(real_checkpoint_dir)(text)["input_ids"])
    assert kwargs["length_fn"]({"text": text}) == tokens < 256
    assert kwargs["length_fn"]({"text": "word " * 1000}) == 256

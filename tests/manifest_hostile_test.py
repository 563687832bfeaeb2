"""A garbled or foreign ``_manifest.json`` (a field of the wrong type, not JSON, a file entry that is no path): at
the output a run is refused at start (exit 2) naming the file and field and touches nothing; as
``input.reuse_from`` the run says why and encodes everything (reuse_mismatch: encode_all), never a Python error."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
from conftest import job_config

from docbeam.errors import Refused
from docbeam.pipeline.driver.run import run_job

GARBLES = {
    "files-a-number": lambda m: {**m, "files": 5},
    "run_id-a-number": lambda m: {**m, "run_id": 5},
    "reuse_key-a-list": lambda m: {**m, "reuse_key": [1]},
    "a-size-a-string": lambda m: {**m, "files": [{**m["files"][0], "size": "12"}, *m["files"][1:]]},
    "a-checksum-a-number": lambda m: {**m, "files": [{**m["files"][0], "checksum": 5}, *m["files"][1:]]},
    "not-json": None,
}


@pytest.fixture(scope="module")
def committed(tmp_path_factory, tiny_checkpoint_dir):
    root = tmp_path_factory.mktemp("manifests")
    (root / "docs.jsonl").write_text("".join(f'{{"id": "d{i}", "text": "river {i} runs"}}\n' for i in range(4)))
    run_job(job_config(str(root / "docs.jsonl"), str(root / "good"), tiny_checkpoint_dir))
    return root


def garbled_copy(committed, tmp_path, garble: str) -> str:
    out = str(tmp_path / "garbled")
    shutil.copytree(committed / "good", out)
    path = os.path.join(out, "_manifest.json")
    manifest = json.loads(open(path).read())
    open(path, "w").write("{ not json" if GARBLES[garble] is None else json.dumps(GARBLES[garble](manifest)))
    return out


def snapshot(folder: str) -> dict:
    return {p: os.path.getmtime(p) for p in glob.glob(f"{folder}/**", recursive=True)}


@pytest.mark.parametrize("garble", sorted(GARBLES))
def test_a_garbled_manifest_at_the_output_refuses_the_run_and_touches_nothing(
    committed, tmp_path, tiny_checkpoint_dir, garble
):
    out = garbled_copy(committed, tmp_path, garble)
    before = snapshot(out)
    with pytest.raises(Refused, match=r"_manifest.json (is garbled|is not JSON)"):
        run_job(job_config(str(committed / "docs.jsonl"), out, tiny_checkpoint_dir))
    assert snapshot(out) == before


@pytest.mark.parametrize("garble", sorted(GARBLES))
def test_a_garbled_reuse_from_is_not_reused_and_the_run_says_why(committed, tmp_path, tiny_checkpoint_dir, garble):
    source = garbled_copy(committed, tmp_path, garble)
    summary = run_job(
        job_config(
            str(committed / "docs.jsonl"), str(tmp_path / "out"), tiny_checkpoint_dir, input={"reuse_from": source}
        )
    )
    assert summary["docs_reused"] == 0 and summary["docs_encoded"] == 4
    assert "its manifest cannot be read" in summary["reuse"]["reason"]


def test_a_reuse_from_that_is_a_file_not_a_folder_is_not_reused(committed, tmp_path, tiny_checkpoint_dir):
    summary = run_job(
        job_config(
            str(committed / "docs.jsonl"),
            str(tmp_path / "out"),
            tiny_checkpoint_dir,
            input={"reuse_from": str(committed / "docs.jsonl")},
        )
    )
    assert summary["docs_reused"] == 0 and summary["docs_encoded"] == 4 and summary["reuse"]["reason"]

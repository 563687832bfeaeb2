"""pipeline/output.py: staged runs commit as a whole, and docbeam deletes only what its manifests list.

The same scenarios run on local disk and on gs:// (the emulator), since GCS has no rename.
"""
from __future__ import annotations

import json
import os
import uuid

import pytest

from gcs_emulator import gcs_emulator
from pipeline import output, storage


@pytest.fixture(scope="module")
def emulator():
    with gcs_emulator() as server:
        storage.pipeline_options()
        yield server


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def out(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "out")
    return request.getfixturevalue("emulator").url(f"out-{uuid.uuid4().hex[:8]}")


def stage(out: str, run_id: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        storage.write_bytes(f"{output.staging_dir(out, run_id)}/{rel}", data)


def commit_run(out: str, run_id: str, files: dict[str, bytes]) -> dict:
    stage(out, run_id, files)
    return output.commit(out, run_id, {"run_id": run_id}, {})


def snapshot(out: str) -> dict[str, bytes]:
    """Every file outside _staging/, with its bytes: what a reader of the output can see."""
    staging = f"{out}/{output.STAGING}/"
    return {output.relative(out, p): storage.read_bytes(p) for p in storage.list_files(out) if not p.startswith(staging)}


def run_files(run_id: str, rows: bytes = b"rows") -> dict[str, bytes]:
    return {f"embeddings/part-{run_id}-00000-of-00001.parquet": rows,
            f"timing/part-{run_id}-00000-of-00001.jsonl": b"{}\n"}


def test_a_commit_places_the_files_then_summary_manifest_and_success_and_removes_staging(out):
    manifest = commit_run(out, "r1", run_files("r1"))
    assert sorted(f["path"] for f in manifest["files"]) == sorted(run_files("r1"))
    assert all(f["size"] == len(run_files("r1")[f["path"]]) for f in manifest["files"])
    assert set(snapshot(out)) == set(run_files("r1")) | {"summary.json", "_manifest.json", "_SUCCESS"}
    assert json.loads(storage.read_bytes(f"{out}/_manifest.json"))["run_id"] == "r1"
    assert storage.read_bytes(f"{out}/_SUCCESS") == b"r1\n"
    assert storage.list_files(f"{out}/{output.STAGING}") == {}


def test_the_next_commit_replaces_the_previous_run_and_keeps_files_it_did_not_write(out):
    commit_run(out, "r1", run_files("r1"))
    storage.write_bytes(f"{out}/report.html", b"<html>")  # written by `docbeam report`, listed nowhere
    manifest = commit_run(out, "r2", run_files("r2"))
    assert manifest["previous_run_id"] == "r1"
    assert set(snapshot(out)) == set(run_files("r2")) | {"summary.json", "_manifest.json", "_SUCCESS", "report.html"}


def test_a_commit_killed_before_its_manifest_is_undone_by_the_next_run(out):
    commit_run(out, "r1", run_files("r1"))
    before = snapshot(out)
    stage(out, "dead", run_files("dead"))
    intent = {"run_id": "dead", "files": sorted(run_files("dead")), "replaces": sorted(run_files("r1")),
              "previous_run_id": "r1"}
    storage.write_bytes(f"{output.staging_dir(out, 'dead')}/{output.INTENT}", json.dumps(intent).encode())
    first = sorted(run_files("dead"))[0]  # the kill came after one file was placed
    storage.rename(f"{output.staging_dir(out, 'dead')}/{first}", f"{out}/{first}")
    assert output.inspect(out).foreign == ()  # the stray file is accounted for by the intent
    assert output.clean_dead_staging(out, keep_run_id="r2") == ["dead"]
    assert snapshot(out) == before


def test_a_commit_killed_after_its_manifest_is_finished_by_the_next_run(out):
    commit_run(out, "r1", run_files("r1"))
    stage(out, "r2", run_files("r2"))
    # Run the real commit, then put back what its clean-up removed: the state a kill right after the
    # manifest leaves behind (r1's files still there, r2's intent still staged).
    intent_path = f"{output.staging_dir(out, 'r2')}/{output.INTENT}"
    output.commit(out, "r2", {"run_id": "r2"}, {})
    for rel, data in run_files("r1").items():
        storage.write_bytes(f"{out}/{rel}", data)
    storage.write_bytes(intent_path, json.dumps({"run_id": "r2", "files": sorted(run_files("r2")),
                                                 "replaces": sorted(run_files("r1")),
                                                 "previous_run_id": "r1"}).encode())
    output.clean_dead_staging(out, keep_run_id="r3")
    assert set(snapshot(out)) == set(run_files("r2")) | {"summary.json", "_manifest.json", "_SUCCESS"}


def test_a_folder_with_files_docbeam_did_not_write_is_refused(out):
    storage.write_bytes(f"{out}/notes/keep-me.txt", b"mine")
    with pytest.raises(output.OutputRefused, match=r"holds 1 file\(s\) that no docbeam run wrote.*notes/keep-me.txt"):
        output.check_writable(out, output.inspect(out), "replace")
    assert storage.read_bytes(f"{out}/notes/keep-me.txt") == b"mine"


def test_an_empty_or_missing_folder_and_one_with_only_a_dead_staging_folder_are_writable(out):
    output.check_writable(out, output.inspect(out), "replace")
    stage(out, "dead", run_files("dead"))
    output.check_writable(out, output.inspect(out), "fail_if_exists")


def test_fail_if_exists_refuses_a_folder_holding_a_committed_run(out):
    commit_run(out, "r1", run_files("r1"))
    with pytest.raises(output.OutputRefused, match="already holds run r1 and output.mode is fail_if_exists"):
        output.check_writable(out, output.inspect(out), "fail_if_exists")


def test_a_manifest_of_another_format_is_refused(out):
    storage.write_bytes(f"{out}/_manifest.json", b'{"format": "somebody-else/3"}')
    with pytest.raises(output.OutputRefused, match="not a docbeam manifest"):
        output.inspect(out)


def test_deleting_refuses_paths_outside_the_output(tmp_path):
    victim = tmp_path / "sibling" / "data.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    out = str(tmp_path / "out")
    for path in (str(victim), f"{out}/../sibling/data.txt", f"{out}-other/x"):
        with pytest.raises(RuntimeError, match="outside the output folder"):
            output._delete_inside(out, [path])
    assert victim.read_text() == "precious"


def test_a_forged_intent_cannot_delete_outside_the_output(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep")
    out = str(tmp_path / "out")
    storage.write_bytes(f"{output.staging_dir(out, 'evil')}/{output.INTENT}", json.dumps(
        {"run_id": "evil", "files": ["../precious.txt"], "replaces": [], "previous_run_id": None}).encode())
    with pytest.raises(RuntimeError, match="outside the output folder"):
        output.clean_dead_staging(out, keep_run_id="r1")
    assert victim.read_text() == "keep"


def test_emptied_local_folders_are_removed_but_never_the_output_or_its_parents(tmp_path):
    parent = tmp_path / "runs"
    out = str(parent / "today")
    commit_run(out, "r1", run_files("r1"))
    stage(out, "dead", run_files("dead"))
    output.clean_dead_staging(out, keep_run_id="r2")
    assert not os.path.exists(f"{out}/{output.STAGING}") and os.path.isdir(out) and parent.is_dir()


def test_run_ids_sort_by_start_time_and_do_not_collide():
    ids = [output.new_run_id() for _ in range(50)]
    assert len(set(ids)) == 50
    assert all(len(i) == len("20261130T114500Z-3f9a1c") and i[8] == "T" for i in ids)

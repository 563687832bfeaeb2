"""pipeline/store/output.py: staged runs commit as a whole, and docbeam deletes only what its manifests list.

The same scenarios run on local disk and on gs:// (the emulator), since GCS has no rename.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
from gcs_emulator import gcs_emulator

from docbeam.pipeline.store import lock, output, storage, transaction


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


def stage(out: str, run_id: str, files: dict[str, bytes]) -> list[str]:
    """What a run's pipeline leaves in its staging folder; returns the paths its sinks report as written."""
    output.mark_staging(out, run_id, 1)
    written = [f"{output.staging_dir(out, run_id)}/{rel}" for rel in files]
    for path, data in zip(written, files.values()):
        storage.write_bytes(path, data)
    return written


def commit_run(out: str, run_id: str, files: dict[str, bytes]) -> dict:
    held = lock.OutputLock.acquire(out, run_id, heartbeat=False)
    transaction.recover(out, held)
    manifest = transaction.commit(out, held.fence, stage(out, run_id, files), {"run_id": run_id}, {})
    held.release()
    return manifest


def snapshot(out: str) -> dict[str, bytes]:
    """Every file outside _staging/, with its bytes: what a reader of the output can see."""
    staging = f"{out}/{output.STAGING}/"
    return {
        output.relative(out, p): storage.read_bytes(p) for p in storage.list_files(out) if not p.startswith(staging)
    }


def run_files(run_id: str, rows: bytes = b"rows") -> dict[str, bytes]:
    return {
        f"embeddings/part-{run_id}-00000-of-00001.parquet": rows,
        f"timing/part-{run_id}-00000-of-00001.jsonl": b"{}\n",
    }


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
            output.delete_inside(out, [path])
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("marked", [False, True])
def test_a_stray_or_forged_intent_deletes_nothing_its_run_did_not_write(tmp_path, marked):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep")
    out = str(tmp_path / "out")
    commit_run(out, "r1", run_files("r1"))
    storage.write_bytes(f"{out}/report.html", b"<html>")  # the user's, listed nowhere
    if marked:
        output.mark_staging(out, "evil", 1)
    storage.write_bytes(
        f"{output.staging_dir(out, 'evil')}/{output.INTENT}",
        json.dumps(
            {
                "format": output.INTENT_FORMAT,
                "run_id": "evil",
                "files": ["../precious.txt", "report.html"],
                "replaces": [],
                "manifest": {},
                "summary": {},
            }
        ).encode(),
    )
    commit_run(out, "r2", run_files("r2"))
    assert victim.read_text() == "keep" and storage.read_bytes(f"{out}/report.html") == b"<html>"
    assert storage.exists(f"{output.staging_dir(out, 'evil')}/{output.INTENT}") != marked  # unmarked: foreign


def test_a_manifest_that_lists_a_folder_never_costs_the_next_run_its_files(out):
    commit_run(out, "r1", run_files("r1"))
    manifest = json.loads(storage.read_bytes(f"{out}/_manifest.json"))
    manifest["files"].append({"path": "embeddings", "size": 0})
    storage.write_bytes(f"{out}/_manifest.json", json.dumps(manifest).encode())
    commit_run(out, "r2", run_files("r2"))
    assert {k: v for k, v in snapshot(out).items() if "/" in k} == run_files("r2")


def test_summary_json_or_success_without_a_manifest_is_foreign(out):
    storage.write_bytes(f"{out}/summary.json", b'{"mine": true}')
    storage.write_bytes(f"{out}/{output.STAGING}/x/{output.INTENT}", b'{"files": ["summary.json"]}')
    state = output.inspect(out)
    assert [output.relative(out, p) for p in state.foreign] == ["_staging/x/_commit.json", "summary.json"]
    with pytest.raises(output.OutputRefused, match="no docbeam run wrote"):
        output.check_writable(out, state, "replace")


def test_emptied_local_folders_are_removed_but_never_the_output_or_its_parents(tmp_path):
    parent = tmp_path / "runs"
    out = str(parent / "today")
    commit_run(out, "r1", run_files("r1"))
    stage(out, "dead", run_files("dead"))
    commit_run(out, "r2", run_files("r2"))
    assert not os.path.exists(f"{out}/{output.STAGING}") and os.path.isdir(out) and parent.is_dir()


def test_run_ids_sort_in_the_order_they_were_made_even_within_one_second():
    ids = [output.new_run_id() for _ in range(200)]  # microseconds apart: the random tail must not decide
    assert ids == sorted(ids) and len(set(ids)) == 200
    assert all(len(i) == len("20261130T114500.123456Z-3f9a1c") and i[8] == "T" for i in ids)


def test_a_run_id_that_does_not_sort_after_the_held_run_is_refused():
    held = {"run_id": "20261130T114500.000002Z-000000"}
    output.check_runs_in_order("out", held, "20261130T114500.000003Z-000000")
    output.check_runs_in_order("out", None, "20261130T114500.000001Z-000000")
    for behind in ("20261130T114500.000002Z-000000", "20261130T114500.000001Z-ffffff"):
        with pytest.raises(output.OutputRefused, match="holds run 20261130T114500.000002Z-000000, which does not"):
            output.check_runs_in_order("out", held, behind)


@pytest.mark.parametrize(
    "spelled, normal",
    [
        ("/data//runs/./today/", "/data/runs/today"),
        ("//data/x/../runs/today", "/data/runs/today"),
        ("out//local/.", "out/local"),
        ("gs://bucket/runs//./x/../today/", "gs://bucket/runs/today"),
    ],
)
def test_an_output_path_is_spelled_one_way_once_the_config_is_read(spelled, normal):
    from docbeam.config import OutputConfig

    assert OutputConfig(path=spelled).path == normal


def test_an_oddly_spelled_absolute_output_commits_and_the_next_run_replaces_it(tmp_path):
    from docbeam.config import OutputConfig

    out = OutputConfig(path=f"{tmp_path}//runs/./daily/../daily").path
    commit_run(out, "r1", run_files("r1"))
    commit_run(out, "r2", run_files("r2"))
    assert set(snapshot(out)) == set(run_files("r2")) | {"summary.json", "_manifest.json", "_SUCCESS"}


def test_the_commit_places_what_the_sinks_wrote_never_what_else_lies_in_staging(out):
    held = lock.OutputLock.acquire(out, "r1", heartbeat=False)
    written = stage(out, "r1", run_files("r1"))
    stray = f"{output.staging_dir(out, 'r1')}/embeddings/beam-temp-part-r1-x/leftover.parquet"
    storage.write_bytes(stray, b"a retried bundle's leftover")
    manifest = transaction.commit(out, held.fence, written, {"run_id": "r1"}, {})
    held.release()
    assert sorted(f["path"] for f in manifest["files"]) == sorted(run_files("r1"))
    assert set(snapshot(out)) == set(run_files("r1")) | {"summary.json", "_manifest.json", "_SUCCESS"}

"""The manifest's format_version: every manifest is read in the current form (pipeline/store/output.py,
upgrade_manifest), an output written before the field existed (tests/fixtures/outputs/v1-embedding, committed as
commit 8068f16 wrote it) still reads and is reused, and a manifest from a newer docbeam is refused."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
from cli_runner import run_docbeam
from conftest import REPO
from output_fixtures import V1_DOCS, V1_OUTPUT, fixture_config

from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.sinks.pgvector.rows import check_files, committed_rows, table_layout, vector_layout
from docbeam.pipeline.stages import reuse
from docbeam.pipeline.stages.rag_chunks import ReadBeamChunks
from docbeam.pipeline.store import output

V1_MANIFEST = os.path.join(V1_OUTPUT, output.MANIFEST)


def v1_raw() -> dict:
    with open(V1_MANIFEST) as f:
        return json.load(f)


def rows(folder: str) -> dict[str, dict]:
    table = pq.read_table(sorted(glob.glob(f"{folder}/{output.EMBEDDINGS}/*.parquet")))
    return {r["id"]: r for r in table.to_pylist()}


def copy_of_v1(tmp_path, name: str = "out", **changes) -> str:
    """A copy of the committed version-1 output, its manifest's fields replaced by ``changes``."""
    folder = str(tmp_path / name)
    shutil.copytree(V1_OUTPUT, folder)
    if changes:
        with open(os.path.join(folder, output.MANIFEST), "w") as f:
            json.dump({**v1_raw(), **changes}, f)
    return folder


def test_the_committed_fixture_is_a_version_1_output():
    raw = v1_raw()
    assert raw["format"] == output.MANIFEST_FORMAT and "format_version" not in raw
    assert raw["counts"]["docs_embedded"] == 6 and raw["kept_fields"] == {"source": "string"}


def test_read_manifest_gives_a_version_1_manifest_the_current_form_and_changes_nothing_it_held():
    raw = v1_raw()
    manifest = output.read_manifest(V1_OUTPUT)
    assert manifest["format_version"] == output.MANIFEST_VERSION == 2
    assert {name: manifest[name] for name in raw} == raw
    assert table_layout(manifest).folder == output.EMBEDDINGS
    check_files(V1_OUTPUT, manifest)  # what a pgvector load checks first, by the folder table_layout names
    assert vector_layout(V1_OUTPUT, manifest)[0] == ["embedding vector(32)"]
    ids = [doc_id for doc_id, _, _ in committed_rows(V1_OUTPUT, manifest)]
    assert sorted(ids) == sorted(rows(V1_OUTPUT))
    chunks = ReadBeamChunks(V1_OUTPUT)
    assert chunks.folder == output.EMBEDDINGS and len(chunks.files) == 1


def test_a_version_1_manifest_from_before_heads_granularity_and_later_key_fields_reads_as_their_defaults():
    """The oldest version-1 manifests lack what later runs recorded; upgrade_manifest says what those runs did."""
    raw = v1_raw()
    oldest = {name: value for name, value in raw.items() if name not in ("head", "granularity", "kept_fields")}
    oldest["reuse_key"] = {k: v for k, v in raw["reuse_key"].items() if k not in output.V1_KEY_DEFAULTS}
    upgraded = output.upgrade_manifest(oldest, "old/_manifest.json")
    assert upgraded["head"] == {"name": "embedding", "folder": output.EMBEDDINGS}
    assert upgraded["granularity"] == "document" and upgraded["kept_fields"] == {}
    assert upgraded["reuse_key"] == raw["reuse_key"]  # the fixture's run used exactly those defaults
    assert reuse.key_differences(upgraded["reuse_key"], raw["reuse_key"]) == []
    assert table_layout(upgraded).folder == output.EMBEDDINGS
    assert "head" not in oldest and "prompt" not in oldest["reuse_key"]  # upgraded in a copy
    no_key = output.upgrade_manifest({k: v for k, v in oldest.items() if k != "reuse_key"}, "old/_manifest.json")
    assert "reuse_key" not in no_key  # a run before incremental runs stays one that cannot be reused


@pytest.mark.slow
def test_an_incremental_run_over_a_version_1_output_reuses_every_document_byte_for_byte(tmp_path, tiny_checkpoint_dir):
    out = copy_of_v1(tmp_path)
    before, raw = rows(out), v1_raw()
    summary = run_job(fixture_config(V1_DOCS, out, tiny_checkpoint_dir, reuse_from=out))
    assert summary["reuse"]["run_id"] == raw["run_id"] and summary["reuse"]["reason"] == ""
    assert summary["docs_reused"] == 6 and summary["docs_encoded"] == 0 == summary["windows"]
    assert rows(out) == before
    with open(os.path.join(out, output.MANIFEST)) as f:
        written = json.load(f)
    assert written["format_version"] == 2 and written["previous_run_id"] == raw["run_id"]
    assert not any(raw["run_id"] in f["path"] for f in written["files"])  # the version-1 files were replaced


@pytest.mark.extra
@pytest.mark.filterwarnings("ignore:XDG_RUNTIME_DIR is not set")  # pgserver's runtime folder, as pgvector_test
def test_a_version_1_output_loads_into_pgvector_with_its_vectors_and_kept_fields(tmp_path, postgres):
    import psycopg

    from docbeam.pipeline.sinks.pgvector import load as pgvector

    out = copy_of_v1(tmp_path)
    done = pgvector.load(out, output.read_manifest(out), postgres, "from_v1")
    assert done["applied"] and done["run_id"] == v1_raw()["run_id"] and done["upserted"] == 6
    with psycopg.connect(postgres) as conn:
        loaded = conn.execute("SELECT id, embedding::text, fields FROM from_v1").fetchall()
    assert {doc_id: fields for doc_id, _, fields in loaded} == {i: {"source": "python-docstrings"} for i in rows(out)}
    for doc_id, vector, _ in loaded:
        assert json.loads(vector) == pytest.approx(rows(out)[doc_id]["embedding"], rel=1e-6)


@pytest.mark.slow
def test_a_fresh_run_writes_format_version_2_which_reads_back_unchanged(tmp_path, tiny_checkpoint_dir):
    out = str(tmp_path / "fresh")
    run_job(fixture_config(V1_DOCS, out, tiny_checkpoint_dir))
    with open(os.path.join(out, output.MANIFEST)) as f:
        written = json.load(f)
    assert written["format_version"] == output.MANIFEST_VERSION == 2
    assert output.read_manifest(out) == written


def test_a_manifest_from_a_newer_docbeam_is_refused_naming_the_file_the_version_and_the_fix(tmp_path):
    future = copy_of_v1(tmp_path, format_version=3)
    path = os.path.join(future, output.MANIFEST)
    expected = (
        f"{path} has format_version 3, and this docbeam reads manifests up to format_version 2: .*Upgrade docbeam"
    )
    with pytest.raises(output.ManifestTooNew, match=expected):
        output.read_manifest(future)
    with pytest.raises(output.ManifestTooNew, match=expected):
        ReadBeamChunks(future)
    for mismatch in ("encode_all", "fail"):  # not a mismatch that encoding everything would answer
        with pytest.raises(output.ManifestTooNew, match=expected):
            reuse.decide(future, v1_raw()["reuse_key"], mismatch)


@pytest.mark.parametrize("version", ["2", True, 0, 1.5])
def test_a_format_version_no_docbeam_writes_is_refused(tmp_path, version):
    folder = copy_of_v1(tmp_path, format_version=version)
    with pytest.raises(output.OutputRefused, match=f"has format_version {version!r}, which no docbeam writes"):
        output.read_manifest(folder)


@pytest.mark.slow
def test_a_run_into_an_output_of_a_newer_docbeam_exits_2_and_touches_nothing(tmp_path, tiny_checkpoint_dir):
    future = copy_of_v1(tmp_path, format_version=3)
    before = {p: open(p, "rb").read() for p in glob.glob(f"{future}/**", recursive=True) if os.path.isfile(p)}
    result = run_docbeam(
        "run",
        "--config",
        os.path.join(REPO, "configs", "local.yaml"),
        "--set",
        f"input.path={V1_DOCS}",
        "--set",
        f"output.path={future}",
        "--set",
        f"model.path={tiny_checkpoint_dir}",
    )
    assert result.returncode == 2, result.stderr
    [last] = result.stderr.strip().splitlines()[-1:]
    assert f"{future}/_manifest.json has format_version 3" in last and "Upgrade docbeam" in last
    assert {p: open(p, "rb").read() for p in glob.glob(f"{future}/**", recursive=True) if os.path.isfile(p)} == before


def test_sync_pgvector_of_an_output_of_a_newer_docbeam_exits_2_before_connecting(tmp_path):
    future = copy_of_v1(tmp_path, format_version=3)
    result = run_docbeam("sync-pgvector", future, "--table", "docs", "--dsn", "postgresql://nobody@127.0.0.1:1/none")
    assert result.returncode == 2, result.stderr
    assert "format_version 3" in result.stderr and "Upgrade docbeam" in result.stderr

"""A head of your own is one class: defined here, outside the product, named in YAML as
``model.head: tests.user_head_test:FirstTokenHead``, it runs through ``docbeam run``, an incremental run and
``docbeam report`` with no product file changed (docs/development.md's head recipe is this file)."""

from __future__ import annotations

import dataclasses
import glob
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from cli_runner import run_docbeam
from conftest import REPO, TEST_BATCHING

from docbeam.models.heads import ROWS_FOLDER, Column, Head, non_finite, window_facts

pytestmark = pytest.mark.slow
HEAD = "tests.user_head_test:FirstTokenHead"
TEXTS = {"a": "the river bank", "b": "a bank account", "c": "money in the bank", "d": "the other side of the river"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FirstTokenHead(Head):
    """A document's first token state (the [CLS] vector, not normalised) and its length as a score."""

    windows = "first"  # a document's row is its first window's, so documents are cut there

    @classmethod
    def resolve(cls, checkpoint, hf_config, carried, where, model_cfg):
        width = checkpoint.config.output_size
        return cls(name="first_token", pooling="cls", layers=(), width=width, folder=ROWS_FOLDER, carried=carried)

    def load_params(self, folder):
        return ()  # no layers after pooling

    def columns(self):
        return [Column("embedding", "vector", self.width), Column("score", "score")]

    def document_row(self, windows):
        first = min(windows, key=lambda w: w.index)
        vector = np.asarray(first.vector, np.float32)
        if not np.all(np.isfinite(vector)):
            return non_finite([first], [first], "first-token vector")
        return {
            "id": first.doc_id,
            "embedding": vector.tolist(),
            "score": float(np.linalg.norm(vector)),
            **window_facts(windows),
        }

    def reuse_key(self):
        return {"name": self.name, "pooling": self.pooling}

    def reusable(self, row):
        return len(row["embedding"]) == self.width and bool(np.isfinite(row["score"]))

    def summary_line(self):
        return f"first token ({self.width} values and their norm) → {self.folder}/"


def write_job(tmp_path, name: str, model_path: str, texts: dict, head: str, **sections) -> str:
    docs = tmp_path / f"{name}.jsonl"
    docs.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    config = {
        "input": {"path": str(docs), **sections.pop("input", {})},
        "output": {"path": str(tmp_path / name)},
        "model": {"path": model_path, "head": head, **sections.pop("model", {})},
        "batching": dict(TEST_BATCHING),
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def rows(output: str) -> dict[str, dict]:
    files = sorted(glob.glob(f"{output}/{ROWS_FOLDER}/*.parquet"))
    return {r["id"]: r for f in files for r in pq.read_table(f).to_pylist()}


@pytest.fixture(scope="module")
def own_head_runs(tiny_checkpoint_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own-head")
    first = run_docbeam("run", "--config", write_job(tmp, "first", tiny_checkpoint_dir, TEXTS, HEAD), cwd=REPO)
    changed = {**TEXTS, "d": "the far side of the river"}
    again = run_docbeam(
        "run",
        "--config",
        write_job(tmp, "again", tiny_checkpoint_dir, changed, HEAD, input={"reuse_from": str(tmp / "first")}),
        cwd=REPO,
    )
    # The built-in embedding head with the same pooling, unnormalised: its vectors are the first token states.
    builtin = write_job(
        tmp, "builtin", tiny_checkpoint_dir, TEXTS, "embedding", model={"pooling": "cls", "normalize": False}
    )
    reference = run_docbeam("run", "--config", builtin, cwd=REPO)
    return tmp, first, again, reference


def test_your_own_head_runs_through_docbeam_run_and_writes_the_columns_it_declares(own_head_runs):
    tmp, first, _, reference = own_head_runs
    assert first.returncode == 0, first.stderr
    assert reference.returncode == 0, reference.stderr
    mine, builtin = rows(str(tmp / "first")), rows(str(tmp / "builtin"))
    assert sorted(mine) == sorted(TEXTS)
    schema = pq.read_schema(glob.glob(f"{tmp}/first/{ROWS_FOLDER}/*.parquet")[0])
    assert schema.names[:3] == ["id", "embedding", "score"]
    for doc_id, row in mine.items():
        np.testing.assert_allclose(row["embedding"], builtin[doc_id]["embedding"], rtol=1e-6, atol=1e-6)
        assert row["score"] == pytest.approx(float(np.linalg.norm(row["embedding"])), rel=1e-6)
    summary = json.loads((tmp / "first" / "summary.json").read_text())
    assert summary["head"]["name"] == HEAD  # recorded as the import path it was loaded from
    assert summary["head"]["columns"][1] == {"name": "score", "kind": "score", "dim": None, "dtype": "float32"}
    assert "first token (" in first.stdout and "→ embeddings/" in first.stdout  # its own summary line


def test_an_incremental_run_reuses_your_own_heads_rows_and_encodes_only_the_changed_document(own_head_runs):
    tmp, first, again, _ = own_head_runs
    assert again.returncode == 0, again.stderr
    summary = json.loads((tmp / "again" / "summary.json").read_text())
    assert summary["docs_reused"] == len(TEXTS) - 1
    before, after = rows(str(tmp / "first")), rows(str(tmp / "again"))
    for doc_id in ("a", "b", "c"):
        assert after[doc_id]["embedding"] == before[doc_id]["embedding"]  # carried over, bit for bit
    assert after["d"]["embedding"] != before["d"]["embedding"]


def test_the_report_shows_your_own_heads_line(own_head_runs):
    tmp, *_ = own_head_runs
    result = run_docbeam("report", str(tmp / "again"), cwd=REPO)
    assert result.returncode == 0, result.stderr
    page = next(p for p in glob.glob(f"{tmp}/*.html") if "again" in p)
    assert "first token (" in open(page, encoding="utf-8").read()


def test_a_head_that_does_not_import_is_refused_at_load_naming_the_key(tiny_checkpoint_dir, tmp_path):
    config = write_job(tmp_path, "x", tiny_checkpoint_dir, TEXTS, "tests.user_head_test:NoSuchHead")
    result = run_docbeam("run", "--config", config, cwd=REPO)
    assert result.returncode == 2
    assert "model.head: cannot import 'tests.user_head_test:NoSuchHead'" in result.stderr
    assert not (tmp_path / "x").exists()

"""model.path as a Hub id (hf://org/name@revision): resolved through huggingface_hub into its cache, online
against a Hub of our own on loopback (tests/hub_server.py, never the real Hub) and offline from the cache;
only the files docbeam needs are downloaded, once per VM; a pickle-only repository is refused."""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import REPO, SAMPLE, checkout_env
from hub_server import Repo, hub_server, repo_from_folder

from docbeam.models.checkpoint import CheckpointError, HubId, parse_hub_id, pinned_path

COMMIT = hashlib.sha1(b"docbeam/tiny").hexdigest()
NOT_NEEDED = {"README.md": b"# tiny", "onnx/model.onnx": b"onnx" * 1000, "pytorch_model.bin": b"pickle" * 1000}
DOCS = 40

# Resolve a Hub id with its weights in a fresh process, as a worker does; print what it found.
RESOLVE = """
import json, os, sys
from docbeam.models import checkpoint, vm_cache
folder = checkpoint.resolve_dir(sys.argv[1], with_weights=True)
marker = [m for m in os.listdir(os.path.join(vm_cache.root(), "hub")) if not m.endswith(".lock")]
print(json.dumps({"folder": folder, "files": sorted(os.listdir(folder)),
                  "filled_by": vm_cache.filled_by(os.path.join(vm_cache.root(), "hub", marker[0]))}))
"""


@pytest.fixture(scope="module")
def repos(prompted_checkpoint) -> dict[str, Repo]:
    pickled = repo_from_folder(prompted_checkpoint, hashlib.sha1(b"pickled").hexdigest(), NOT_NEEDED)
    del pickled.files["model.safetensors"]
    return {"docbeam/tiny": repo_from_folder(prompted_checkpoint, COMMIT, NOT_NEEDED), "docbeam/pickled": pickled}


@pytest.fixture(scope="module")
def prompted_checkpoint(tmp_path_factory, real_checkpoint_dir) -> str:
    from conftest import write_tiny_checkpoint
    from prompts_test import PROMPTS, add_sentence_transformers_files

    folder = write_tiny_checkpoint(str(tmp_path_factory.mktemp("hub-tiny")), real_checkpoint_dir)
    return add_sentence_transformers_files(folder, {"prompts": PROMPTS})


def hub_env(tmp_path, url: str | None) -> dict:
    """A child process's environment: its own huggingface_hub cache and VM cache, online against ``url``
    or offline (``url`` None)."""
    env = {**checkout_env(), "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "DOCBEAM_VM_CACHE": str(tmp_path / "vm")}
    if url is None:
        return {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens on port 9
    return {**env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": url}


def job_config(tmp_path, model: str, out: str = "out") -> str:
    docs, config = tmp_path / "docs.jsonl", tmp_path / "job.yaml"
    with gzip.open(SAMPLE, "rt") as f:
        docs.write_text("".join(line for _, line in zip(range(DOCS), f)))
    config.write_text(
        json.dumps(
            {
                "input": {"path": str(docs)},
                "output": {"path": str(tmp_path / out)},
                "model": {"path": model},
                "tokenize": {"long_documents": "truncate"},
                "batching": {"buckets": [32, 64, 128], "tokens_per_batch": 2048},
            }
        )
    )
    return str(config)


def docbeam_run(tmp_path, model: str, env: dict, out: str = "out") -> subprocess.CompletedProcess:
    config = job_config(tmp_path, model, out)
    return subprocess.run(
        [sys.executable, "-m", "docbeam", "run", "--config", config],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def docbeam_run_online_here(tmp_path, model: str, url: str, monkeypatch, capsys, out: str = "out") -> tuple[int, str]:
    """``docbeam run`` through cli.main in this process, online against ``url``: its exit code and stderr.

    A subprocess's import of Beam and JAX was most of a refused run's time, and seconds of a whole one.
    docbeam reads HF_ENDPOINT and HF_HUB_CACHE at each call (models/checkpoint/source.py); huggingface_hub
    reads HF_HUB_OFFLINE once, at import, into ``constants`` (this process imported it offline), so online
    is set there as the variable would have set it. Offline cases stay subprocesses: they must show that
    the variable itself is honoured.
    """
    from huggingface_hub import constants

    from docbeam.pipeline.driver import cli

    config = job_config(tmp_path, model, out)
    for name, value in hub_env(tmp_path, url).items():
        if name.startswith(("HF_", "DOCBEAM_")):
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = cli.main(["run", "--config", config])
    return code, capsys.readouterr().err


def embeddings(output: str) -> dict[str, np.ndarray]:
    rows = pq.read_table(sorted(glob.glob(f"{output}/embeddings/*.parquet"))).to_pylist()
    return {r["id"]: np.asarray(r["embedding"], np.float32) for r in rows}


@pytest.mark.parametrize(
    "path, expected",
    [
        ("hf://org/name", HubId("org/name", "main")),
        ("hf://org/name@v1.0", HubId("org/name", "v1.0")),
        (f"hf://org/name@{COMMIT}", HubId("org/name", COMMIT)),
        ("hf://bert-base-uncased", HubId("bert-base-uncased", "main")),  # the Hub's early ids have no org
    ],
)
def test_a_hub_id_names_a_repository_and_a_revision(path, expected):
    assert parse_hub_id(path) == expected
    assert parse_hub_id(path).pinned == (expected.revision == COMMIT)


@pytest.mark.parametrize("path", ["hf://", "hf://org/name/extra", "hf://org/name@", "hf://org/na me"])
def test_a_malformed_hub_id_is_refused_with_the_form_to_write(path):
    with pytest.raises(CheckpointError, match=r"expected a Hub id hf://org/name or hf://org/name@revision"):
        parse_hub_id(path)


def test_a_branch_is_pinned_to_the_commit_its_snapshot_came_from():
    assert (
        pinned_path("hf://org/name@main", f"/cache/models--org--name/snapshots/{COMMIT}") == f"hf://org/name@{COMMIT}"
    )
    assert pinned_path("/models/tiny", "/models/tiny") == "/models/tiny"


@pytest.mark.slow
@pytest.mark.extra
def test_docbeam_run_resolves_a_hub_id_online_then_offline_from_the_cache(
    repos, prompted_checkpoint, tmp_path, monkeypatch, capsys
):
    from sentence_transformers import SentenceTransformer

    with hub_server(repos) as hub:
        code, stderr = docbeam_run_online_here(
            tmp_path, "hf://docbeam/tiny@main", hub.url, monkeypatch, capsys, "online"
        )
        assert code == 0, stderr[-3000:]
        requests = list(hub.requests)
    # Offline: the server is gone, and HF_HUB_OFFLINE keeps huggingface_hub from trying.
    offline = docbeam_run(tmp_path, "hf://docbeam/tiny@main", hub_env(tmp_path, None), "offline")
    assert offline.returncode == 0, offline.stderr[-3000:]

    summary = json.load(open(tmp_path / "online" / "summary.json"))
    assert summary["model"] == f"hf://docbeam/tiny@{COMMIT}"  # the workers loaded the commit main pointed at
    assert summary["reuse_key"]["model_revision"] == COMMIT
    local = hashlib.sha256(open(os.path.join(prompted_checkpoint, "model.safetensors"), "rb").read()).hexdigest()
    assert summary["reuse_key"]["weights_digest"] == f"sha256:{local}"  # the Hub's LFS sha256, not downloaded
    assert json.load(open(tmp_path / "offline" / "summary.json"))["reuse_key"] == summary["reuse_key"]

    downloaded = {
        path.split(f"/resolve/{COMMIT}/")[-1].split("/resolve/main/")[-1]
        for method, path in requests
        if method == "GET" and "/resolve/" in path
    }
    assert "model.safetensors" in downloaded and "config_sentence_transformers.json" in downloaded
    assert not downloaded & set(NOT_NEEDED)  # README, ONNX and pickle weights are never fetched
    assert sum(1 for m, p in requests if m == "GET" and p.endswith("/model.safetensors")) == 1

    ours, offline_vectors = embeddings(str(tmp_path / "online")), embeddings(str(tmp_path / "offline"))
    assert sorted(ours) == sorted(offline_vectors) and len(ours) == DOCS
    assert all(np.array_equal(ours[i], offline_vectors[i]) for i in ours)
    with gzip.open(SAMPLE, "rt") as f:
        texts = {d["id"]: d["text"] for d in map(json.loads, (line for _, line in zip(range(DOCS), f)))}
    ids = sorted(ours)
    expected = SentenceTransformer(prompted_checkpoint, device="cpu").encode_document([texts[i] for i in ids])
    got = np.array([ours[i] for i in ids])
    assert ((got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)).min() >= 0.99999


@pytest.mark.parametrize(
    "model, online, named",
    [
        (
            "hf://docbeam/pickled",
            True,
            f"hf://docbeam/pickled@{hashlib.sha1(b'pickled').hexdigest()}/pytorch_model.bin is a pickle checkpoint",
        ),
        ("hf://docbeam/tiny@main", False, "HF_HUB_OFFLINE is set and huggingface_hub's cache does not hold it"),
        ("hf://docbeam/missing", True, "the Hub refused it"),
    ],
)
def test_a_pickle_only_repository_or_one_not_cached_offline_exits_2_naming_why(
    repos, tmp_path, model, online, named, monkeypatch, capsys
):
    with hub_server(repos) as hub:
        if online:
            code, stderr = docbeam_run_online_here(tmp_path, model, hub.url, monkeypatch, capsys)
        else:
            result = docbeam_run(tmp_path, model, hub_env(tmp_path, None))
            code, stderr = result.returncode, result.stderr
        assert hub.downloads("pytorch_model.bin") == 0
    assert code == 2, stderr[-3000:]
    assert "docbeam: cannot start:" in stderr and named in stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("filled_by", ["a-driver", "a-worker-then-weights-deleted"])
def test_an_offline_cache_without_the_weights_exits_2_naming_them(repos, tmp_path, filled_by):
    """The cache holds the small files (a driver fetched them, or a cleanup removed the weights after a worker
    fetched them, leaving this VM's marker in place): refused at start naming model.safetensors, never a
    FileNotFoundError of a failed job."""
    resolve = (
        "import sys; from docbeam.models import checkpoint as c; f = c.resolve_dir(sys.argv[1]); "
        "c.resolve_dir(c.pinned_path(sys.argv[1], f), with_weights=sys.argv[2] == 'a-worker')"
    )
    with hub_server(repos) as hub:
        filled = subprocess.run(
            [sys.executable, "-c", resolve, "hf://docbeam/tiny@main", filled_by.split("-then")[0]],
            cwd=REPO,
            env=hub_env(tmp_path, hub.url),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert filled.returncode == 0, filled.stderr[-3000:]
    for weights in glob.glob(
        str(tmp_path / "hf-cache" / "models--docbeam--tiny" / "snapshots" / "*" / "model.safetensors")
    ):
        os.remove(weights)
    assert glob.glob(str(tmp_path / "hf-cache" / "models--docbeam--tiny" / "snapshots" / "*" / "config.json"))
    result = docbeam_run(tmp_path, "hf://docbeam/tiny@main", hub_env(tmp_path, None))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "docbeam: cannot start: model.path 'hf://docbeam/tiny@" in result.stderr
    assert "HF_HUB_OFFLINE is set and huggingface_hub's cache holds no model.safetensors for it" in result.stderr
    assert not (tmp_path / "out").exists()


def test_online_the_driver_holds_config_json_against_the_weights_header_without_downloading_them(
    prompted_checkpoint, tmp_path, monkeypatch, capsys
):
    one_layer = repo_from_folder(prompted_checkpoint, COMMIT)
    one_layer.files["config.json"] = json.dumps(
        {**json.loads(one_layer.files["config.json"]), "num_hidden_layers": 1}
    ).encode()
    with hub_server({"docbeam/tiny": one_layer}) as hub:
        code, stderr = docbeam_run_online_here(tmp_path, "hf://docbeam/tiny@main", hub.url, monkeypatch, capsys)
        assert hub.downloads("model.safetensors") == 0
        ranged = [p for m, p in hub.requests if m == "RANGE"]
    assert code == 2, stderr[-3000:]
    assert (
        f"docbeam: cannot start: model.path: hf://docbeam/tiny@{COMMIT}/model.safetensors holds tensors of 2 layers"
    ) in stderr
    assert ranged and all(p.endswith("/model.safetensors") for p in ranged)
    assert not (tmp_path / "out").exists()


def test_workers_fetch_a_pinned_hub_id_once_per_vm(repos, tmp_path):
    with hub_server(repos) as hub:
        env = hub_env(tmp_path, hub.url)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RESOLVE, f"hf://docbeam/tiny@{COMMIT}"],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        weights_downloads = hub.downloads("model.safetensors")
        api_calls = [p for m, p in hub.requests if p.startswith("/api/models/")]
    first, second = results
    assert first == second  # one folder, filled by one of the two processes
    assert first["folder"].endswith(f"/snapshots/{COMMIT}") and first["folder"].startswith(str(tmp_path / "hf-cache"))
    assert "model.safetensors" in first["files"] and not set(first["files"]) & set(NOT_NEEDED)
    assert weights_downloads == 1 and len(api_calls) == 1  # one tree listing: the other process asked nothing

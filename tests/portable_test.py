"""The portable path Dataflow Runner v2 takes: the graph goes as a proto over the job API to a job service,
and DoFns run in separate SDK worker processes. Beam's own local job service and an external worker pool
play Dataflow's parts here, on loopback ports, so nothing in the job may rely on sharing the driver's process.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from conftest import REPO, job_config

from docbeam.pipeline.driver.run import run_job

pytestmark = [pytest.mark.slow, pytest.mark.extra]
LOOPBACK = "localhost"
START_TIMEOUT_S = 60


def free_ports(n: int) -> list[int]:
    """``n`` different ports free now: their sockets stay bound until all are picked, so no two are the same
    (the services bind them a moment later: another process may still take one, a rare start failure)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for_port(port: int, process: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    with open(log_path, errors="replace") as f:
        raise RuntimeError(f"{process.args} did not listen on {port} within {START_TIMEOUT_S} s:\n{f.read()[-3000:]}")


@pytest.fixture(scope="module")
def portable_services(tmp_path_factory):
    """Beam's job service and an external SDK worker pool, started with this venv's Python and this checkout."""
    logs = tmp_path_factory.mktemp("portable")
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": REPO,
    }
    job_port, pool_port = free_ports(2)
    commands = {
        "job-service": (
            [sys.executable, "-m", "apache_beam.runners.portability.local_job_service_main", "--port", str(job_port)],
            job_port,
        ),
        "worker-pool": (
            [sys.executable, "-m", "apache_beam.runners.worker.worker_pool_main", "--service_port", str(pool_port)],
            pool_port,
        ),
    }
    processes = []
    try:
        for name, (command, port) in commands.items():
            log_path = str(logs / f"{name}.log")
            with open(log_path, "wb") as log:
                process = subprocess.Popen(command, cwd=str(logs), env=env, stdout=log, stderr=subprocess.STDOUT)
            processes.append(process)
            wait_for_port(port, process, log_path)
        yield {
            "job_endpoint": f"{LOOPBACK}:{job_port}",
            "environment_type": "EXTERNAL",
            "environment_config": f"{LOOPBACK}:{pool_port}",
        }
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_a_job_through_the_portable_runner_commits_its_outputs_and_summary(
    portable_services, tiny_checkpoint_dir, tmp_path
):
    docs = [
        {"id": f"d{i:02d}", "text": f"Document {i} is about worker pools and job services. " * (1 + i % 5)}
        for i in range(30)
    ]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    out = str(tmp_path / "out")
    cfg = job_config(
        str(corpus),
        out,
        tiny_checkpoint_dir,
        runner={"name": "PortableRunner", "progress_seconds": 0, "options": portable_services},
        # every method of output.dedup: its GroupByKeys, side inputs and combines in separate SDK workers too
        output={"dedup": {"exact": True, "near": {}, "semantic": {}}, "select": {"where": "not duplicate"}},
    )
    summary = run_job(cfg)

    with open(os.path.join(out, "summary.json")) as f:
        committed = json.load(f)
    with open(os.path.join(out, "_manifest.json")) as f:
        manifest = json.load(f)
    table = pq.read_table(sorted(glob.glob(f"{out}/embeddings/*.parquet")))
    timing = [json.loads(line) for p in glob.glob(f"{out}/timing/*.jsonl") for line in open(p)]
    assert summary["runner"] == committed["runner"] == "PortableRunner"
    assert (committed["docs_read"], committed["docs_embedded"], committed["docs_rejected"]) == (30, 30, 0)
    assert manifest["run_id"] == committed["run_id"] and os.path.exists(os.path.join(out, "_SUCCESS"))
    assert sorted(table.column("id").to_pylist()) == [d["id"] for d in docs]
    assert len(timing) == committed["batches"] > 0
    marked = pq.read_table(sorted(glob.glob(f"{out}/duplicates/*.parquet"))).column("id").to_pylist()
    assert (
        committed["dedup"]["kept"] + len(marked)
        == 30
        == committed["dedup"]["kept"] + sum(committed["dedup"]["marked"].values())
    )
    assert committed["docs_selected"] == committed["dedup"]["kept"]
    assert str(os.getpid()) not in {t["worker"].rsplit(":", 1)[1] for t in timing}, "encoded in the driver"

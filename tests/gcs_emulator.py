"""A throwaway GCS for tests: ``gcp-storage-emulator`` on a free loopback port, in memory.

gcp-storage-emulator rather than fake-gcs-server because it answers the JSON batch API that Beam's gcsio
uses to finalise writes (copy + delete of temp files); started through gcs_emulator_server.py, which adds
GCS's generation preconditions (the output lock and the fenced commit rely on them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from docbeam.pipeline.store.storage import EMULATOR_ENV

LOOPBACK = "127.0.0.1"
EMULATOR_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_emulator_server.py")
PROJECT = "docbeam-test"
START_TIMEOUT_S = 15.0


@dataclasses.dataclass(frozen=True)
class GcsEmulator:
    host: str  # what STORAGE_EMULATOR_HOST holds, e.g. "http://127.0.0.1:40123"
    bucket: str
    client: storage.Client

    def url(self, *parts: str) -> str:
        return "/".join([f"gs://{self.bucket}", *parts])


@contextlib.contextmanager
def gcs_emulator(bucket: str = "docbeam-test") -> Iterator[GcsEmulator]:
    """Start the emulator, create ``bucket``, point ``STORAGE_EMULATOR_HOST`` at it; undo all on exit.

    The variable is set in ``os.environ`` so clients created later in this process (Beam creates one per
    gcsio call) and subprocesses started inside the block both find the emulator.
    """
    with tempfile.TemporaryDirectory(prefix="gcs-emulator-") as work_dir:
        server, host = _start_server(work_dir)
        previous = os.environ.get(EMULATOR_ENV)
        os.environ[EMULATOR_ENV] = host
        try:
            client = storage.Client(
                project=PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": host}
            )
            client.create_bucket(bucket)
            yield GcsEmulator(host=host, bucket=bucket, client=client)
        finally:
            if previous is None:
                os.environ.pop(EMULATOR_ENV, None)
            else:
                os.environ[EMULATOR_ENV] = previous
            server.terminate()
            try:
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _start_server(work_dir: str) -> tuple[subprocess.Popen, str]:
    # The port is picked before the server binds it, so another process can take it in between: retry.
    for _ in range(3):
        port = _free_port()
        log_path = os.path.join(work_dir, f"emulator-{port}.log")
        with open(log_path, "wb") as log:
            # --data-dir keeps the emulator's files, if any, out of the working tree despite --in-memory.
            server = subprocess.Popen(
                [
                    sys.executable,
                    EMULATOR_SCRIPT,
                    "--data-dir",
                    work_dir,
                    "start",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(port),
                    "--in-memory",
                ],
                cwd=work_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        host = f"http://{LOOPBACK}:{port}"
        # A server still alive at the deadline is slow (a loaded machine), not beaten to its port: wait longer.
        if _wait_until_healthy(server, port, START_TIMEOUT_S) or (
            server.poll() is None and _wait_until_healthy(server, port, 3 * START_TIMEOUT_S)
        ):
            return server, host
        if server.poll() is None:
            server.kill()
        server.wait()
    with open(log_path, encoding="utf-8", errors="replace") as log:
        raise RuntimeError(
            f"gcp-storage-emulator did not answer on {host} (3 tries, each up to {4 * START_TIMEOUT_S:.0f} s); "
            f"its log:\n{log.read()}"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _wait_until_healthy(server: subprocess.Popen, port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        # http.client rather than urllib: no proxy settings can route this loopback request elsewhere.
        connection = http.client.HTTPConnection(LOOPBACK, port, timeout=0.5)
        try:
            connection.request("GET", "/")
            if connection.getresponse().status == 200:
                return True
        except OSError:
            pass
        finally:
            connection.close()
        time.sleep(0.05)
    return False


def matching(pattern: str) -> list[str]:
    """Sorted paths matching ``pattern`` through Beam's FileSystems (local or gs://); [] when none match."""
    from apache_beam.io.filesystems import FileSystems

    (match,) = FileSystems.match([pattern])
    return sorted(metadata.path for metadata in match.metadata_list)

"""A throwaway Hugging Face Hub for tests: the endpoints huggingface_hub 2.4.0 calls to resolve and download a
model repository, served from memory on a free loopback port (point ``HF_ENDPOINT`` at ``url``). Never the
real Hub. Every request is logged, so tests can say which files were downloaded and how often.

- ``GET /api/models/<repo>/revision/<rev>``: repo_info (the commit a branch points at);
- ``GET /api/models/<repo>/tree/<rev>[/<path>]``: list_repo_tree (size, git oid, and lfs sha256 for weights);
- ``HEAD|GET /<repo>/resolve/<rev>/<path>``: hf_hub_download (X-Repo-Commit, ETag, the bytes); a GET with a
  ``Range: bytes=a-b`` header gets those bytes (206), logged as ``RANGE``, not as a download.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.server
import json
import os
import threading
import urllib.parse
from typing import Iterator

LOOPBACK = "127.0.0.1"
LFS_SUFFIXES = (".safetensors", ".bin", ".onnx")  # stored in LFS on the Hub: the ETag is the content's sha256


@dataclasses.dataclass
class Repo:
    files: dict[str, bytes]
    commit: str  # what every branch and tag of this repository points at

    def entry(self, path: str) -> dict:
        data = self.files[path]
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        out = {"type": "file", "path": path, "size": len(data), "oid": blob}
        if path.endswith(LFS_SUFFIXES):
            out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out

    def etag(self, path: str) -> str:
        entry = self.entry(path)
        return entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]


def repo_from_folder(folder: str, commit: str, extra: dict[str, bytes] = None) -> Repo:
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = f.read()
    return Repo({**files, **(extra or {})}, commit)


@dataclasses.dataclass
class HubServer:
    url: str
    repos: dict[str, Repo]
    requests: list[tuple[str, str]]  # (method, path) in the order they came

    def downloads(self, filename: str) -> int:
        """GETs of ``filename``'s bytes, any repository and revision."""
        return sum(
            1
            for method, path in self.requests
            if method == "GET" and "/resolve/" in path and path.endswith("/" + filename)
        )


def _handler(hub: HubServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _answer(self, body: bool):
            path = urllib.parse.urlsplit(self.path).path
            ranged = self.command == "GET" and (self.headers.get("Range") or "").startswith("bytes=")
            hub.requests.append(("RANGE" if ranged else self.command, path))  # a ranged read is no download
            parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
            if parts[:2] == ["api", "models"]:
                return self._api(parts[2:])
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            self._json(404, {"error": "not found"})

        def _repo(self, name: str, revision: str) -> Repo | None:
            repo = hub.repos.get(name)
            if repo is None:
                self._json(404, {"error": f"Repository {name} not found"}, {"X-Error-Code": "RepoNotFound"})
                return None
            if revision not in ("main", repo.commit):
                self._json(404, {"error": f"Revision {revision} not found"}, {"X-Error-Code": "RevisionNotFound"})
                return None
            return repo

        def _api(self, parts: list[str]):
            name, kind, revision, rest = "/".join(parts[:2]), parts[2], parts[3], "/".join(parts[4:])
            repo = self._repo(name, revision)
            if repo is None:
                return
            if kind == "revision":
                return self._json(
                    200, {"id": name, "sha": repo.commit, "siblings": [{"rfilename": p} for p in sorted(repo.files)]}
                )
            if kind == "tree":
                recursive = "recursive=true" in self.path.lower()
                prefix = f"{rest}/" if rest else ""
                paths = sorted(
                    p for p in repo.files if p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])
                )
                folders = (
                    sorted(
                        {
                            prefix + p[len(prefix) :].split("/")[0]
                            for p in repo.files
                            if p.startswith(prefix) and "/" in p[len(prefix) :]
                        }
                    )
                    if not recursive
                    else []
                )
                return self._json(
                    200,
                    [repo.entry(p) for p in paths]
                    + [{"type": "directory", "path": f, "oid": "0" * 40, "size": 0} for f in folders],
                )
            self._json(404, {"error": "not found"})

        def _file(self, name: str, revision: str, path: str, body: bool):
            repo = self._repo(name, revision)
            if repo is None:
                return
            if path not in repo.files:
                return self._json(
                    404, {"error": f"{path} not found"}, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit}
                )
            data, status = repo.files[path], 200
            if body and (self.headers.get("Range") or "").startswith("bytes="):
                first, _, last = self.headers["Range"][len("bytes=") :].partition("-")
                data, status = data[int(first) : int(last) + 1 if last else None], 206
            self.send_response(status)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{repo.etag(path)}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _json(self, status: int, value, headers: dict | None = None):
            data = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            for key, header in (headers or {}).items():
                self.send_header(key, header)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


@contextlib.contextmanager
def hub_server(repos: dict[str, Repo]) -> Iterator[HubServer]:
    """Serve ``repos`` (repository id → Repo) on a free loopback port until the block ends."""
    hub = HubServer(url="", repos=repos, requests=[])
    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), _handler(hub))
    hub.url = f"http://{LOOPBACK}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="hub-server", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()

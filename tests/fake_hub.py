"""A minimal stand-in for the model hub's HTTP API, serving a local directory on loopback.

It answers the calls ``huggingface_hub.snapshot_download`` makes: repo info, the recursive
tree listing, and HEAD/GET on ``/{repo}/resolve/{revision}/{path}``. Used to test the real
download path without a network.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _sha1(p: Path) -> str:
    return hashlib.sha1(p.read_bytes()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    root: Path
    repo_id: str
    requests: list[str]

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass

    def _json(self, payload: object) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _not_found(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _route(self, head: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.requests.append(f"{self.command} {path}")
        info_prefix = f"/api/models/{self.repo_id}/revision/"
        tree_prefix = f"/api/models/{self.repo_id}/tree/"
        resolve_prefix = f"/{self.repo_id}/resolve/"
        files = _files(self.root)
        if path.startswith(info_prefix):
            self._json(
                {
                    "id": self.repo_id,
                    "modelId": self.repo_id,
                    "sha": COMMIT,
                    "siblings": [{"rfilename": str(p.relative_to(self.root))} for p in files],
                }
            )
        elif path.startswith(tree_prefix):
            self._json(
                [
                    {"type": "file", "path": str(p.relative_to(self.root)), "size": p.stat().st_size, "oid": _sha1(p)}
                    for p in files
                ]
            )
        elif path.startswith(resolve_prefix):
            rel = path[len(resolve_prefix) :].split("/", 1)[1]
            target = self.root / rel
            if not target.is_file():
                self._not_found()
                return
            data = target.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{_sha1(target)}"')
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if not head:
                self.wfile.write(data)
        else:
            self._not_found()

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._route(head=False)

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
        self._route(head=True)


@contextmanager
def fake_hub(root: Path, repo_id: str) -> Iterator[tuple[str, list[str]]]:
    """Serve ``root`` as ``repo_id``; yields (endpoint URL, list of requests seen)."""
    requests: list[str] = []
    handler = type("Handler", (_Handler,), {"root": root, "repo_id": repo_id, "requests": requests})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

"""A local stand-in for the Hugging Face Hub: the routes huggingface_hub's `list_repo_files`,
`snapshot_download` and `hf_hub_download` use, answered from files on this machine, so the hub
tests run without the internet (HF_ENDPOINT points here).

Routes, with the headers huggingface_hub reads (file_download.get_hf_file_metadata,
utils/_http.hf_raise_for_status):
- `GET /api/models/{repo}[/revision/{rev}]`: the repo's info (`sha`, `siblings`).
- `GET /api/models/{repo}/tree/{rev}`: its files (`type`, `path`, `size`, `oid`).
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: a file, with `ETag`, `X-Repo-Commit` and
  `Content-Length`; GET honours `Range` (a resumed download).
Errors as the hub sends them: 404 with `X-Error-Code: RepoNotFound`, `RevisionNotFound` or
`EntryNotFound`; 401 with `GatedRepo` for a gated repo without its token.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class FakeRepo:
    files: dict[str, str]  # path in the repo -> file on this machine
    sha: str = ""
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit
    token: str | None = None  # a gated repo: the token that opens it

    def __post_init__(self) -> None:
        digest = hashlib.sha1(json.dumps(sorted(self.files)).encode()).hexdigest()
        self.sha = self.sha or digest
        self.branches = {"main": self.sha, **self.branches}

    def commit(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.branches.values() else None


class FakeHub:
    """The server, on a free port of 127.0.0.1; `requests` lists (method, path) of every file
    request, for the tests that check what was fetched."""

    def __init__(self, repos: dict[str, FakeRepo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._answer(self, head=False)

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self) -> set[str]:
        """The repo files sent with GET (their bodies), as `repo/path`."""
        return {p for m, p in self.requests if m == "GET"}

    # ---------------------------------------------------------------- routes
    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/.*)?)?", path)
        if api is not None:
            repo_id, kind, revision = api.groups()
            return self._api(h, repo_id, kind or "revision", revision or "main")
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if resolve is not None:
            return self._file(h, *resolve.groups(), head=head)
        self._error(h, 404, "RepoNotFound", "not a hub route")

    def _lookup(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str) -> tuple[FakeRepo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", "Repository not found")
            return None
        commit = repo.commit(revision)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", "Invalid rev id")
            return None
        return repo, commit

    def _api(self, h: BaseHTTPRequestHandler, repo_id: str, kind: str, revision: str) -> None:
        found = self._lookup(h, repo_id, revision)
        if found is None:
            return
        repo, commit = found
        if kind == "tree":
            body = [{"type": "file", "path": p, "size": os.path.getsize(f), "oid": _etag(f)}
                    for p, f in sorted(repo.files.items())]
        else:
            body = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                    "gated": "manual" if repo.token else False,
                    "siblings": [{"rfilename": p} for p in sorted(repo.files)]}
        self._send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _file(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str, path: str, head: bool) -> None:
        found = self._lookup(h, repo_id, revision)
        if found is None:
            return
        repo, commit = found
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(h, 401, "GatedRepo", "Access to this model is restricted")
        local = repo.files.get(path)
        if local is None:
            return self._error(h, 404, "EntryNotFound", "Entry not found")
        self.requests.append(("HEAD" if head else "GET", f"{repo_id}/{path}"))
        size = os.path.getsize(local)
        start, status = 0, 200
        match = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        if match is not None and not head:
            start, status = int(match.group(1)), 206
        headers = {"ETag": f'"{_etag(local)}"', "X-Repo-Commit": commit, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream", "Content-Length": str(size - start)}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if head:
            return
        with open(local, "rb") as f:
            f.seek(start)
            while chunk := f.read(1 << 20):
                h.wfile.write(chunk)

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        FakeHub._send(h, status, json.dumps({"error": message}).encode(),
                      {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message})

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str]) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)


_ETAGS: dict[str, str] = {}


def _etag(path: str) -> str:
    """The sha256 of the file, as the hub's ETag of an LFS file (cached: the GGUF is large)."""
    if path not in _ETAGS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        _ETAGS[path] = digest.hexdigest()
    return _ETAGS[path]

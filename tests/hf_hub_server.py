"""A Hugging Face Hub on loopback: the routes huggingface_hub's snapshot_download / hf_hub_download call
(no tests here). Point HF_ENDPOINT (or `endpoint=`) at `HubServer.url` and the real client code runs.

Routes: repo info (`/api/models/<org>/<repo>[/revision/<rev>]`: sha and siblings), the tree listing
(`/api/models/<org>/<repo>/tree/<rev>`), and `/<org>/<repo>/resolve/<rev>/<path>` (HEAD and GET, ranged
GETs answered 206, with the X-Repo-Commit, ETag and Content-Length headers the client needs). Errors as the
Hub words them (X-Error-Code): an unknown repo, revision or file is a 404; a private repo without the right
bearer token is a 401 RepoNotFound, as the Hub answers for repos a caller may not see.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class HubRepo:
    """One model repo: revisions (branch or tag -> commit) and each commit's files."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> path -> content
    refs: dict[str, str] = field(default_factory=dict)  # "main", tags -> commit sha
    token: str | None = None  # private: this bearer token is required

    def add_commit(self, files: dict[str, bytes], refs: tuple[str, ...] = ("main",)) -> str:
        sha = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())).encode())
        commit = sha.hexdigest()
        self.commits[commit] = dict(files)
        for ref in refs:
            self.refs[ref] = commit
        return commit

    def resolve(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


class HubServer:
    """A ThreadingHTTPServer on 127.0.0.1:<free port>, as a context manager; `requests` logs (method, path)."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def add_repo(self, repo_id: str, token: str | None = None) -> HubRepo:
        self.repos[repo_id] = repo = HubRepo(token=token)
        return repo

    def count(self, method: str, pattern: str) -> int:
        return sum(1 for m, p in self.requests if m == method and re.search(pattern, p))


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_INFO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            pass

        def do_HEAD(self) -> None:
            self._route(send_body=False)

        def do_GET(self) -> None:
            self._route(send_body=True)

        def _route(self, send_body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub._lock:
                hub.requests.append((self.command, path))
            for pattern, handle in ((_TREE, self._tree), (_INFO, self._info), (_RESOLVE, self._resolve)):
                m = pattern.match(path)
                if m:
                    handle(m, send_body)
                    return
            self._error(404, "EntryNotFound", "no such route", send_body)

        def _repo(self, repo_id: str, revision: str, send_body: bool) -> tuple[HubRepo, str] | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found", send_body)
                return None
            if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(401, "RepoNotFound", "Invalid username or password.", send_body)
                return None
            commit = repo.resolve(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", send_body)
                return None
            return repo, commit

        def _info(self, m: re.Match[str], send_body: bool) -> None:
            found = self._repo(m.group(1), m.group(2) or "main", send_body)
            if found:
                repo, commit = found
                siblings = [{"rfilename": name} for name in sorted(repo.commits[commit])]
                self._json({"id": m.group(1), "modelId": m.group(1), "sha": commit, "siblings": siblings}, commit)

        def _tree(self, m: re.Match[str], send_body: bool) -> None:
            found = self._repo(m.group(1), m.group(2), send_body)
            if found:
                repo, commit = found
                under = f"{m.group(3).strip('/')}/" if m.group(3) else ""
                entries = [
                    {"type": "file", "path": name, "size": len(data), "oid": _etag(data)[:40]}
                    for name, data in sorted(repo.commits[commit].items())
                    if name.startswith(under)
                ]
                self._json(entries, commit)

        def _resolve(self, m: re.Match[str], send_body: bool) -> None:
            found = self._repo(m.group(1), m.group(2), send_body)
            if not found:
                return
            repo, commit = found
            data = repo.commits[commit].get(m.group(3))
            if data is None:
                self._error(404, "EntryNotFound", f"{m.group(3)} does not exist", send_body, commit)
                return
            start, end, status = 0, len(data), 200
            ranged = _RANGE.match(self.headers.get("Range", ""))
            if ranged and send_body:
                start = int(ranged.group(1))
                end = min(int(ranged.group(2)) + 1 if ranged.group(2) else len(data), len(data))
                status = 206
            self.send_response(status)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{_etag(data)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if send_body:
                self.wfile.write(data[start:end])
                with hub._lock:
                    hub.bytes_sent += end - start

        def _json(self, body: object, commit: str) -> None:
            raw = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

        def _error(self, status: int, code: str, message: str, send_body: bool, commit: str | None = None) -> None:
            raw = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if send_body:
                self.wfile.write(raw)

    return Handler

"""Loopback HTTP servers that stand in for remote weight sources in tests.

`HubStandIn` speaks the part of the Hugging Face Hub API that `huggingface_hub` uses for
`repo_info` and `hf_hub_download` (point it there with `endpoint=` or `HF_ENDPOINT`); not the tree
listing `snapshot_download` needs. It sends no Xet headers and no redirects: plain HTTP only.

`TlsFileServer` serves static files over HTTPS with a certificate from a test CA. aiohttp (and so
fsspec's "https" filesystem) builds its default SSL context once, when `aiohttp.connector` is
first imported, and that context honours `SSL_CERT_FILE`: set `SSL_CERT_FILE=srv.ca_file` before
aiohttp is imported (e.g. in a subprocess's environment). In a process that has imported aiohttp
already, call `trust_ca_in_aiohttp(srv.ca_file)` instead. Every server in a process shares one CA,
so trusting it once covers all of them. Beware: fsspec's `info()` turns a certificate failure into
FileNotFoundError too; an untrusted server records no request.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import ssl
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import trustme

_S = TypeVar("_S", bound="_LoopbackServer")
_H = BaseHTTPRequestHandler
_Query = dict[str, list[str]]


class _Handler(BaseHTTPRequestHandler):
    timeout = 30  # a stuck client does not hold a thread forever

    def setup(self) -> None:
        super().setup()
        if isinstance(self.request, ssl.SSLSocket):  # handshake here, not in the accept loop
            self.request.do_handshake()

    def do_GET(self) -> None:
        self.server.owner._dispatch(self)  # type: ignore[attr-defined]

    do_HEAD = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _HTTPServer(ThreadingHTTPServer):
    def __init__(self, owner: _LoopbackServer) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.owner = owner

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # clients hanging up are no news
            super().handle_error(request, client_address)


class _LoopbackServer:
    """A ThreadingHTTPServer on 127.0.0.1 in a daemon thread that records every request."""

    scheme = "http"

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[tuple[str, str]] = []  # (method, path without query), in order
        self._lock = threading.Lock()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self: _S) -> _S:
        if self._httpd is None:
            self._httpd = httpd = _HTTPServer(self)
            self._prepare(httpd)
            self._thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
            self._thread.start()
            self.url = f"{self.scheme}://127.0.0.1:{httpd.server_address[1]}"
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket (each connection serves one request)."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _prepare(self, httpd: _HTTPServer) -> None:
        """Hook to wrap the listening socket before serving."""

    def _dispatch(self, h: _H) -> None:
        url = urlsplit(h.path)
        with self._lock:
            self.requests.append((h.command, url.path))
        self._handle(h, url.path, parse_qs(url.query))

    def _handle(self, h: _H, path: str, query: _Query) -> None:
        raise NotImplementedError


def _send(h: _H, status: int, body: bytes, headers: dict[str, str], ranges: bool = False) -> None:
    """Answer with `body` (none on HEAD); with `ranges`, honour a single `Range: bytes=` on GET."""
    headers = dict(headers)
    if ranges:
        headers["Accept-Ranges"] = "bytes"
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", (h.headers.get("Range") or "").strip())
        if h.command == "GET" and m and (m[1] or m[2]):
            size = len(body)
            start = int(m[1]) if m[1] else max(size - int(m[2]), 0)
            end = min(int(m[2]) + 1, size) if m[1] and m[2] else size
            if start >= end:
                status, body, headers["Content-Range"] = 416, b"", f"bytes */{size}"
            else:
                status, body = 206, body[start:end]
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    headers["Content-Length"] = str(len(body))
    h.send_response(status)
    for name, value in headers.items():
        h.send_header(name, value)
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)


def _json(h: _H, body: Any) -> None:
    _send(h, 200, json.dumps(body).encode(), {"Content-Type": "application/json"})


def _error(h: _H, status: int, code: str | None, message: str, **headers: str) -> None:
    """An error the way the Hub sends it: X-Error-Code / X-Error-Message and a JSON body."""
    headers.update({"Content-Type": "application/json", "X-Error-Message": message})
    if code:
        headers["X-Error-Code"] = code
    _send(h, status, json.dumps({"error": message}).encode(), headers)


# Suffixes the Hub's default .gitattributes sends to LFS: their ETag is the sha256.
_LFS_SUFFIXES = (".bin", ".safetensors", ".pt", ".pth", ".ckpt", ".h5", ".onnx", ".gguf")
# (path prefix, repo type, is the JSON API); the first that matches wins.
_ROUTES = (
    ("/api/models/", "model", True),
    ("/api/datasets/", "dataset", True),
    ("/datasets/", "dataset", False),
    ("/", "model", False),
)


def _blob(path: str, data: bytes) -> dict[str, Any]:
    """A file's metadata as the Hub lists it in a repo's siblings."""
    meta: dict[str, Any] = {"size": len(data)}
    meta["blobId"] = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
    if path.endswith(_LFS_SUFFIXES):
        sha = hashlib.sha256(data).hexdigest()
        meta["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 134}
    return meta


@dataclass
class _Commit:
    sha: str
    files: dict[str, bytes]
    date: str  # ISO 8601, as the Hub writes it


@dataclass
class _Repo:
    repo_id: str
    repo_type: str
    token: str | None
    commits: dict[str, _Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branches and tags -> commit sha


class HubStandIn(_LoopbackServer):
    """The Hub's file API for model and dataset repos; a `token` makes a repo private."""

    def __init__(self) -> None:
        super().__init__()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._downloads: Counter[tuple[str, str]] = Counter()
        self._released = threading.Event()
        self._released.set()

    def hold_downloads(self) -> None:
        """File contents wait (up to 60 s) until `release_downloads`; metadata still answers."""
        self._released.clear()

    def release_downloads(self) -> None:
        self._released.set()

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        repo_type: str = "model",
        token: str | None = None,
        tags: tuple[str, ...] = (),
    ) -> str:
        """Create a repo whose branch "main" holds `files`; return that commit's sha."""
        with self._lock:
            if (repo_type, repo_id) in self._repos:
                raise ValueError(f"{repo_type} repo {repo_id} exists already")
            self._repos[repo_type, repo_id] = _Repo(repo_id, repo_type, token)
        return self.commit(repo_id, dict(files), repo_type=repo_type, tags=tags)

    def commit(
        self,
        repo_id: str,
        files: dict[str, bytes | None],
        *,
        repo_type: str = "model",
        tags: tuple[str, ...] = (),
    ) -> str:
        """A commit on "main" that adds or replaces `files` (None deletes one) and keeps the rest;
        return its sha. `tags` move to it; older commits stay resolvable by sha."""
        with self._lock:
            repo = self._repos[repo_type, repo_id]
            parent = repo.commits.get(repo.refs.get("main", ""))
            tree = dict(parent.files) if parent else {}
            for path, data in files.items():
                if data is None:
                    tree.pop(path, None)
                else:
                    tree[path] = bytes(data)
            digest = hashlib.sha1(f"{repo_type}/{repo_id}@{len(repo.commits)}".encode())
            for path in sorted(tree):
                digest.update(path.encode() + b"\0" + hashlib.sha256(tree[path]).digest())
            date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
            sha = digest.hexdigest()
            repo.commits[sha] = _Commit(sha, tree, date)
            repo.refs.update(dict.fromkeys(("main", *tags), sha))
            return sha

    def downloads(self, repo_id: str, repo_type: str | None = None) -> int:
        """How many GETs of file contents (resolve URLs) of the repo were served."""
        with self._lock:
            counts = self._downloads.items()
            return sum(n for (t, r), n in counts if r == repo_id and repo_type in (None, t))

    def _handle(self, h: _H, path: str, query: _Query) -> None:
        prefix, repo_type, is_api = next(r for r in _ROUTES if path.startswith(r[0]))
        rest = path[len(prefix) :]
        with self._lock:
            found = [r for t, r in self._repos if t == repo_type and f"{rest}/".startswith(f"{r}/")]
            repo = self._repos[repo_type, max(found, key=len)] if found else None
        if repo is None:
            _error(h, 404, "RepoNotFound", "Repository not found")
            return
        if repo.token is not None and h.headers.get("Authorization") != f"Bearer {repo.token}":
            _error(h, 401, "RepoNotFound", "Invalid username or password.")
            return
        action, _, sub = rest[len(repo.repo_id) + 1 :].partition("/")
        if is_api and action in ("", "revision"):
            self._info(h, repo, unquote(sub) if action else "main", query)
        elif not is_api and action == "resolve":
            revision, _, name = sub.partition("/")
            self._resolve(h, repo, unquote(revision), unquote(name))
        else:
            _error(h, 404, None, "Not found")

    def _commit_at(self, h: _H, repo: _Repo, revision: str) -> _Commit | None:
        """The commit a branch, tag or sha names; None after answering 404 RevisionNotFound."""
        with self._lock:
            commit = repo.commits.get(repo.refs.get(revision, revision))
        if commit is None:
            _error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def _info(self, h: _H, repo: _Repo, revision: str, query: _Query) -> None:
        if (commit := self._commit_at(h, repo, revision)) is None:
            return
        blobs = query.get("blobs") == ["true"]  # files_metadata=True
        siblings = [
            {"rfilename": p, **(_blob(p, data) if blobs else {})}
            for p, data in sorted(commit.files.items())
        ]
        body: dict[str, Any] = {
            "id": repo.repo_id,
            "author": repo.repo_id.partition("/")[0],
            "sha": commit.sha,
            "lastModified": commit.date,
            "private": repo.token is not None,
            "gated": False,
            "siblings": siblings,
        }
        if expand := query.get("expand"):  # only the properties asked for
            body = {k: v for k, v in body.items() if k in ("id", *expand)}
        _json(h, body)

    def _resolve(self, h: _H, repo: _Repo, revision: str, name: str) -> None:
        if (commit := self._commit_at(h, repo, revision)) is None:
            return
        if name not in commit.files:
            _error(h, 404, "EntryNotFound", "Entry not found", **{"X-Repo-Commit": commit.sha})
            return
        data, meta = commit.files[name], _blob(name, commit.files[name])
        etag = meta["lfs"]["sha256"] if "lfs" in meta else meta["blobId"]
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{etag}"'}
        if h.command == "GET":
            self._released.wait(timeout=60)
            with self._lock:
                self._downloads[repo.repo_type, repo.repo_id] += 1
        _send(h, 200, data, {**headers, "Content-Type": "application/octet-stream"}, ranges=True)


@functools.cache
def _test_ca() -> trustme.CA:
    """One test CA per process, so trusting one server's `ca_file` trusts them all."""
    return trustme.CA()


def trust_ca_in_aiohttp(ca_file: str) -> None:
    """Add the CA to aiohttp's default verified SSL context (built when aiohttp was imported)."""
    from aiohttp import connector

    connector._SSL_CONTEXT_VERIFIED.load_verify_locations(cafile=ca_file)


class TlsFileServer(_LoopbackServer):
    """Static files over HTTPS (GET, HEAD, Range) with a cert for 127.0.0.1 and localhost."""

    scheme = "https"

    def __init__(self) -> None:
        super().__init__()
        self.ca_file = ""
        self._files: dict[str, tuple[bytes, dict[str, str]]] = {}
        self._downloads: Counter[str] = Counter()
        self._tmp: str | None = None

    def put(self, path: str, data: bytes) -> None:
        """Serve `data` at url + "/" + path, replacing what was there (new ETag, Last-Modified)."""
        headers = {
            "ETag": f'"{hashlib.sha256(data).hexdigest()[:32]}"',
            "Last-Modified": formatdate(time.time(), usegmt=True),
            "Content-Type": "application/octet-stream",
        }
        with self._lock:
            self._files[path.lstrip("/")] = (bytes(data), headers)

    def remove(self, path: str) -> None:
        """Stop serving `path`: it answers 404 from now on."""
        with self._lock:
            self._files.pop(path.lstrip("/"), None)

    def downloads(self, path: str) -> int:
        """How many GETs of `path` were served."""
        with self._lock:
            return self._downloads[path.lstrip("/")]

    def stop(self) -> None:
        super().stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _prepare(self, httpd: _HTTPServer) -> None:
        ca = _test_ca()
        self._tmp = tempfile.mkdtemp(prefix="tls-file-server-")
        self.ca_file = os.path.join(self._tmp, "ca.pem")
        ca.cert_pem.write_to_path(self.ca_file)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
        httpd.socket = context.wrap_socket(
            httpd.socket, server_side=True, do_handshake_on_connect=False
        )

    def _handle(self, h: _H, path: str, query: _Query) -> None:
        key = unquote(path).lstrip("/")
        with self._lock:
            found = self._files.get(key)
            if found is not None and h.command == "GET":
                self._downloads[key] += 1
        if found is None:
            _send(h, 404, b"Not Found", {"Content-Type": "text/plain"})
        else:
            _send(h, 200, *found, ranges=True)

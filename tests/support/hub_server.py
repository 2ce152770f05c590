"""A Hugging Face Hub look-alike for offline tests: the HTTP calls huggingface_hub makes, standard library only.

Repos are folders under ROOT: `ROOT/<org>/<name>/` is revision "main" and `ROOT/<org>/<name>@<rev>/` is another
branch or tag of the same repo. A revision's commit sha is a hash of its content, so it is stable between runs.

Served, as the Hub does (checked with huggingface_hub 2.4):
- `GET /api/models/<repo>[/revision/<rev>]`: `{"id", "sha", "siblings", "private", "gated", ...}`;
- `GET /api/models/<repo>/tree/<rev>[/<dir>][?recursive=true]`: `[{"type", "path", "size", "oid", "lfs"?}]`;
- `HEAD|GET /<repo>/resolve/<rev>/<path>`: `X-Repo-Commit` and `ETag` headers, `Range` answered with 206.
Files of `lfs_threshold` bytes or more are LFS files: the tree entry carries `lfs.oid` (sha256) and `/resolve`
answers 302 to a "CDN" on the other loopback name (127.0.0.1 <-> localhost), with `X-Linked-Size`/`X-Linked-Etag`.
The two names are different hosts to a client, so it must not send its Authorization header there; every
request is logged in `HubServer.requests` so tests can check that, and check `Range` headers.
Errors carry the Hub's `X-Error-Code`: RepoNotFound (401, also for private repos without a valid token),
GatedRepo (401 without a token, 403 with a wrong one; info and tree stay public), RevisionNotFound and
EntryNotFound (404). No Xet headers are ever sent, so clients use plain HTTP.

Test knobs: `throttle` (bytes/s for CDN downloads, to kill a client halfway) and `tamper` (repo-relative
"org/name/path" names whose served bytes are corrupted while their metadata stays right).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/(.*))?)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_CDN = re.compile(r"^/_cdn/([0-9a-f]{64})$")


@dataclass(frozen=True)
class Request:
    """One request as the server saw it."""

    method: str
    path: str
    host: str
    has_auth: bool
    range: str | None


@dataclass(frozen=True)
class HubFile:
    path: str  # relative to the repo root, with "/"
    size: int
    oid: str  # git blob sha1 of the content, or of the LFS pointer for LFS files
    sha256: str
    is_lfs: bool
    pointer_size: int  # size of the LFS pointer file, 0 for plain files
    source: Path


@lru_cache(maxsize=4096)
def _digests(source: str, mtime_ns: int, size: int) -> tuple[str, str]:
    data = Path(source).read_bytes()
    return _git_blob_sha1(data), hashlib.sha256(data).hexdigest()


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def scan_repo(folder: Path, lfs_threshold: int) -> list[HubFile]:
    """The files of one revision folder, as the Hub's tree lists them."""
    files = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        st = p.stat()
        blob, sha256 = _digests(str(p), st.st_mtime_ns, st.st_size)
        pointer = b""
        if st.st_size >= lfs_threshold:  # the git blob is the pointer file, as on the Hub
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {st.st_size}\n".encode()
            blob = _git_blob_sha1(pointer)
        path = p.relative_to(folder).as_posix()
        files.append(HubFile(path, st.st_size, blob, sha256, bool(pointer), len(pointer), p))
    return files


def commit_sha(files: list[HubFile]) -> str:
    return hashlib.sha1(json.dumps([(f.path, f.oid) for f in files]).encode()).hexdigest()


class HubServer:
    """`with HubServer(root, gated={"org/x"}, tokens={"hf_ok"}) as url:` serves ROOT on 127.0.0.1:<free port>."""

    def __init__(self, root: Path, *, gated=(), private=(), tokens=(), lfs_threshold: int = 1 << 20,
                 throttle: int | None = None, tamper=()):
        self.root, self.gated, self.private, self.tokens = Path(root), set(gated), set(private), set(tokens)
        self.lfs_threshold, self.throttle, self.tamper = lfs_threshold, throttle, set(tamper)
        self.requests: list[Request] = []
        self._cdn_files: dict[str, tuple[Path, str]] = {}  # sha256 -> (file, "org/name/path")
        handler = type("BoundHandler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_port
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self.url

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # repository lookups

    def repo_exists(self, repo: str) -> bool:
        base = self.root / repo
        return base.is_dir() or any(base.parent.glob(f"{base.name}@*"))

    def revision_folder(self, repo: str, rev: str) -> Path | None:
        base = self.root / repo
        named = base if rev == "main" else base.parent / f"{base.name}@{rev}"
        if named.is_dir():
            return named
        for folder in [base, *base.parent.glob(f"{base.name}@*")]:  # a commit sha
            if folder.is_dir() and commit_sha(self.files(folder)) == rev:
                return folder
        return None

    def files(self, folder: Path) -> list[HubFile]:
        return scan_repo(folder, self.lfs_threshold)

    def access_error(self, repo: str, authorization: str | None, downloading: bool):
        """(status, X-Error-Code, message) when the caller may not read this repo, else None."""
        token = authorization[len("Bearer "):] if authorization and authorization.startswith("Bearer ") else None
        if token in self.tokens:
            return None
        if repo in self.private:
            return 401, "RepoNotFound", "Repository Not Found"
        if repo in self.gated and downloading:
            return (401 if token is None else 403), "GatedRepo", f"Access to model {repo} is restricted."
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer

    def log_message(self, *args) -> None:  # quiet test output
        pass

    def do_HEAD(self) -> None:
        self.handle_request(head=True)

    def do_GET(self) -> None:
        self.handle_request(head=False)

    def handle_request(self, head: bool) -> None:
        hub, split = self.hub, urlsplit(self.path)
        hub.requests.append(Request(self.command, self.path, self.headers.get("Host", ""),
                                    "Authorization" in self.headers, self.headers.get("Range")))
        if m := _CDN.match(split.path):
            return self.cdn(m.group(1), head)
        if m := _API.match(split.path):
            repo, op, rev, sub = m.group(1), m.group(2) or "revision", unquote(m.group(3) or "main"), m.group(4)
        elif m := _RESOLVE.match(split.path):
            repo, op, rev, sub = m.group(1), "resolve", unquote(m.group(2)), unquote(m.group(3))
        else:
            return self.fail(404, "NotFound", "Not Found", head)
        if not hub.repo_exists(repo):
            return self.fail(401, "RepoNotFound", "Repository Not Found", head)
        if err := hub.access_error(repo, self.headers.get("Authorization"), downloading=op == "resolve"):
            return self.fail(*err, head)
        folder = hub.revision_folder(repo, rev)
        if folder is None:
            return self.fail(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        files = hub.files(folder)
        sha = commit_sha(files)
        if op == "revision":
            return self.info(repo, sha, files, head)
        if op == "tree":
            return self.tree(files, sha, sub or "", "recursive=true" in split.query.lower(), head)
        return self.resolve(repo, sha, files, sub, head)

    def info(self, repo: str, sha: str, files: list[HubFile], head: bool) -> None:
        self.send(200, {"id": repo, "modelId": repo, "sha": sha, "private": repo in self.hub.private,
                        "gated": "manual" if repo in self.hub.gated else False, "disabled": False,
                        "tags": [], "siblings": [{"rfilename": f.path} for f in files]}, head=head)

    def tree(self, files: list[HubFile], sha: str, sub: str, recursive: bool, head: bool) -> None:
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        inside = [f for f in files if f.path.startswith(prefix)]
        if prefix and not inside:
            return self.fail(404, "EntryNotFound", f"{sub} does not exist", head, {"X-Repo-Commit": sha})
        entries, dirs = [], set()
        for f in inside:
            parts = f.path[len(prefix):].split("/")
            if recursive or len(parts) == 1:
                entry = {"type": "file", "oid": f.oid, "size": f.size, "path": f.path}
                if f.is_lfs:
                    entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
                entries.append(entry)
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                dirs.add(prefix + "/".join(parts[:depth]))
        entries += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                    for d in sorted(dirs)]
        self.send(200, entries, head=head)

    def resolve(self, repo: str, sha: str, files: list[HubFile], path: str, head: bool) -> None:
        f = next((f for f in files if f.path == path), None)
        if f is None:
            return self.fail(404, "EntryNotFound", f"{path} does not exist", head, {"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "ETag": f'"{f.oid}"', "Accept-Ranges": "bytes"}
        if f.is_lfs:  # like the Hub: a redirect to a CDN on another host, which carries the real size/etag
            self.hub._cdn_files[f.sha256] = (f.source, f"{repo}/{path}")
            host = self.headers.get("Host", "127.0.0.1").split(":")[0]
            cdn = "localhost" if host != "localhost" else "127.0.0.1"
            headers.update({"Location": f"http://{cdn}:{self.hub.port}/_cdn/{f.sha256}",
                            "X-Linked-Size": f.size, "X-Linked-Etag": f'"{f.sha256}"'})
            return self.send(302, b"", headers, head)
        self.send_file(f.source, f"{repo}/{path}", headers, head)

    def cdn(self, sha256: str, head: bool) -> None:
        if sha256 not in self.hub._cdn_files:
            return self.fail(404, "NotFound", "Not Found", head)
        source, name = self.hub._cdn_files[sha256]
        self.send_file(source, name, {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes"}, head,
                       throttle=self.hub.throttle)

    def send_file(self, source: Path, name: str, headers: dict, head: bool, throttle: int | None = None) -> None:
        data = source.read_bytes()
        if name in self.hub.tamper:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        status, rng = 200, re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if rng:
            start, end = int(rng.group(1)), int(rng.group(2) or len(data) - 1)
            headers = {**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"}
            status, data = 206, data[start:end + 1]
        self.send(status, data, {**headers, "Content-Type": "application/octet-stream"}, head, throttle)

    def fail(self, status: int, code: str, message: str, head: bool, extra: dict | None = None) -> None:
        self.send(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})}, head)

    def send(self, status: int, body, headers: dict | None = None, head: bool = False,
             throttle: int | None = None) -> None:
        headers = dict(headers or {})
        if not isinstance(body, bytes):
            body, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        try:
            step = 64 * 1024 if throttle else len(body) or 1
            for start in range(0, len(body), step):
                self.wfile.write(body[start:start + step])
                if throttle:
                    time.sleep(step / throttle)
        except (BrokenPipeError, ConnectionResetError):  # the client was killed mid-download
            self.close_connection = True

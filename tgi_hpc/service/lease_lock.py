"""A lock file that excludes across nodes on NFS, Lustre and GPFS, where `flock` may not.

On Lustre mounted with `localflock`, `flock` excludes only the processes of one node, and the jobs of a
service run on several. This lock uses only what every shared file system makes atomic: `link()` of a
private file onto the lock's name (the classic NFS-safe O_EXCL), `unlink()` and `rename()`.

- Holder id: the lock file says who holds it (`host pid token`) and a beat counter.
- Lease: while held, a thread rewrites the beat every `lease_s / 4`. A waiter that sees the same bytes
  for `lease_s` of its own monotonic clock takes the holder for dead (killed -9, its node lost), so no
  clock of another node is trusted, and breaks the lock.
- Breaking is itself excluded (`<lock>.break`, taken the same way), and the breaker unlinks the lock only
  if it still holds the bytes it saw go stale: a lock taken over meanwhile is left alone.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LEASE_S = 30.0
POLL_S = 0.05


def _host() -> str:
    return socket.gethostname()


def _read(path: Path) -> bytes | None:
    """The lock's bytes, None when there is no lock."""
    try:
        with open(path, "rb") as fh:   # an open revalidates NFS's cached data (close-to-open)
            return fh.read()
    except FileNotFoundError:
        return None


def _link_exclusive(private: Path, target: Path) -> bool:
    """link() `private` to `target`: True if we made it. A lost NFS reply still counts when the
    private file now has two names."""
    try:
        os.link(private, target)
        return True
    except FileExistsError:   # also what a retransmitted link() answers when the first one got through
        return os.stat(private).st_nlink == 2


class _Staleness:
    """Watches one file's bytes: stale once they stayed the same for `lease_s` on this node's clock."""

    def __init__(self, lease_s: float):
        self.lease_s, self.seen, self.since = lease_s, None, 0.0

    def stale(self, content: bytes | None) -> bool:
        if content is None or content != self.seen:
            self.seen, self.since = content, time.monotonic()
            return False
        return time.monotonic() - self.since >= self.lease_s


class LeaseLock:
    """`with LeaseLock(path): ...` holds `path` against every process on every node that uses it."""

    def __init__(self, path: str | Path, lease_s: float = LEASE_S, timeout: float | None = None):
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.path, self.lease_s, self.timeout = Path(path), lease_s, timeout
        self.holder = f"{_host()} {os.getpid()} {secrets.token_hex(8)}"
        self._beat, self._stop, self._thread, self._ino = 0, threading.Event(), None, None

    def _content(self) -> bytes:
        return f"{self.holder} {self._beat:012d}\n".encode()   # one length: a rewrite never shrinks it

    def _private(self, suffix: str, content: bytes) -> Path:
        private = self.path.with_name(f"{self.path.name}{suffix}.{self.holder.replace(' ', '.')}")
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)
        return private

    def acquire(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self.path.parent.mkdir(parents=True, exist_ok=True)
        private = self._private("", self._content())
        watch, breaker_watch = _Staleness(self.lease_s), _Staleness(self.lease_s)
        try:
            while not _link_exclusive(private, self.path):
                content = _read(self.path)
                if watch.stale(content):
                    logger.warning("lock %s: holder %r stopped renewing its lease for %.0f s: taking over",
                                   self.path, content.decode(errors="replace").strip(), self.lease_s)
                    self._break(content, breaker_watch)
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"lock {self.path} held by {(content or b'').decode(errors='replace')!r}")
                time.sleep(POLL_S * (0.5 + secrets.randbelow(1000) / 1000))
            self._ino = os.stat(self.path).st_ino
        finally:
            private.unlink(missing_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name=f"lease {self.path.name}", daemon=True)
        self._thread.start()

    def _break(self, stale: bytes, breaker_watch: _Staleness) -> None:
        """Unlink the lock if it still holds `stale`, excluded from other breakers by `<lock>.break`."""
        breaker = self.path.with_name(self.path.name + ".break")
        mine = self._private(".break", self._content())
        try:
            if not _link_exclusive(mine, breaker):
                # A breaker died between its link and its unlink (milliseconds): its file is left behind.
                if breaker_watch.stale(_read(breaker)):
                    breaker.unlink(missing_ok=True)
                return
            try:
                if _read(self.path) == stale:
                    self.path.unlink(missing_ok=True)
            finally:
                breaker.unlink(missing_ok=True)
        finally:
            mine.unlink(missing_ok=True)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                fd = os.open(self.path, os.O_WRONLY)
            except FileNotFoundError:
                logger.error("lock %s was broken while %s held it", self.path, self.holder)
                return
            try:
                if os.fstat(fd).st_ino != self._ino:   # another holder's lock now: never touch it
                    logger.error("lock %s was taken over while %s held it", self.path, self.holder)
                    return
                self._beat += 1
                os.pwrite(fd, self._content(), 0)
            finally:
                os.close(fd)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        content = _read(self.path)
        if content is not None and content.split(b" ")[:3] == self.holder.encode().split(b" "):
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> LeaseLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


"""Which replica a new connection goes to: the fewest outstanding connections, skipping failed ones."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    job_id: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def from_url(cls, job_id: str, url: str) -> Target:
        rest = url.split("://", 1)[-1].rstrip("/")
        host, _, port = rest.rpartition(":")
        return cls(job_id, host.strip("[]"), int(port))


class Balancer:
    """Least outstanding connections over the service's serving replicas (thread-safe).

    A replica that refused a connection is skipped for `down_for` seconds (or until the state lists
    it again after having dropped it); ties go to the one picked least recently.
    """

    def __init__(self, down_for: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.down_for, self._clock = down_for, clock
        self._lock = threading.Lock()
        self._targets: list[Target] = []
        self._outstanding: dict[Target, int] = {}
        self._down_until: dict[Target, float] = {}
        self._last_pick: dict[Target, int] = {}
        self._picks = 0

    def update(self, targets: list[Target]) -> None:
        with self._lock:
            self._targets = list(dict.fromkeys(targets))
            for gone in set(self._down_until) - set(self._targets):
                del self._down_until[gone]

    @property
    def targets(self) -> list[Target]:
        with self._lock:
            return list(self._targets)

    def acquire(self, exclude: set[Target] = frozenset()) -> Target | None:
        """The replica for a new connection (counted until `release`), or None when none is usable."""
        with self._lock:
            now = self._clock()
            usable = [t for t in self._targets if t not in exclude and self._down_until.get(t, 0.0) <= now]
            if not usable:
                return None
            best = min(usable, key=lambda t: (self._outstanding.get(t, 0), self._last_pick.get(t, -1)))
            self._outstanding[best] = self._outstanding.get(best, 0) + 1
            self._picks += 1
            self._last_pick[best] = self._picks
            return best

    def release(self, target: Target) -> None:
        with self._lock:
            left = self._outstanding.get(target, 0) - 1
            if left > 0:
                self._outstanding[target] = left
            else:
                self._outstanding.pop(target, None)

    def failed(self, target: Target) -> None:
        """The replica refused or dropped a connection: skip it for a while."""
        with self._lock:
            self._down_until[target] = self._clock() + self.down_for

    def outstanding(self, target: Target) -> int:
        with self._lock:
            return self._outstanding.get(target, 0)

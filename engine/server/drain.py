"""Draining on SIGTERM (Slurm's time limit, scancel, preemption, a handover): stop taking new work,
finish what is in flight within a grace period, then let the server exit 0.

What a client sees while the server drains:
- new TCP connections are refused (the listener is closed): balancers and clients retry elsewhere;
- a request on a connection that was already open is still served (it was on its way; a client behind
  a TCP tunnel could not retry it), with `Connection: close`, so its next request opens a new
  connection, to a live replica;
- `/health` answers 503 `{"error": "...", "error_type": "draining"}`, so probes and balancers skip it;
- requests still running when the grace period ends are cut off (their connection closes).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

DRAINING_STATUS = 503
LINGER_S = 1.0   # after the last request: time for requests already sent on open connections to arrive


class Drain:
    """Shared between the signal handler (any thread) and the HTTP event loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = max(0.0, float(timeout_s))
        self.requested = threading.Event()
        self.started_at = 0.0
        self.active = 0               # requests in flight (event-loop thread only)
        self.last_activity = 0.0

    def begin(self) -> None:
        if not self.requested.is_set():
            self.started_at = time.monotonic()
            self.requested.set()

    @property
    def draining(self) -> bool:
        return self.requested.is_set()

    def body(self) -> bytes:
        return json.dumps({"error": "the server is draining before it shuts down: send requests to another "
                                    "replica", "error_type": "draining"}).encode()

    def finished(self, now: float) -> bool:
        if now - self.started_at >= self.timeout_s:
            return True
        return self.active == 0 and now - max(self.last_activity, self.started_at) >= LINGER_S


class DrainMiddleware:
    """Counts requests in flight; while draining, /health says so and every response closes its connection."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] == "/health":
            await send({"type": "http.response.start", "status": DRAINING_STATUS,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": self.drain.body()})
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.drain.draining:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        self.drain.active += 1
        try:
            await self.app(scope, receive, send_closing)
        finally:
            self.drain.active -= 1
            self.drain.last_activity = time.monotonic()


async def drain_when_asked(server: Any, drain: Drain, poll_s: float = 0.1) -> None:
    """Run beside uvicorn: once `drain.begin()` was called, close the listener, wait for requests in
    flight (at most the grace period), then ask uvicorn to exit."""
    while not drain.draining:
        if server.should_exit:
            return
        await asyncio.sleep(poll_s)
    logger.info("draining: no new connections; %d request(s) in flight get up to %.0f s", drain.active,
                drain.timeout_s)
    for listener in getattr(server, "servers", []):
        listener.close()
    while not drain.finished(time.monotonic()):
        await asyncio.sleep(poll_s)
    if drain.active:
        logger.warning("drain grace period over: cutting off %d request(s) still in flight", drain.active)
    else:
        logger.info("drained: every request in flight finished")
    server.should_exit = True

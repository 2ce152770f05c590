"""Draining on SIGTERM: in-flight requests finish, new connections are refused, /health says draining, exit 0."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from engine.server.drain import LINGER_S, Drain, DrainMiddleware, drain_when_asked


def _app(drain: Drain) -> DrainMiddleware:
    async def health(request):
        return Response(status_code=200)

    async def generate(request):
        return JSONResponse({"generated_text": "x"})

    return DrainMiddleware(Starlette(routes=[Route("/health", health), Route("/generate", generate, methods=["POST"])]),
                           drain)


def test_before_draining_nothing_changes():
    client = TestClient(_app(Drain(5)))
    assert client.get("/health").status_code == 200
    r = client.post("/generate")
    assert r.status_code == 200 and r.headers.get("connection") != "close"


def test_draining_health_is_503_and_responses_close_their_connection():
    drain = Drain(5)
    client = TestClient(_app(drain))
    drain.begin()
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["error_type"] == "draining"
    assert "another replica" in health.json()["error"]
    r = client.post("/generate")  # already on its way: served, and the client must reconnect elsewhere
    assert r.status_code == 200 and r.headers["connection"] == "close"
    assert drain.active == 0


class _FakeServer:
    def __init__(self):
        self.should_exit = False
        self.servers = [type("L", (), {"closed": False, "close": lambda self: setattr(self, "closed", True)})()]


def test_drain_waits_for_requests_in_flight_then_exits():
    drain, server = Drain(30), _FakeServer()

    async def scenario():
        task = asyncio.create_task(drain_when_asked(server, drain, poll_s=0.01))
        drain.active = 1
        drain.begin()
        await asyncio.sleep(0.1)
        assert server.servers[0].closed and not server.should_exit   # listener closed, request still running
        drain.active, drain.last_activity = 0, time.monotonic()
        await asyncio.wait_for(task, LINGER_S + 2)
        assert server.should_exit

    asyncio.run(scenario())


def test_grace_period_cuts_off_what_is_still_running():
    drain, server = Drain(0.2), _FakeServer()
    drain.active = 3
    drain.begin()
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(drain_when_asked(server, drain, poll_s=0.01), 5))
    assert server.should_exit and time.monotonic() - t0 < 2


def test_hostile_grace_values():
    assert Drain(-5).timeout_s == 0.0   # a negative grace is no grace, not a hang
    drain = Drain(0)
    drain.begin()
    assert drain.finished(time.monotonic())


def test_real_engine_drains_on_sigterm(model_path, tmp_path):
    from test_clients import start_server

    proc, url, log = start_server(model_path("tiny-llama"), tmp_path, "--drain-timeout", "20", "--cpu-threads", "1")
    try:
        body = {"inputs": "Count: 1, 2, 3,", "parameters": {"max_new_tokens": 60}}
        result = {}

        def long_request():
            result["r"] = httpx.post(f"{url}/generate", json=body, timeout=60)

        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(0.5)  # the request is in flight
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:  # the listener closes: a new connection is refused
            try:
                httpx.get(f"{url}/health", timeout=2)
            except httpx.ConnectError:
                break
            assert time.monotonic() < deadline, "still accepting connections while draining"
            time.sleep(0.05)
        worker.join(60)
        assert result["r"].status_code == 200 and result["r"].json()["generated_text"]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "drained: every request in flight finished" in log.read_text()

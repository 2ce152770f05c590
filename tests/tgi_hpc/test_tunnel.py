"""tgi_hpc.remote.tunnel against a real throwaway sshd and a real http.server, all on 127.0.0.1."""
from __future__ import annotations

import http.server
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.sshd import free_port, start_sshd
from tgi_hpc.errors import ReadinessTimeout, TunnelError
from tgi_hpc.remote.ssh import HostKeyError, connect
from tgi_hpc.remote.tunnel import Tunnel, wait_http_ready

pytestmark = pytest.mark.timeout(60)
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture
def home(tmp_path, monkeypatch, sshd) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text(
        f"Host login\n  HostName 127.0.0.1\n  Port {sshd.port}\n  IdentityFile {sshd.client_key}\n\n"
        f"Host node\n  HostName 127.0.0.1\n  Port {sshd.port}\n  IdentityFile {sshd.client_key}\n"
        "  ProxyJump login\n")
    (tmp_path / ".ssh" / "known_hosts").write_text(sshd.known_hosts_line())
    return tmp_path


class Web:
    """A threaded http.server on 127.0.0.1 that answers "<name> <path>"; /status/N answers N."""

    def __init__(self, name: str):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                code = int(self.path.rsplit("/", 1)[1]) if self.path.startswith("/status/") else 200
                body = f"{name} {self.path}".encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        if self.httpd.socket.fileno() != -1:  # idempotent: a test may stop it first
            self.httpd.shutdown()
            self.httpd.server_close()


@pytest.fixture
def web():
    server = Web("A")
    yield server
    server.stop()


def get(url: str) -> str:
    with NO_PROXY.open(url, timeout=10) as resp:
        return resp.read().decode()


def test_tunnel_forwards_http_through_a_jump_host(home, sshd, web):
    before = set(sshd.connection_pids())
    with Tunnel(lambda: connect("node"), "127.0.0.1", web.port) as tunnel:
        assert tunnel.url == f"http://127.0.0.1:{tunnel.local_port}"
        assert get(tunnel.url + "/hello") == "A /hello"
        wait_http_ready(tunnel.url, timeout=5)
        with ThreadPoolExecutor(8) as pool:  # concurrent connections share the one SSH connection
            assert list(pool.map(get, [f"{tunnel.url}/{i}" for i in range(16)])) == [f"A /{i}" for i in range(16)]
        assert len(set(sshd.connection_pids()) - before) == 2  # login + node, nothing more
    deadline = time.monotonic() + 5  # close() also closed the jump host's connection
    while set(sshd.connection_pids()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(sshd.connection_pids()) - before


def test_tunnel_listens_on_loopback_only(home, web):
    with Tunnel(lambda: connect("login"), "127.0.0.1", web.port) as tunnel:
        listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        mine = [f[1] for f in listening if f[3] == "0A" and int(f[1].split(":")[1], 16) == tunnel.local_port]
        assert mine == [f"0100007F:{tunnel.local_port:04X}"]  # 127.0.0.1, not 0.0.0.0
        assert not any(int(f[1].split(":")[1], 16) == tunnel.local_port
                       for f in (line.split() for line in Path("/proc/net/tcp6").read_text().splitlines()[1:]))
    for bind in ("0.0.0.0", "::", "192.168.1.10"):
        with pytest.raises(TunnelError, match="only binds a loopback address"):
            Tunnel(lambda: connect("login"), "127.0.0.1", web.port, bind=bind)


def test_tunnel_passes_on_a_half_close(home, web):
    with Tunnel(lambda: connect("login"), "127.0.0.1", web.port) as tunnel:
        with socket.create_connection(("127.0.0.1", tunnel.local_port), timeout=10) as s:
            s.sendall(b"GET /half HTTP/1.0\r\n\r\n")
            s.shutdown(socket.SHUT_WR)  # request done; the answer must still arrive
            answer = b"".join(iter(lambda: s.recv(4096), b""))
        assert answer.startswith(b"HTTP/1.0 200") and answer.endswith(b"A /half")


def test_tunnel_reconnects_when_the_ssh_connection_drops(home, sshd, web):
    calls = []

    def reconnecting():
        calls.append(time.monotonic())
        return connect("login")

    with Tunnel(reconnecting, "127.0.0.1", web.port) as tunnel:
        assert get(tunnel.url + "/before") == "A /before"
        assert sshd.drop_connections() >= 1  # like a network cut: the sshd side dies
        assert get(tunnel.url + "/after") == "A /after"
        assert (len(calls), tunnel.reconnects) == (2, 1)
        assert get(tunnel.url + "/again") == "A /again"
        assert len(calls) == 2  # the new connection is kept


def test_tunnel_follows_the_remote_target_when_it_moves(home, web):
    where = {"port": web.port}
    asked = []

    def locate():
        asked.append(where["port"])
        return "127.0.0.1", where["port"]

    with Tunnel(lambda: connect("login"), "unused", locate) as tunnel:
        assert get(tunnel.url + "/x") == "A /x"
        assert get(tunnel.url + "/y") == "A /y"
        assert asked == [web.port]  # asked once while it works
        web.stop()  # the job is requeued: it comes back elsewhere
        moved = Web("B")
        try:
            where["port"] = moved.port
            assert get(tunnel.url + "/z") == "B /z"
            assert asked == [web.port, moved.port]
        finally:
            moved.stop()


def test_tunnel_gives_up_on_a_remote_that_never_answers(home, caplog):
    with Tunnel(lambda: connect("login"), "127.0.0.1", free_port(), reconnect_timeout=1.0) as tunnel:
        start = time.monotonic()
        with pytest.raises(OSError):  # the client sees its connection closed
            get(tunnel.url + "/")
        assert time.monotonic() - start < 5
    assert "refused the connection" in caplog.text and "gave up after 1 s" in caplog.text


def test_tunnel_start_fails_fast_on_an_unknown_host_key(home, web):
    (home / ".ssh" / "known_hosts").unlink()
    tunnel = Tunnel(lambda: connect("login"), "127.0.0.1", web.port)
    with pytest.raises(HostKeyError):
        tunnel.start()
    tunnel.close()


def test_wait_http_ready_times_out_with_the_last_answer(web):
    url = f"http://127.0.0.1:{web.port}"
    wait_http_ready(url, timeout=2, path="/status/200")
    with pytest.raises(ReadinessTimeout, match="HTTP 503"):
        wait_http_ready(url, timeout=0.5, path="/status/503")
    with pytest.raises(ReadinessTimeout, match="did not answer 200 within 1 s"):
        wait_http_ready(f"http://127.0.0.1:{free_port()}", timeout=0.6)


def test_tunnel_can_share_the_runners_connection(home, sshd, web):
    from tgi_hpc.remote.ssh_runner import SSHRunner

    with SSHRunner("login") as runner:
        assert runner.run(["echo", "x"]).stdout == "x\n"
        connections = set(sshd.connection_pids())
        where = lambda: ("127.0.0.1", int(runner.run(["echo", str(web.port)]).stdout))  # noqa: E731
        with Tunnel(runner.transport, "unused", where, close_connection=False) as tunnel:
            assert get(tunnel.url + "/shared") == "A /shared"
            assert set(sshd.connection_pids()) <= connections  # no second connection (no second 2FA)
        assert runner.run(["echo", "after"]).stdout == "after\n"
        assert set(sshd.connection_pids()) <= connections  # the runner's connection survived
        sshd.drop_connections()
        time.sleep(0.3)
        with Tunnel(runner.transport, "127.0.0.1", web.port, close_connection=False) as tunnel:
            assert get(tunnel.url + "/re") == "A /re"  # the runner reconnected for the tunnel

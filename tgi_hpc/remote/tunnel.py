"""Tunnel: 127.0.0.1:local_port -> SSH direct-tcpip -> node:port, reconnecting when SSH drops."""
from __future__ import annotations

import http.client
import ipaddress
import logging
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import paramiko

from tgi_hpc.errors import ReadinessTimeout, TunnelError
from tgi_hpc.remote.ssh import HostKeyError, SSHAuthError

logger = logging.getLogger(__name__)

# connect() may return the SSHClient from tgi_hpc.remote.ssh.connect: closing it also closes its jump hosts
Connect = Callable[[], "paramiko.Transport | paramiko.SSHClient"]
Target = Callable[[], "tuple[str, int]"]


class Tunnel:
    """Forward a loopback port to `remote_host:remote_port` as seen from the SSH server.

    `remote_port` may be a callable returning (host, port): it is asked again after a
    reconnect and whenever the remote end refuses, so the tunnel follows a requeued job.
    close() also closes the connection, unless `close_connection=False` (e.g. when connect is
    SSHRunner.transport, whose connection the runner keeps using).
    """

    def __init__(self, connect: Connect, remote_host: str, remote_port: int | Target, local_port: int = 0,
                 bind: str = "127.0.0.1", *, reconnect_timeout: float = 60.0, max_backoff: float = 8.0,
                 close_connection: bool = True):
        if not _is_loopback(bind):
            raise TunnelError(f"Refusing to listen on {bind!r}: the tunnel is reachable without any "
                              "authentication, so it only binds a loopback address such as 127.0.0.1.")
        self._connect = connect
        self._resolve: Target = remote_port if callable(remote_port) else (lambda: (remote_host, remote_port))
        self.local_port, self.bind = local_port, bind
        self.reconnect_timeout, self.max_backoff = reconnect_timeout, max_backoff
        self.close_connection = close_connection
        self.reconnects = 0  # how many times the SSH connection was re-established
        self._target: tuple[str, int] | None = None
        self._handle: paramiko.Transport | paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._pipes: set[tuple[socket.socket, paramiko.Channel]] = set()
        self._server: socket.socket | None = None

    @property
    def url(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{self.local_port}"

    def start(self) -> Tunnel:
        """Connect (errors surface here, not at the first request) and start listening."""
        try:
            family = socket.AF_INET6 if ":" in self.bind else socket.AF_INET
            self._server = socket.create_server((self.bind, self.local_port), family=family, backlog=64)
        except OSError as e:
            raise TunnelError(f"Cannot listen on {self.bind}:{self.local_port}: {e}. "
                              "Choose another --local-port (or 0 for any free port).") from e
        self.local_port = self._server.getsockname()[1]
        self._server.settimeout(0.2)  # lets the accept loop notice close()
        try:
            self._handle = self._connect()
        except BaseException:
            self._server.close()
            raise
        threading.Thread(target=self._serve, name=f"tunnel:{self.local_port}", daemon=True).start()
        logger.info("forwarding %s through SSH", self.url)
        return self

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
        for sock, chan in list(self._pipes):
            chan.close()
            sock.close()
        with self._lock:
            if self.close_connection:
                self._close_handle()
            self._handle = None

    def __enter__(self) -> Tunnel:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._forward, args=(sock, peer), daemon=True).start()

    def _forward(self, sock: socket.socket, peer: tuple) -> None:
        try:
            chan, done = self._open(peer[:2])
        except Exception as e:
            logger.error("%s", e)
            sock.close()
            return
        self._pipes.add((sock, chan))
        try:
            _pump(sock, chan, self._closed)
        finally:
            self._pipes.discard((sock, chan))
            done()

    def _open(self, peer: tuple[str, int]) -> tuple[paramiko.Channel, Callable[[], None]]:
        """The channel for one local connection, and what to run once it has ended."""
        return self._open_channel(peer), lambda: None

    def _open_channel(self, peer: tuple[str, int]) -> paramiko.Channel:
        deadline, delay = time.monotonic() + self.reconnect_timeout, 0.25
        while True:
            transport = self._live_transport(deadline)
            try:
                host, port = self._current_target()
                return transport.open_channel("direct-tcpip", (host, port), peer, timeout=10)
            except paramiko.ChannelException as e:  # the remote end refused: moved, restarting, or gone
                failure, self._target = f"{host}:{port} refused the connection ({e})", None
            except (paramiko.SSHException, EOFError, OSError) as e:  # the SSH connection died under us
                failure = f"the SSH connection failed ({e})"
                with self._lock:
                    if self._transport() is transport:
                        self._close_handle()
            except Exception as e:  # the target callable failed (e.g. squeue hiccup)
                failure, self._target = f"finding the server failed ({e})", None
            if time.monotonic() + delay > deadline:
                raise TunnelError(f"Tunnel {self.url}: {failure}; gave up after {self.reconnect_timeout:.0f} s. "
                                  "Check that the job is still running (`tgi-hpc status`).")
            logger.warning("tunnel %s: %s; retrying in %.1f s", self.url, failure, delay)
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff)

    def _current_target(self) -> tuple[str, int]:
        if self._target is None:
            self._target = self._resolve()
            logger.info("tunnel %s -> %s:%d", self.url, *self._target)
        return self._target

    def _live_transport(self, deadline: float) -> paramiko.Transport:
        """The current transport, or a new one: connect() again with exponential backoff."""
        with self._lock:
            transport, delay = self._transport(), 0.5
            while transport is None or not transport.is_active():
                self._close_handle()
                if self._closed.is_set():
                    raise TunnelError(f"Tunnel {self.url} is closed.")
                try:
                    self._handle = self._connect()
                    transport, self._target = self._transport(), None
                    self.reconnects += 1
                    logger.warning("tunnel %s: SSH connection re-established", self.url)
                except (HostKeyError, SSHAuthError, KeyboardInterrupt):
                    raise  # waiting will not fix these
                except Exception as e:
                    if self._closed.is_set() or time.monotonic() + delay > deadline:
                        raise TunnelError(f"Tunnel {self.url}: cannot reconnect over SSH: {e}") from e
                    logger.warning("tunnel %s: reconnect failed (%s); retrying in %.1f s", self.url, e, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, self.max_backoff)
            return transport

    def _transport(self) -> paramiko.Transport | None:
        if isinstance(self._handle, paramiko.SSHClient):
            return self._handle.get_transport()
        return self._handle

    def _close_handle(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _pump(sock: socket.socket, chan: paramiko.Channel, closed: threading.Event) -> None:
    """Copy bytes both ways until both sides are done; a half-close is passed on."""
    readers = {sock: chan, chan: sock}
    try:
        while readers and not closed.is_set():
            ready, _, _ = select.select(list(readers), [], [], 0.5)
            for src in ready:
                data = src.recv(65536)
                if data:
                    readers[src].sendall(data)
                    continue
                dst = readers.pop(src)
                if dst is chan:
                    chan.shutdown_write()
                else:
                    sock.shutdown(socket.SHUT_WR)
    except (OSError, EOFError, paramiko.SSHException):
        pass  # either side vanished: nothing left to deliver
    finally:
        chan.close()
        sock.close()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def wait_http_ready(url: str, timeout: float, path: str = "/health") -> None:
    """Poll GET url+path until it answers 200, else ReadinessTimeout after `timeout` s."""
    target, last = url.rstrip("/") + path, "no answer"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via $http_proxy
    deadline, delay = time.monotonic() + timeout, 0.2
    while True:
        try:
            with opener.open(target, timeout=max(0.5, min(10.0, deadline - time.monotonic()))) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            last = str(getattr(e, "reason", e))
        if time.monotonic() + delay > deadline:
            raise ReadinessTimeout(f"{target} did not answer 200 within {timeout:.0f} s (last: {last}). "
                                   "The server may still be loading the model: check the job log, or wait longer.")
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)

"""BalancedTunnel (a service's laptop tunnel) against a real throwaway sshd and real http.servers on 127.0.0.1."""
from __future__ import annotations

import socket
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_tunnel import Web, get, home  # noqa: F401  (fixtures: a HOME whose ssh config reaches the sshd)
from tgi_hpc.remote.balanced_tunnel import BalancedTunnel
from tgi_hpc.remote.ssh import connect
from tgi_hpc.service.balance import Balancer, Target

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def webs():
    servers = [Web("A"), Web("B")]
    yield servers
    for server in servers:
        server.stop()


def _target(name: str, port: int) -> Target:
    return Target(name, "127.0.0.1", port)


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def test_connections_spread_over_the_replicas(home, webs):  # noqa: F811
    balancer = Balancer()
    balancer.update([_target("1", webs[0].port), _target("2", webs[1].port)])
    with BalancedTunnel(lambda: connect("login"), balancer) as tunnel:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(get, [f"{tunnel.url}/{i}" for i in range(12)]))
    assert {a.split()[0] for a in answers} == {"A", "B"}
    assert [a.split()[1] for a in answers] == [f"/{i}" for i in range(12)]


def test_a_refusing_replica_is_skipped_without_losing_the_connection(home, webs):  # noqa: F811
    balancer = Balancer()
    balancer.update([_target("gone", _closed_port()), _target("1", webs[0].port)])
    with BalancedTunnel(lambda: connect("login"), balancer) as tunnel:
        assert [get(f"{tunnel.url}/{i}") for i in range(5)] == [f"A /{i}" for i in range(5)]


def test_a_replica_that_disappears_is_replaced_by_its_successor(home, webs):  # noqa: F811
    a, b = webs
    balancer = Balancer()
    balancer.update([_target("1", a.port)])
    with BalancedTunnel(lambda: connect("login"), balancer) as tunnel:
        assert get(tunnel.url + "/before") == "A /before"
        a.stop()                                              # scancelled, not yet out of the state
        balancer.update([_target("1", a.port), _target("2", b.port)])
        assert [get(f"{tunnel.url}/after{i}") for i in range(4)] == [f"B /after{i}" for i in range(4)]


def test_no_replica_left_closes_the_connection_after_the_wait(home):  # noqa: F811
    balancer = Balancer()
    with BalancedTunnel(lambda: connect("login"), balancer, reconnect_timeout=1) as tunnel:
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            get(tunnel.url + "/x")

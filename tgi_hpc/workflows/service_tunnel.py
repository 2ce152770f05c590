"""`tgi-hpc tunnel SERVICE`: one local port for all of a service's replicas, following its handovers.

Runs on the laptop (or wherever the tunnel command runs): it re-reads the service's state file every
REFRESH_S over the SSH connection it already has, and balances each new connection over the replicas the
state lists as READY (tgi_hpc/remote/balanced_tunnel.py). Nothing is started on the cluster.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from tgi_hpc.errors import ReadinessTimeout, UsageError
from tgi_hpc.remote.runner import LocalRunner
from tgi_hpc.service.balance import Balancer
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.ports import is_port_free
from tgi_hpc.workflows.service import read_service, service_api_key, serving_targets
from tgi_hpc.workflows.tunnel_session import TunnelInfo, _connector, _local_key

logger = logging.getLogger(__name__)

REFRESH_S = 2.0


def _wait_serving(cluster: Cluster, name: str, timeout: float, progress) -> list:
    deadline, said = time.monotonic() + timeout, ""
    while True:
        state = read_service(cluster, name)
        targets = serving_targets(state)
        if targets:
            return targets
        summary = " ".join(f"{j.job_id}={j.state}" for j in state.live()) or "no live job"
        if summary != said:
            progress(f"service {name}: waiting for a READY replica ({summary})")
            said = summary
        if not state.live():
            raise UsageError(f"service {name!r} has no job left: start it again with `tgi-hpc serve --service {name}`")
        if time.monotonic() > deadline:
            raise ReadinessTimeout(f"service {name!r}: no replica READY after {timeout:.0f} s ({summary})")
        time.sleep(REFRESH_S)


def _follow(cluster: Cluster, name: str, balancer: Balancer, closed: threading.Event) -> None:
    while not closed.wait(REFRESH_S):
        try:
            targets = serving_targets(read_service(cluster, name))
        except Exception as exc:   # a hiccup reading the state: keep the last list
            logger.warning("service %s: could not re-read its state (%s)", name, exc)
            continue
        if set(targets) != set(balancer.targets):
            logger.info("service %s: replicas now %s", name, " ".join(f"{t.job_id}@{t.host}:{t.port}" for t in targets)
                        or "none")
        balancer.update(targets)


def open_service_tunnel(cluster: Cluster, name: str, *, local_port: int | None = None, accept_host_key: bool = False,
                        timeout: float = 600, progress=lambda message: None):
    """Wait for a READY replica, then forward a local port to the service's replicas, balanced."""
    from tgi_hpc.remote.balanced_tunnel import BalancedTunnel
    from tgi_hpc.remote.tunnel import wait_http_ready

    targets = _wait_serving(cluster, name, timeout, progress)
    balancer = Balancer()
    balancer.update(targets)
    port = local_port if local_port is not None else (targets[0].port if is_port_free(targets[0].port, "127.0.0.1") else 0)
    shared = not isinstance(cluster.runner, LocalRunner)
    tunnel = BalancedTunnel(_connector(cluster, accept_host_key), balancer, local_port=port,
                            close_connection=not shared).start()
    threading.Thread(target=_follow, args=(cluster, name, balancer, tunnel._closed), name=f"service:{name}",
                     daemon=True).start()
    try:
        wait_http_ready(tunnel.url, timeout=60)
    except BaseException:
        tunnel.close()
        raise
    state = read_service(cluster, name)
    key = service_api_key(cluster, state)
    info = TunnelInfo(name, cluster.profile.cluster or cluster.profile.name, tunnel.url, tunnel.local_port,
                      " ".join(f"{t.host}:{t.port}" for t in targets), _local_key(cluster, f"service-{name}", key),
                      os.getpid(), state.model)
    return tunnel, info

"""A tunnel to a service: each new local connection goes to one of its replicas (least outstanding
connections), and a replica that refuses is skipped for the next one, so a connection never fails while
another replica is up. The replica list comes from outside (the service's state, re-read every few s)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import paramiko

from tgi_hpc.errors import TunnelError
from tgi_hpc.remote.tunnel import Connect, Tunnel
from tgi_hpc.service.balance import Balancer, Target

logger = logging.getLogger(__name__)


class BalancedTunnel(Tunnel):
    def __init__(self, connect: Connect, balancer: Balancer, local_port: int = 0, bind: str = "127.0.0.1", *,
                 reconnect_timeout: float = 60.0, close_connection: bool = True):
        super().__init__(connect, "", self._no_single_target, local_port, bind, reconnect_timeout=reconnect_timeout,
                         close_connection=close_connection)
        self.balancer = balancer

    @staticmethod
    def _no_single_target() -> tuple[str, int]:
        raise TunnelError("a balanced tunnel picks a replica per connection")

    def _open(self, peer: tuple[str, int]) -> tuple[paramiko.Channel, Callable[[], None]]:
        chan, target = self._open_to_replica(peer)
        return chan, lambda: self.balancer.release(target)

    def _open_to_replica(self, peer: tuple[str, int]) -> tuple[paramiko.Channel, Target]:
        """A channel to a live replica: on a refusal, the next replica at once; when every one refused
        (or none is listed), wait for the list to change, up to `reconnect_timeout`."""
        deadline, delay, tried = time.monotonic() + self.reconnect_timeout, 0.25, set()
        while True:
            transport = self._live_transport(deadline)
            target = self.balancer.acquire(exclude=tried)
            if target is not None:
                try:
                    return transport.open_channel("direct-tcpip", (target.host, target.port), peer, timeout=10), target
                except paramiko.ChannelException as e:   # refused: draining, ended, or not there yet
                    self.balancer.release(target)
                    self.balancer.failed(target)
                    tried.add(target)
                    logger.info("tunnel %s: replica %s (job %s) refused (%s); trying another", self.url,
                                f"{target.host}:{target.port}", target.job_id, e)
                    continue
                except (paramiko.SSHException, EOFError, OSError) as e:   # the SSH connection died
                    self.balancer.release(target)
                    failure = f"the SSH connection failed ({e})"
                    with self._lock:
                        if self._transport() is transport:
                            self._close_handle()
            else:
                failure, tried = "no replica of the service is ready", set()
            if time.monotonic() + delay > deadline:
                raise TunnelError(f"Tunnel {self.url}: {failure}; gave up after {self.reconnect_timeout:.0f} s. "
                                  "Check the service's jobs (`tgi-hpc status`).")
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff)

"""The service lock across nodes: separate processes that share no kernel lock table (their flock and
lockf made no-ops, as `localflock` is between two nodes), a holder killed -9, a live holder past its lease."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tgi_hpc.service.lease_lock import LeaseLock

ROOT = Path(__file__).resolve().parents[2]

# A process on "another node": its own host name, and no kernel lock works (flock, lockf and fcntl
# locks are no-ops), so only the lock file itself can exclude.
NODE = """
import fcntl, socket, sys, time
socket.gethostname = lambda: sys.argv[1]
fcntl.flock = fcntl.lockf = lambda *a, **k: None
from tgi_hpc.service.lease_lock import LeaseLock
lock_path, counter, n, lease = sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
"""

INCREMENT = NODE + """
for _ in range(n):
    with LeaseLock(lock_path, lease_s=lease):
        value = int(open(counter).read())
        time.sleep(0.002)   # a window in which an unexcluded writer loses an update
        open(counter, "w").write(str(value + 1))
"""

HOLD = NODE + """
lock = LeaseLock(lock_path, lease_s=lease)
lock.acquire()
open(counter, "w").write("held")
time.sleep(float(sys.argv[6]) if len(sys.argv) > 6 else 3600)
lock.release()
open(counter, "w").write("released")
"""


def _node(script: str, host: str, lock: Path, counter: Path, n: int = 0, lease: float = 30.0, *more: str):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", script, host, str(lock), str(counter), str(n), str(lease), *more],
                            env=env, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, text: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text() == text:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} never said {text!r}")


def test_two_nodes_never_hold_it_at_once(tmp_path):
    counter, lock = tmp_path / "counter", tmp_path / "svc.lock"
    counter.write_text("0")
    n = 40
    procs = [_node(INCREMENT, host, lock, counter, n) for host in ("node-a", "node-b")]
    for proc in procs:
        assert proc.wait(60) == 0, proc.stderr.read()
    assert int(counter.read_text()) == 2 * n
    assert sorted(os.listdir(tmp_path)) == ["counter"]   # no lock or private file left behind


def test_a_holder_killed_9_is_taken_over_after_its_lease(tmp_path):
    marker, lock_path = tmp_path / "marker", tmp_path / "svc.lock"
    holder = _node(HOLD, "node-a", lock_path, marker, 0, 1.0)
    _wait_for(marker, "held")
    assert b"node-a" in lock_path.read_bytes()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    start = time.monotonic()
    with LeaseLock(lock_path, lease_s=1.0, timeout=15):
        waited = time.monotonic() - start
        assert lock_path.read_bytes().split()[1] == str(os.getpid()).encode()
    assert 1.0 <= waited < 6.0   # not before the lease ran out, and soon after
    assert not lock_path.exists()


def test_a_live_holder_keeps_its_lock_past_its_lease(tmp_path):
    marker, lock_path = tmp_path / "marker", tmp_path / "svc.lock"
    holder = _node(HOLD, "node-a", lock_path, marker, 0, 0.4, "2.5")   # holds for 6 leases, renewing
    try:
        _wait_for(marker, "held")
        with pytest.raises(TimeoutError, match="node-a"):
            LeaseLock(lock_path, lease_s=0.4, timeout=1.5).acquire()
        with LeaseLock(lock_path, lease_s=0.4, timeout=15):   # then it is released, and ours
            assert marker.read_text() == "released"
    finally:
        holder.kill()
        holder.wait(10)


def test_a_lock_taken_over_meanwhile_is_not_broken(tmp_path):
    lock_path = tmp_path / "svc.lock"
    with LeaseLock(lock_path, lease_s=30) as live:
        other = LeaseLock(lock_path, lease_s=30)
        from tgi_hpc.service.lease_lock import _Staleness

        other._break(b"a dead holder's bytes\n", _Staleness(30))   # it saw those go stale, then this one came
        assert lock_path.exists() and live.holder.encode() in lock_path.read_bytes()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_breaker_that_died_mid_break_does_not_block_forever(tmp_path):
    lock_path = tmp_path / "svc.lock"
    lock_path.write_text("node-x 1 dead 000000000000\n")
    (tmp_path / "svc.lock.break").write_text("node-y 2 dead 000000000000\n")
    start = time.monotonic()
    with LeaseLock(lock_path, lease_s=0.3, timeout=10):
        pass
    assert time.monotonic() - start < 5
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("lease", [0, -1])
def test_a_lease_must_be_positive(tmp_path, lease):
    with pytest.raises(ValueError, match="lease_s"):
        LeaseLock(tmp_path / "l", lease_s=lease)


def test_hostile_lock_names_stay_in_their_directory(tmp_path, hostile):
    for value, marker in hostile:
        folder = tmp_path / str(abs(hash(value)))
        folder.mkdir()
        lock_path = folder / (value.replace("/", "_") + ".lock")
        with LeaseLock(lock_path, lease_s=5):
            assert lock_path.exists()
        assert os.listdir(folder) == [] and not marker.exists()

"""Services on the real local Slurm cluster, with the real engine (tiny model): a 2-minute job hands over
to the successor it submitted, and a replica is scancelled, both under a client loop through the laptop's
balanced tunnel and through `tgi-hpc endpoint` + ServiceClient. No request may be lost, none may be a 5xx.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from support.releases import venv_release
from test_laptop import _read_until, laptop  # noqa: F401  (the laptop fixture: its own HOME, ssh, TGI_HPC_REMOTE)

from tgi_hpc.service.client import ReplicaLost, ServiceClient

pytestmark = pytest.mark.slow
BODY = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}


@pytest.fixture
def service_cli(local_cluster, laptop):  # noqa: F811
    """tgi-hpc on the login node (jobs inherit this checkout's PYTHONPATH), in the laptop's jobs dir."""
    jobs_dir = laptop[3]

    def run(*args: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "tgi_hpc", *args[0].split(), "--cluster", str(local_cluster.profile),
                "--set", f"paths.jobs={jobs_dir}", *args[1:]]
        result = subprocess.run(argv, env=local_cluster.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
        return result

    run.state = lambda name: json.loads((jobs_dir / "services" / f"{name}.json").read_text())
    # a command of a group (`adapter load`): the options after both words
    run.sub = lambda *args: run(f"{args[0]} {args[1]}", *args[2:])
    return run


class Loop(threading.Thread):
    """Sends BODY again and again until stopped; keeps (time, status code or error) for every request."""

    def __init__(self, send):
        super().__init__(daemon=True)
        self.send, self.stop, self.results = send, threading.Event(), []

    def run(self):
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                self.results.append((t, self.send()))
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, and judged by the test
                self.results.append((t, exc))
            time.sleep(0.05)

    def finish(self):
        self.stop.set()
        self.join(120)
        return self.results


def _tunnel_loop(url: str, key: str) -> Loop:
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)  # keep-alive
    return Loop(lambda: client.post("/generate", json=BODY).status_code)


def _client_loop(endpoint: dict) -> Loop:
    client = ServiceClient(endpoint["state_file"], api_key=endpoint["api_key"], timeout=60, retry_for=90)
    return Loop(lambda: client.request("POST", "/generate", json=BODY).status_code)


def _open_tunnel(popen, name: str):
    proc = popen("tunnel", name, "--local-port", "0", "--timeout", "200")
    out = _read_until(proc, r"api key: \S+", timeout=200)
    url = next(w for w in out.split() if w.startswith("http://127.0.0.1:"))
    key_file = out.split("api key: ")[1].split()[0]
    return proc, url, Path(key_file).read_text().strip()


def _cleanup(service_cli, local_cluster, name: str) -> list[str]:
    """Stop the service; return its jobs Slurm still runs (there must be none)."""
    service_cli("stop", name, check=False)
    ids = [j["job_id"] for j in service_cli.state(name)["jobs"]]
    deadline = time.monotonic() + 30
    while True:
        left = [j for j in ids if local_cluster.state(j) in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    local_cluster.cancel(*left) if left else None
    return left


def _serve(service_cli, model_path, name: str, *extra: str) -> dict:
    out = service_cli("serve", "--model", str(model_path("tiny-llama")), "--release", str(venv_release()),
                      "--service", name, "--engine-arg=--cpu-threads=1", "--max-total-tokens", "512",
                      "--wait", "--timeout", "200", "--json", *extra)
    return json.loads(out.stdout)


def test_handover_before_the_time_limit_loses_no_request(service_cli, local_cluster, laptop, model_path,  # noqa: F811
                                                         tmp_path):
    """The first job hands over to its successor with no request lost; an adapter loaded into the service
    (`tgi-hpc adapter load`) is on the successor when it is READY (the service's record)."""
    from support.adapters import make_adapter

    _, popen, _, _ = laptop
    name = "handover"
    # made while the first job loads (not after: `adapter load` must come before the successor is READY)
    making = ThreadPoolExecutor(1).submit(make_adapter, model_path("tiny-llama"), tmp_path / "checkpoint", seed=7)
    # a lead of 90 s (the profile's floor is 60 s): the successor may start 30 s into the 2-minute job, not 60 s
    # (the client loops start ~15 s in; the first drains only once the successor has loaded), and its own
    # successor 30 s after it, still after this test is done with it (~5 s after the successor is READY)
    started = _serve(service_cli, model_path, name, "--keep-alive", "--time", "2:00",
                     "--engine-arg=--enable-runtime-lora", "--set", "slurm.handover_floor_s=90")
    first = started["job_ids"][0]
    tunnel = loops = None
    try:
        checkpoint = making.result(timeout=300)
        loaded = json.loads(service_cli.sub("adapter", "load", "--json", name, f"ckpt={checkpoint}").stdout)
        assert loaded["service"] and list(loaded["servers"]) == [first]
        tunnel, url, key = _open_tunnel(popen, name)
        endpoint = json.loads(service_cli("endpoint", name, "--json").stdout)
        assert endpoint["urls"] and endpoint["api_key"] == key
        loops = [_tunnel_loop(url, key), _client_loop(endpoint)]
        for loop in loops:
            loop.start()
        states = {j["job_id"]: j["state"] for j in service_cli.state(name)["jobs"]}
        assert states[first] == "ready", f"the first job began to drain before the client loops started: {states}"
        # the first job submits its successor, which becomes READY before the 2-minute limit (lead: the 90 s
        # floor); the first drains
        deadline = time.monotonic() + 240
        while True:
            jobs = {j["job_id"]: j for j in service_cli.state(name)["jobs"]}
            succ = jobs[first]["successor"]
            if succ and jobs.get(succ, {}).get("state") == "ready" and local_cluster.state(first) == "COMPLETED":
                break
            assert time.monotonic() < deadline, f"no handover within 4 minutes: {jobs}"
            assert tunnel.poll() is None, tunnel.stderr.read()
            time.sleep(0.5)
        handed_over = time.monotonic()
        # the adapter is on the successor (read while the loops go on, before its own successor can be READY)
        listing = json.loads(service_cli.sub("adapter", "list", "--json", name).stdout)
        assert listing["servers"] == {succ: {"model": str(model_path("tiny-llama")), "adapters": ["ckpt"]}}
        assert listing["recorded"] == {"ckpt": str(checkpoint)}
        time.sleep(max(0.0, handed_over + 4 - time.monotonic()))   # 4 s of requests (dozens), all on the successor
        results = [loop.finish() for loop in loops]
        loops = None
        for kind, got in zip(("tunnel", "endpoint + ServiceClient"), results):
            print(f"handover, {kind}: {len(got)} requests, {sum(r == 200 for _, r in got)} answered 200")
            bad = [(t, r) for t, r in got if r != 200]
            assert not bad, f"{kind}: {len(bad)} of {len(got)} requests failed: {bad[:5]}"
            assert len(got) > 20, f"{kind}: only {len(got)} requests"
        succ_job = jobs[succ]
        assert succ_job["generation"] == 1 and succ_job["predecessor"] == first
        metrics = httpx.get(f"{succ_job['url']}/metrics").text   # the successor did take requests
        assert any(line.startswith("tgi_request_success") and float(line.split()[1]) > 0 for line in metrics.splitlines())
        assert "drained: every request in flight finished" in (Path(started["logs"][0])).read_text()
    finally:
        for loop in loops or []:
            loop.finish()
        if tunnel is not None:
            tunnel.terminate()
            tunnel.wait(10)
        left = _cleanup(service_cli, local_cluster, name)
    assert not left, f"jobs left running after `stop {name}`: {left}"


def test_a_scancelled_replica_loses_no_request_not_sent_to_it(service_cli, local_cluster, laptop, model_path):  # noqa: F811
    _, popen, _, _ = laptop
    name = "replicas"
    started = _serve(service_cli, model_path, name, "--replicas", "2")
    victim = started["job_ids"][0]
    tunnel = loops = None
    try:
        tunnel, url, key = _open_tunnel(popen, name)
        endpoint = json.loads(service_cli("endpoint", name, "--json").stdout)
        assert len(endpoint["urls"]) == 2
        loops = [_tunnel_loop(url, key), _tunnel_loop(url, key), _client_loop(endpoint)]
        for loop in loops:
            loop.start()
        time.sleep(3)   # dozens of requests per loop, over both replicas
        killed_at = time.monotonic()
        local_cluster.cancel(victim)
        local_cluster.wait_for_state(victim, {"CANCELLED"}, timeout=30)
        time.sleep(10)
        results = [loop.finish() for loop in loops]
        loops = None
        assert tunnel.poll() is None, "the tunnel must keep serving"
        for kind, got in zip(("tunnel 1", "tunnel 2", "endpoint + ServiceClient"), results):
            assert not [r for _, r in got if isinstance(r, int) and r >= 500], f"{kind}: a 5xx answer"
            failed = [(t - killed_at, r) for t, r in got if r != 200]
            print(f"scancel, {kind}: {len(got)} requests, {len(failed)} failed: {failed}")
            # at most the one request this loop had in flight on the killed replica, with a clear error
            assert len(failed) <= 1, f"{kind}: {failed}"
            for when, error in failed:
                assert -1 < when < 10 and isinstance(error, (httpx.TransportError, ReplicaLost)), (kind, when, error)
            assert sum(1 for t, r in got if r == 200 and t > killed_at + 6) > 5, f"{kind} stopped being served"
        assert [j for j in service_cli.state(name)["jobs"] if j["job_id"] == victim][0]["state"] in ("draining", "ended")
    finally:
        for loop in loops or []:
            loop.finish()
        if tunnel is not None:
            tunnel.terminate()
            tunnel.wait(10)
        left = _cleanup(service_cli, local_cluster, name)
    assert not left, f"jobs left running after `stop {name}`: {left}"


def test_serve_a_service_from_the_laptop_with_a_tunnel(laptop, local_cluster, model_path, tmp_path):  # noqa: F811
    """The laptop's side of `serve --replicas --tunnel --stop-on-exit`: state, script and key written over
    SFTP, held jobs released over SSH, the tunnel balanced over both; Ctrl-C stops the whole service."""
    import signal

    from support.releases import standin_release

    tgi, popen, _, jobs = laptop
    release = standin_release(tmp_path / "release")   # its python puts this checkout first in the jobs
    proc = popen("serve", "--model", str(model_path("tiny-llama")), "--release", str(release), "--service", "lap",
                 "--replicas", "2", "--tunnel", "--local-port", "0", "--stop-on-exit", "--timeout", "120")
    ids = []
    try:
        out = _read_until(proc, r"api key: \S+", timeout=150)
        url = next(w for w in out.split() if w.startswith("http://127.0.0.1:"))
        key = Path(out.split("api key: ")[1].split()[0]).read_text().strip()
        state = json.loads((jobs / "services" / "lap.json").read_text())
        ids = [j["job_id"] for j in state["jobs"]]
        assert len(ids) == 2 and oct((jobs / "services" / "lap.api-key").stat().st_mode & 0o777) == "0o600"
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client:
            assert all(client.post("/generate", json=BODY).status_code == 200 for _ in range(4))
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        assert (jobs / "services" / "lap.stopped").exists()
        for job_id in ids:
            local_cluster.wait_for_state(job_id, {"CANCELLED", "COMPLETED"}, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        local_cluster.cancel(*ids) if ids else None

"""`metrics`, `chat` and tgi_hpc.api reach a service by its name (its replicas, from the service's state file),
with the real engine (SmolLM2) in a local Slurm job."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.releases import venv_release
from support.terminal import Terminal
from support.tgi_cli import TgiCli

NAME = "tools-svc"


@pytest.fixture(scope="module")
def service(local_cluster, model_path, tmp_path_factory):
    jobs_dir = tmp_path_factory.mktemp("jobs")
    tgi = TgiCli.for_cluster(local_cluster, jobs_dir)

    result = json.loads(tgi("serve", "--model", str(model_path("smollm2")), "--release", str(venv_release()),
                            "--service", NAME, "--max-total-tokens", "2048", "--wait", "--timeout", "240",
                            "--json").stdout)
    yield tgi, result["job_ids"]
    tgi("stop", NAME, check=False)
    local_cluster.cancel(*result["job_ids"])


@pytest.mark.slow
def test_metrics_of_a_service_reads_its_replicas(service):
    tgi, job_ids = service
    sample = json.loads(tgi("metrics", NAME, "--json", "--interval", "0.5").stdout)
    assert sample["target"] == NAME and sample["replicas"] == job_ids
    assert sample["counters"]["requests"] >= 1 and sample["kv_cache_usage"] is not None


@pytest.mark.slow
def test_chat_with_a_service_and_the_api_endpoint_of_a_service(service):
    tgi, job_ids = service
    term = Terminal(tgi.argv("chat", NAME, "--max-tokens", "6", "--temperature", "0"), tgi.env)
    try:
        term.expect(rf"chat with service {NAME} .*\n> $")
        start = term.send("Hello!\n")
        term.expect(r"Hello!\r?\n(.+?)\r?\n> $", start=start)
        term.send("/exit\n")
        assert term.proc.wait(30) == 0
    finally:
        term.close()
    script = ("import json, sys; from tgi_hpc import api\n"
              f"with api.endpoint({NAME!r}, cluster={tgi.profile!r}, overrides=[{'paths.jobs=' + str(tgi.jobs_dir)!r}]) as ep:\n"
              "    print(json.dumps({**ep.to_dict(), 'urls': ep.urls(), 'replicas': ep.replicas(),"
              " 'torch': 'torch' in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", script], env=tgi.env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found["service"] and found["via"] == "direct" and found["api_key"] and not found["torch"]
    assert list(found["replicas"]) == job_ids and found["urls"] == [found["replicas"][job_ids[0]]] == [found["url"]]

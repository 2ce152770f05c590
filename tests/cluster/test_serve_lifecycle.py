"""`tgi-hpc serve/status/logs/stop` against the real local Slurm cluster.

The engine here is the stand-in (tests/support/standin_engine.py) so these tests are about the
job lifecycle; test_serve_engine.py runs the same flow with the real engine and SmolLM2.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.releases import standin_release, venv_release

TGI_HPC = [sys.executable, "-m", "tgi_hpc"]


@pytest.fixture
def cli(local_cluster, tmp_path):
    jobs_dir = tmp_path / "jobs"

    def run(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [*TGI_HPC, *args[:1], "--cluster", str(local_cluster.profile),
                "--set", f"paths.jobs={jobs_dir}", *args[1:]]
        result = subprocess.run(argv, env=local_cluster.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
        return result

    run.jobs_dir = jobs_dir
    return run


@pytest.fixture
def release(tmp_path):
    return standin_release(tmp_path / "release")


def _status(cli, job_id) -> dict:
    return json.loads(cli("status", job_id, "--json").stdout)[0]


def _wait_state(cli, job_id, want: set[str], timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(cli, job_id)
        if st["state"] in want or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def _serve(cli, model, release, *extra) -> dict:
    out = cli("serve", "--model", str(model), "--release", str(release), "--wait", "--timeout", "90", "--json", *extra)
    return json.loads(out.stdout)


def _api_key(st: dict) -> str:
    return Path(st["api_key_file"]).read_text().strip()


def test_serve_ready_status_logs_stop(cli, local_cluster, model_path, release):
    result = _serve(cli, model_path("tiny-llama"), release)
    job_id, st = result["job_id"], result["status"]
    assert st["state"] == "READY" and st["node"] == local_cluster.node
    assert st["port"] == 10000 + int(job_id[-4:])          # nothing else listens there on this node
    # The endpoint really answers, with the job's API key and only with it.
    url = st["url"]
    assert httpx.post(f"{url}/generate", json={"inputs": "hi"}).status_code == 401
    ok = httpx.post(f"{url}/generate", json={"inputs": "hi"}, headers={"Authorization": f"Bearer {_api_key(st)}"})
    assert ok.status_code == 200
    assert oct(Path(st["api_key_file"]).stat().st_mode & 0o777) == "0o600"
    # The key never reached the script, the log or the engine's argv.
    key = _api_key(st)
    script = Path(result["script_path"]).read_text()
    assert key not in script and "#SBATCH --job-name=tgi-hpc-serve" in script
    listed = json.loads(cli("status", "--json").stdout)
    assert job_id in [row["job_id"] for row in listed]
    log = cli("logs", job_id).stdout
    assert f"port {st['port']}" in log and key not in log
    assert cli("stop", job_id).returncode == 0
    local_cluster.wait_for_state(job_id, "CANCELLED", source="sacct", timeout=30)
    assert _status(cli, job_id)["state"] == "CANCELLED"


def test_keep_alive_requeue_keeps_job_id_and_port(cli, local_cluster, model_path, release):
    result = _serve(cli, model_path("tiny-llama"), release, "--requeue", "--partition", "long")
    job_id, port = result["job_id"], result["status"]["port"]
    script = Path(result["script_path"]).read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@" in script
    # What Slurm sends shortly before the time limit:
    local_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    local_cluster.wait_for_state(job_id, {"PENDING"}, timeout=30)
    st = _wait_state(cli, job_id, {"READY"}, timeout=90)
    assert st["state"] == "READY", st
    assert local_cluster.show_job(job_id)["Restarts"] == "1"
    assert st["port"] == port
    cli("stop", job_id)


def test_requeue_onto_a_taken_port_records_the_fallback(cli, local_cluster, model_path, release):
    result = _serve(cli, model_path("tiny-llama"), release, "--partition", "long")
    job_id, port = result["job_id"], result["status"]["port"]
    local_cluster.run("scontrol", "requeue", job_id)
    local_cluster.wait_for_state(job_id, {"PENDING"}, timeout=30)
    with socket.socket() as squatter:   # someone else grabs the port while the job is away
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("0.0.0.0", port))
        squatter.listen()
        st = _wait_state(cli, job_id, {"READY"}, timeout=90)
    assert st["state"] == "READY", st
    assert st["port"] == port + 1
    endpoint = json.loads((cli.jobs_dir / f"{job_id}.endpoint.json").read_text())
    assert endpoint["port"] == port + 1 and endpoint["restart_count"] == 1
    cli("stop", job_id)


def test_pending_reason_and_failed_job(cli, local_cluster, tmp_path):
    # A missing release is refused before submitting: no job waits in the queue to fail.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    out = cli("serve", "--model", str(model), "--release", str(tmp_path / "missing"), "--wait", "--timeout", "60",
              check=False)
    assert out.returncode == 10 and "no engine release" in out.stderr and "submitted job" not in out.stderr
    # A job that fails on its node (unreadable weights): --wait reports it, with the end of its log.
    out = cli("serve", "--model", str(model), "--release", str(venv_release()), "--wait", "--timeout", "120",
              check=False)
    assert out.returncode == 6, out.stderr
    assert "ended FAILED" in out.stderr and "the end of its log" in out.stderr
    job_id = re.search(r"submitted job (\d+)", out.stderr).group(1)
    last = [line for line in (cli.jobs_dir / f"{job_id}.out").read_text().splitlines() if line.strip()][-1]
    assert last[:100] in out.stderr


def test_unknown_account_is_rejected_at_submit(cli, local_cluster, model_path, release):
    if not local_cluster.enforce_accounts:
        pytest.skip("cluster started without account enforcement")
    out = cli("serve", "--model", str(model_path("tiny-llama")), "--release", str(release),
              "--set", "slurm.account=def-nobody", check=False)
    assert out.returncode == 5
    assert "sbatch failed" in out.stderr


def test_preempted_server_comes_back_with_the_same_job_id_and_port(cli, local_cluster, model_path, release):
    result = _serve(cli, model_path("tiny-llama"), release, "--requeue", "--partition", "long",
                    "--gpus", str(local_cluster.gpus))
    job_id, port = result["job_id"], result["status"]["port"]
    urgent = local_cluster.sbatch("-p", "unkillable", "-n1", "--gpus-per-task=1", "-o", "/dev/null",
                                  "--wrap", "sleep 2")
    local_cluster.wait_for_state(urgent, {"RUNNING", "COMPLETED"}, timeout=30)
    assert local_cluster.show_job(job_id)["Restarts"] == "1"
    local_cluster.wait_for_state(urgent, "COMPLETED", timeout=30)
    st = _wait_state(cli, job_id, {"READY"}, timeout=90)
    assert (st["state"], st["port"]) == ("READY", port), st
    cli("stop", job_id)

"""tgi_hpc.api drives a real serve job on the local Slurm cluster: serve -> ready -> generate -> metrics -> stop,
in a fresh interpreter that never imports torch (nor the engine)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.releases import venv_release

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, time
import httpx
from tgi_hpc import api
from tgi_hpc.errors import UsageError

model, profile, jobs_dir, release = sys.argv[1:5]
out = {}
try:
    api.serve(model, cluster=profile, overrides=[f"paths.jobs={jobs_dir}"], no_such_limit=3)
except UsageError as exc:
    out["refused"] = str(exc)
server = api.serve(model, cluster=profile, overrides=[f"paths.jobs={jobs_dir}"], release=release, max_total_tokens=2048)
try:
    out["submitted_state"] = server.status().state
    out["ready"] = server.wait_until_ready(timeout=240).state
    out["port"] = server.port
    with server.endpoint() as ep:
        out["via"], out["has_key"] = ep.via, bool(ep.api_key)
        body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6}}
        answer = httpx.post(f"{ep.url}/generate", headers=ep.headers, json=body, timeout=120)
        out["generate"] = [answer.status_code, answer.json().get("generated_text")]
        out["without_key"] = httpx.post(f"{ep.url}/generate", json=body, timeout=60).status_code
    # the same job through the module-level functions and a job id, as a chained job would
    again = api.attach(server.job_id, cluster=profile, overrides=[f"paths.jobs={jobs_dir}"])
    out["by_id"] = again.status().state
    out["metrics"] = api.metrics(again, interval=0.5)
finally:
    server.stop()
deadline = time.monotonic() + 60
while time.monotonic() < deadline and api.status(server.job_id, cluster=profile,
                                                 overrides=[f"paths.jobs={jobs_dir}"]).state not in ("CANCELLED", "COMPLETED"):
    time.sleep(0.5)
out["after_stop"] = api.status(server.job_id, cluster=profile, overrides=[f"paths.jobs={jobs_dir}"]).state
out["job_id"] = server.job_id
out["imported"] = sorted(m for m in ("torch", "transformers", "engine") if m in sys.modules)
print(json.dumps(out))
"""


def test_api_serve_ready_generate_metrics_stop_without_torch(local_cluster, model_path, tmp_path):
    env = {**local_cluster.env, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", SCRIPT, str(model_path("smollm2")), str(local_cluster.profile), str(tmp_path / "jobs"),
            str(venv_release())]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=420, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    try:
        assert "no_such_limit" in out["refused"] and "max_total_tokens" in out["refused"]
        assert out["submitted_state"] in ("PENDING", "STARTING") and out["ready"] == "READY"
        assert out["port"] == 10000 + int(out["job_id"][-4:])
        assert out["via"] == "direct" and out["has_key"]
        status, text = out["generate"]
        assert status == 200 and text
        assert out["without_key"] == 401
        assert out["by_id"] == "READY"
        metrics = out["metrics"]
        assert metrics["target"] == out["job_id"] and metrics["replicas"] == [out["job_id"]] and metrics["counters"]["requests"] >= 2   # the probe + ours
        assert metrics["counters"]["generated_tokens"] >= 6 and metrics["kv_cache_usage"] is not None
        assert out["after_stop"] == "CANCELLED"
        assert out["imported"] == []
    finally:
        local_cluster.cancel(out["job_id"])


@pytest.mark.slow
def test_the_chained_evaluation_example_runs_after_the_serve_job(local_cluster, model_path, tmp_path):
    """docs/examples/evaluate.py as its docstring says: the serve job's id from the API, then an evaluation job
    submitted with --dependency=after:JOB that finds the cluster through the environment sbatch passes on."""
    env = {**local_cluster.env, "PYTHONPATH": str(ROOT), "TGI_HPC_CLUSTER": str(local_cluster.profile),
           "TGI_HPC_SET": f"paths.jobs={tmp_path / 'jobs'}"}
    serve = (f"from tgi_hpc import api; print(api.serve({str(model_path('smollm2'))!r}, "
             f"release={str(venv_release())!r}, max_total_tokens=2048).job_id)")
    job = subprocess.run([sys.executable, "-c", serve], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.strip()
    evaluation = ""
    try:
        wrap = f"{sys.executable} {ROOT / 'docs/examples/evaluate.py'} {job} --timeout 240 --stop-server"
        evaluation = subprocess.run(["sbatch", "--parsable", f"--dependency=after:{job}", "--partition=main-cpu",
                                     "--time=0:10:00", f"--output={tmp_path / 'eval.out'}", "--wrap", wrap],
                                    env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                                    check=True).stdout.strip().split(";")[0]
        local_cluster.wait_for_state(evaluation, {"COMPLETED"}, timeout=360)
        text = (tmp_path / "eval.out").read_text()
        result = json.loads(text[text.index("{"):])
        assert result["job_id"] == job and len(result["answers"]) == 3
        assert all(row["answer"] for row in result["answers"]) and 0 <= result["score"] <= 1
        assert result["server_counters"]["requests"] >= 3
        local_cluster.wait_for_state(job, {"CANCELLED"}, timeout=60)     # --stop-server
    finally:
        local_cluster.cancel(job, *([evaluation] if evaluation else []))

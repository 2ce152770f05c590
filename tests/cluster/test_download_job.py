"""`tgi-hpc download --job` on the real cluster, from a Hub-protocol server on 127.0.0.1, then
`tgi-hpc serve --model ORG/NAME` finds it in the store. The token only travels in the environment."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.hub_server import HubServer
from support.releases import standin_release

TOKEN = "hf_clusterSecret0123456789"


@pytest.fixture
def hub_repo(tmp_path, model_path):
    root = tmp_path / "hub"
    shutil.copytree(model_path("tiny-llama"), root / "acme" / "tiny-gated")
    return root


def _tgi(local_cluster, tmp_path, *args, env=None, check=True):
    argv = [sys.executable, "-m", "tgi_hpc", args[0], "--cluster", str(local_cluster.profile),
            "--set", f"paths.jobs={tmp_path / 'jobs'}", "--set", f"paths.models={tmp_path / 'store'}", *args[1:]]
    result = subprocess.run(argv, env={**local_cluster.env, **(env or {})}, capture_output=True, text=True, timeout=180)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def test_download_job_then_serve_by_hub_id(local_cluster, tmp_path, hub_repo):
    with HubServer(hub_repo, gated={"acme/tiny-gated"}, tokens={TOKEN}) as url:
        env = {"HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf")}
        # Without a token the gated repo fails, in the job, with the licence hint in the job's log.
        failed = _tgi(local_cluster, tmp_path, "download", "--model", "acme/tiny-gated", "--job", "--wait",
                      env=env, check=False)
        assert failed.returncode == 6, failed.stderr
        job_id = failed.stderr.split("submitted download job ")[1].split(";")[0]
        assert "accept the licence" in (tmp_path / "jobs" / f"{job_id}.out").read_text()
        # With HF_TOKEN in the environment (as a user exports it), the job downloads; the command waits for it
        # by default, so it returns once the snapshot is complete.
        ok = _tgi(local_cluster, tmp_path, "download", "--model", "acme/tiny-gated", "--job", "--json",
                  env={**env, "HF_TOKEN": TOKEN})
        result = json.loads(ok.stdout)
        assert result["state"] == "COMPLETED"
    stored = tmp_path / "store" / "acme--tiny-gated" / "main"
    assert (stored / "model.safetensors").is_file() and (stored / ".tgi-hpc.json").is_file()
    # The token is in no script, log or stored file.
    for path in [*(tmp_path / "jobs").iterdir(), *stored.rglob("*")]:
        if path.is_file():
            assert TOKEN not in path.read_text(errors="replace"), path
    listed = json.loads(_tgi(local_cluster, tmp_path, "models", "--json").stdout)
    assert [(m["model_id"], m["complete"]) for m in listed] == [("acme/tiny-gated", True)]
    # serve resolves the Hub id to the store and stages it to $SLURM_TMPDIR.
    release = standin_release(tmp_path / "release")
    served = json.loads(_tgi(local_cluster, tmp_path, "serve", "--model", "acme/tiny-gated", "--release", str(release),
                             "--wait", "--timeout", "90", "--json").stdout)
    assert served["status"]["state"] == "READY"
    script = Path(served["script_path"]).read_text()
    assert "acme--tiny-gated/main" in script and "tgi_hpc.slurm.job stage" in script
    _tgi(local_cluster, tmp_path, "stop", served["job_id"])


def test_serve_refuses_a_model_missing_from_the_store(local_cluster, tmp_path):
    out = _tgi(local_cluster, tmp_path, "serve", "--model", "acme/never-downloaded", check=False)
    assert out.returncode == 8
    assert "tgi-hpc download --model acme/never-downloaded" in out.stderr
    assert not (tmp_path / "jobs").exists()

"""`tgi-hpc endpoint JOB`: a plain serve job's URL and key for a client in another job (exports, --json)."""
from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from support.releases import standin_release


@pytest.fixture
def served(run, tmp_path, model_path):
    base = ["--cluster", "local", "--set", f"paths.jobs={tmp_path / 'jobs; $(x) dir'}"]
    code, out, err = run("serve", *base, "--model", str(model_path("tiny-llama")),
                         "--release", str(standin_release(tmp_path / "rel")), "--wait", "--timeout", "60", "--json")
    assert code == 0, err
    job_id = json.loads(out)["job_id"]
    yield base, job_id
    run("stop", *base, job_id)


def test_exports_reach_the_server_from_a_shell(run, served):
    base, job_id = served
    code, out, _ = run("endpoint", *base, job_id)
    assert code == 0 and "export OPENAI_API_KEY=" in out
    shell = subprocess.run(["bash", "-c", out + '\nprintf "%s\\n" "$TGI_HPC_JOB" "$OPENAI_BASE_URL" "$OPENAI_API_KEY" '
                                              '"$TGI_HPC_URL" "$TGI_HPC_MODEL"'],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    job, base_url, key, url, model = shell
    assert job == job_id and base_url == url + "/v1" and len(key) >= 16 and model
    assert key not in out                                  # the key is read from its 0600 file, never printed
    assert httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200

    code, out, _ = run("endpoint", *base, job_id, "--json")
    found = json.loads(out)
    assert code == 0 and found["url"] == url and found["api_key"] == key and found["openai_base_url"] == base_url
    assert found["job_id"] == job_id and found["model"] == model and model in found["served"]


def test_a_job_that_is_not_serving_is_an_error(run, served):
    base, job_id = served
    code, out, err = run("endpoint", *base, "424242")
    assert code == 5 and out == "" and "no such job: 424242" in err
    assert run("stop", *base, job_id)[0] == 0
    code, out, err = run("endpoint", *base, job_id, "--wait", "--timeout", "20")
    assert code == 6 and out == "" and f"job {job_id}" in err
    code, out, err = run("endpoint", *base, job_id)
    assert code == 6 and out == "" and "it serves nothing" in err

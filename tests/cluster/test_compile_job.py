"""`tgi-hpc compile` as a real Slurm job builds the offline release; `release verify` passes; a
second compile rebuilds nothing; the release's engine serves with no network at all, and a serve
job activates it (installing nothing). The CLI runs as a user installs it: a wheel, non-editable, in a fresh
venv, with no checkout beside it, so `compile` finds the engine's source through the install's PEP 610 record."""
from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from support.venvs import wheel_venv

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(local_cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("compile")
    overrides = ["--set", f"paths.jobs={base / 'jobs'}", "--set", f"paths.releases={base / 'releases'}"]
    python, wheel = wheel_venv(ROOT, base / "cli")
    env = {k: v for k, v in local_cluster.env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def tgi(*args, check=True, timeout=900):
        words = 2 if args[0] == "release" else 1  # global options go after the (sub)command
        argv = [str(python), "-m", "tgi_hpc", *args[:words], "--cluster", str(local_cluster.profile), *overrides,
                *args[words:]]
        # run outside the checkout: `python -m` puts the working directory first on sys.path
        out = subprocess.run(argv, env=env, cwd=base, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{args} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    where = subprocess.run([str(python), "-c", "import tgi_hpc; print(tgi_hpc.__file__)"], env=env, cwd=base,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(python.parents[1])), f"the CLI imported tgi_hpc from {where}"
    first = json.loads(tgi("compile", "--job", "--wait", "--json").stdout)
    return tgi, base, first, wheel


def test_compile_job_builds_a_complete_release(built):
    tgi, base, first, wheel = built
    assert first["where"] == "job" and first["state"] == "COMPLETED"
    current = base / "releases" / "current"
    manifest = json.loads((current / "release.json").read_text())
    assert manifest["torch"].startswith("2.13.0") and manifest["cuda"] is None
    assert (current / "bin" / "activate").is_file() and (current / "requirements.lock").is_file()
    assert any(name.startswith("torch-") for name in manifest["wheelhouse"])
    # the engine inside came from the CLI's own wheel (PEP 610), not from a checkout or PyPI
    assert manifest["inputs"]["project"] == f"wheel:{hashlib.sha256(wheel.read_bytes()).hexdigest()}"


def test_release_verify_passes(built):
    tgi, base, *_ = built
    out = tgi("release", "verify", str(base / "releases" / "current"), "--json", timeout=300)
    assert json.loads(out.stdout)["ok"] is True


def test_compiling_again_rebuilds_nothing(built):
    tgi, base, first, _ = built
    release = (base / "releases" / "current").resolve()
    before = (release / "release.json").read_text()
    again = json.loads(tgi("compile", "--job", "--wait", "--json").stdout)
    assert again["state"] == "COMPLETED"
    log = (base / "jobs" / f"{again['job_id']}.out").read_text()
    assert "up to date" in log
    assert (base / "releases" / "current").resolve() == release
    assert (release / "release.json").read_text() == before


def test_release_engine_serves_with_no_network(built, model_path, tmp_path):
    """In a fresh network namespace (loopback only): nothing can be fetched, and /generate answers."""
    _, base, *_ = built
    python = base / "releases" / "current" / "bin" / "python"
    script = f"""
set -e
ip link set lo up
{python} -c 'import urllib.request as u
try:
    u.urlopen("https://pypi.org", timeout=3); raise SystemExit("network reachable")
except OSError: pass'
HF_HUB_OFFLINE=1 {python} -m engine --model-id {model_path('tiny-llama')} --hostname 127.0.0.1 --port 18099 \
  --ready-file {tmp_path}/ready.json > {tmp_path}/engine.log 2>&1 &
for i in $(seq 1 300); do [ -f {tmp_path}/ready.json ] && break; sleep 0.2; done
{python} -c 'import json, urllib.request as u
r = u.urlopen(u.Request("http://127.0.0.1:18099/generate", data=json.dumps({{"inputs": "Hi", "parameters": {{"max_new_tokens": 3}}}}).encode(), headers={{"Content-Type": "application/json"}}), timeout=60)
print(json.loads(r.read())["generated_text"] is not None)'
kill %1
"""
    out = subprocess.run(["unshare", "--net", "bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr + (tmp_path / "engine.log").read_text()
    # The engine came from the release (installed into it), not from the checkout.
    where = subprocess.run([str(python), "-c", "import engine; print(engine.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path).stdout
    assert str((base / "releases").resolve()) in str(Path(where.strip()).resolve()), where


def test_serve_job_activates_the_release(built, model_path):
    tgi, base, *_ = built
    out = json.loads(tgi("serve", "--model", str(model_path("tiny-llama")), "--wait", "--timeout", "180", "--json").stdout)
    try:
        assert out["status"]["state"] == "READY"
        script = Path(out["script_path"]).read_text()
        assert f"RELEASE={base / 'releases'}/current" in script.replace("'", "")
        assert "pip install" not in script
    finally:
        tgi("stop", out["job_id"], check=False)

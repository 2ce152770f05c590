"""From a "laptop": its own HOME and ssh config, Slurm only reachable over a real sshd (through a
ProxyJump hop), `tgi-hpc serve --tunnel` with the real engine and SmolLM2, real clients through
the tunnel, a dropped SSH connection, a requeued job, and no secret in any process's argv."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from support.releases import venv_release

HF_SECRET = "hf_laptopSecretNeverInArgv42"


def _ssh_config(local_cluster, known_hosts: Path) -> str:
    common = (f"  HostName 127.0.0.1\n  Port {local_cluster.ssh_port}\n  User root\n"
              f"  IdentityFile {local_cluster.ssh_key}\n  UserKnownHostsFile {known_hosts}\n")
    # tgi-login is reached through a jump host, as from outside a cluster's network.
    return f"Host tgi-bastion\n{common}\nHost tgi-login\n{common}  ProxyJump tgi-bastion\n"


@pytest.fixture
def laptop(local_cluster, tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    known = home / ".ssh" / "known_hosts"
    known.write_text(local_cluster.known_hosts.read_text())
    (home / ".ssh" / "config").write_text(_ssh_config(local_cluster, known))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TGI_HPC_CLUSTER"))}
    env.update(HOME=str(home), TGI_HPC_REMOTE="1", TGI_HPC_STATE_DIR=str(home / "state"),
               TGI_HPC_CONFIG_DIR=str(home / "config"), HF_TOKEN=HF_SECRET, PYTHONUNBUFFERED="1")
    jobs = tmp_path / "jobs"   # on the cluster's filesystem (the same machine here)
    # tgi-hpc as installed on the "cluster" side (remote mode runs login-node steps with it)
    base = ["--cluster", str(local_cluster.profile), "--set", f"paths.jobs={jobs}",
            "--set", f"remote_python={sys.executable}"]

    def tgi(*args, env_extra=None, **kwargs):
        return subprocess.run([sys.executable, "-m", "tgi_hpc", args[0], *base, *args[1:]], env={**env, **(env_extra or {})},
                              capture_output=True, text=True, timeout=kwargs.pop("timeout", 120), **kwargs)

    def popen(*args):
        return subprocess.Popen([sys.executable, "-m", "tgi_hpc", args[0], *base, *args[1:]], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    tgi.env = env   # the laptop's environment, for commands pasted verbatim
    return tgi, popen, home, jobs


def _argv_of_all_processes() -> str:
    text = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return "\n".join(text)


def _read_until(proc, pattern: str, timeout: float) -> str:
    """stdout so far, once it matches `pattern` (a reader thread: the process keeps running)."""
    if not hasattr(proc, "lines"):
        proc.lines = []
        threading.Thread(target=lambda: proc.lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = "".join(proc.lines)
        if re.search(pattern, seen):
            return seen
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout} s; stdout={''.join(proc.lines)!r} "
                         f"stderr={proc.stderr.read() if proc.poll() is not None else '(running)'!r}")


def _kill_ssh_sessions(local_cluster) -> int:
    """Kill the sshd processes serving connections (not the listener): the laptop's link drops."""
    master = int((local_cluster.state_dir / "run" / "sshd.pid").read_text())
    children = subprocess.run(["pgrep", "-P", str(master)], capture_output=True, text=True).stdout.split()
    killed = 0
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
        except ProcessLookupError:  # that session was ending anyway
            pass
    return killed


def test_unknown_host_key_is_refused_with_how_to_accept(laptop):
    tgi, _, home, _ = laptop
    (home / ".ssh" / "known_hosts").write_text("")
    out = tgi("status")
    assert out.returncode == 11, out.stderr
    assert "--accept-host-key" in out.stderr and "ssh " in out.stderr


def test_serve_tunnel_from_the_laptop(laptop, local_cluster, model_path):
    from openai import OpenAI
    from text_generation import Client

    tgi, popen, home, jobs = laptop
    proc = popen("serve", "--model", str(model_path("smollm2")), "--release", str(venv_release()),
                 "--partition", "long", "--tunnel", "--local-port", "0", "--timeout", "180")
    try:
        out = _read_until(proc, r"api key: \S+", timeout=180)
        url = re.search(r"ready at (http://127\.0\.0\.1:\d+)", out).group(1)
        key_file = re.search(r"api key: (\S+)", out).group(1)
        job_id = re.search(r"job (\d+) on", out).group(1)
        key = Path(key_file).read_text().strip()
        assert Path(key_file).is_relative_to(home) and oct(Path(key_file).stat().st_mode & 0o777) == "0o600"

        client = Client(url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert client.generate("The capital of France is", max_new_tokens=5).generated_text
        oai = OpenAI(base_url=f"{url}/v1", api_key=key)
        assert oai.completions.create(model="tgi", prompt="Hello", max_tokens=4).choices[0].text is not None
        argv = _argv_of_all_processes()
        assert key not in argv and HF_SECRET not in argv

        # The SSH connection dies mid-use: the tunnel reconnects and the next request succeeds.
        assert _kill_ssh_sessions(local_cluster) >= 1
        assert client.generate("Hello", max_new_tokens=2).generated_text is not None

        # The job is requeued: same job id and port; the tunnel serves again within 30 s of READY.
        local_cluster.run("scontrol", "requeue", job_id)
        local_cluster.wait_for_state(job_id, {"PENDING"}, timeout=30)
        local_cluster.wait_for_state(job_id, {"RUNNING"}, timeout=60)
        deadline = time.monotonic() + 120
        while json.loads(tgi("status", job_id, "--json").stdout)[0]["state"] != "READY":
            assert time.monotonic() < deadline, "the requeued job did not become READY again"
            time.sleep(0.5)
        ready_at = time.monotonic()
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - ready_at < 30, "the tunnel did not follow the requeued job within 30 s"
            time.sleep(0.5)
        assert client.generate("Hello", max_new_tokens=2).generated_text is not None
        assert key not in _argv_of_all_processes()

        # Ctrl-C closes the tunnel, leaves the job running and says how to come back; both printed
        # commands work when pasted (they carry the profile path, the --set items and --remote).
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        hint = proc.stderr.read()
        assert f"tgi-hpc tunnel {job_id}" in hint
        assert local_cluster.state(job_id) == "RUNNING"
        reconnect, stop = re.search(r"Reconnect: (tgi-hpc tunnel .+?)   Stop it: (tgi-hpc stop .+)$", hint, re.M).groups()
        assert "--remote" in reconnect and str(local_cluster.profile) in reconnect

        def paste(command):
            argv = [sys.executable, "-m", "tgi_hpc", *shlex.split(command)[1:]]
            return subprocess.run(argv, env=tgi.env, capture_output=True, text=True, timeout=240)

        again = paste(reconnect + " --background")
        assert again.returncode == 0 and "ready at http://127.0.0.1:" in again.stdout, again.stderr
        assert paste("tgi-hpc tunnel stop").returncode == 0
        stopped = paste(stop)
        assert stopped.returncode == 0 and f"stopped {job_id}" in stopped.stdout, stopped.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        tgi("stop", "--all")


def test_download_and_models_from_the_laptop_run_on_the_login_node(laptop, local_cluster, model_path, tmp_path):
    """download_on: login -> the Hub client runs on the login node (token over the channel's stdin)."""
    import shutil

    from support.hub_server import HubServer

    tgi, _, home, _ = laptop
    hub = tmp_path / "hub"
    shutil.copytree(model_path("tiny-llama"), hub / "acme" / "tiny-gated")
    store = tmp_path / "cluster-store"   # on the cluster's filesystem; the laptop never writes it
    with HubServer(hub, gated={"acme/tiny-gated"}, tokens={HF_SECRET}) as url:
        out = tgi("download", "--model", "acme/tiny-gated", "--set", f"paths.models={store}", "--json",
                  env_extra={"HF_ENDPOINT": url})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["where"] == "here"
    assert (store / "acme--tiny-gated" / "main" / "model.safetensors").is_file()
    listed = tgi("models", "--set", f"paths.models={store}", "--json")
    assert [m["model_id"] for m in json.loads(listed.stdout)] == ["acme/tiny-gated"]
    assert not any(HF_SECRET in p.read_text(errors="replace") for p in store.rglob("*") if p.is_file())

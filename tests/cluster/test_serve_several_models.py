"""Several models in one Slurm job with the real engine: `serve --model A --model B` is READY with one endpoint
per model, each answers through its own tunnel from the laptop, `stop` ends both engines, and one engine killed
ends the job FAILED with no engine left behind (the node is this machine, so /proc shows them)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.releases import venv_release
from test_laptop import _read_until, laptop  # noqa: F401 (the laptop fixture: its own HOME, ssh config, --remote)

# two engines on a shared 2-core box: the CLI's own --timeout (300 s) must fire before pytest's, to say why
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# Jobs submitted over SSH get the login node's environment: this checkout's code goes with them.
ROOT = Path(__file__).resolve().parents[2]


def _processes_of(job_id: str) -> dict[int, str]:
    """pid -> argv of every process started for this job's engines (their ready files name the job)."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"/{job_id}.ready." in argv or f"/{job_id}.endpoint.json" in argv:
            found[int(cmdline.parent.name)] = argv
    return found


def _wait_gone(job_id: str, timeout: float = 60) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while (left := _processes_of(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_two_models_through_tunnels_then_stop_ends_both(laptop, local_cluster, model_path):  # noqa: F811
    tgi, popen, _, _ = laptop
    first, second = str(model_path("smollm2")), str(model_path("tiny-llama"))
    proc = popen("serve", "--model", first, "--model", second, "--release", str(venv_release()),
                 "--partition", "long", "--tunnel", "--local-port", "0", "--timeout", "300", "--env", f"PYTHONPATH={ROOT}")
    job_id = None
    try:
        out = _read_until(proc, r"api key: \S+", timeout=420)
        job_id = re.search(r"job (\d+) on", out).group(1)
        key = Path(re.search(r"api key: (\S+)", out).group(1)).read_text().strip()
        urls = dict(re.findall(r"^(\S+) at (http://127\.0\.0\.1:\d+)  \(-> ", out, re.M))
        assert list(urls) == [first, second], out
        assert len(set(urls.values())) == 2
        for model, url in urls.items():   # each local port reaches its own model's engine
            headers = {"Authorization": f"Bearer {key}"}
            assert httpx.get(f"{url}/info", headers=headers, timeout=30).json()["model_id"] == model
            gen = httpx.post(f"{url}/generate", headers=headers, timeout=60,
                             json={"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4}})
            assert gen.status_code == 200 and gen.json()["generated_text"]
        st = json.loads(tgi("status", job_id, "--json").stdout)[0]
        assert st["state"] == "READY" and [m["model"] for m in st["models"]] == [first, second]
        assert st["served"] == [first, second] and st["models"][1]["port"] > st["models"][0]["port"]
        assert len([a for a in _processes_of(job_id).values() if "-m engine" in a]) == 2

        stopped = tgi("stop", job_id)
        assert stopped.returncode == 0 and f"stopped {job_id}" in stopped.stdout, stopped.stderr
        local_cluster.wait_for_state(job_id, {"CANCELLED"}, timeout=60, source="sacct")
        assert not _wait_gone(job_id), "engines outlived the stopped job"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if job_id:
            tgi("stop", job_id)


def test_one_engine_killed_fails_the_whole_job_with_no_orphans(local_cluster, model_path, tmp_path):
    jobs_dir = tmp_path / "jobs"

    def tgi(*args, check=True):
        argv = [sys.executable, "-m", "tgi_hpc", args[0], "--cluster", str(local_cluster.profile),
                "--set", f"paths.jobs={jobs_dir}", *args[1:]]
        out = subprocess.run(argv, env=local_cluster.env, capture_output=True, text=True, timeout=400)
        if check and out.returncode != 0:
            raise AssertionError(f"{args} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    result = json.loads(tgi("serve", "--model", str(model_path("tiny-llama")), "--model", str(model_path("tiny-qwen2")),
                            "--release", str(venv_release()), "--wait", "--timeout", "300", "--json").stdout)
    job_id = result["job_id"]
    try:
        assert result["status"]["state"] == "READY" and len(result["status"]["models"]) == 2
        engines = {pid: argv for pid, argv in _processes_of(job_id).items() if "-m engine" in argv}
        assert len(engines) == 2, engines
        victim = next(pid for pid, argv in engines.items() if "ready.1.json" in argv)
        os.kill(victim, signal.SIGKILL)
        local_cluster.wait_for_state(job_id, {"FAILED"}, timeout=90, source="sacct")
        assert json.loads(tgi("status", job_id, "--json", check=False).stdout)[0]["state"] == "FAILED"
        assert not _wait_gone(job_id, timeout=30), "a process of the failed job is still running"
        assert "ended (status 137): stopping the others" in tgi("logs", job_id).stdout
    finally:
        tgi("stop", job_id, check=False)


def test_an_adapter_downloaded_from_the_hub_is_served_and_listed(local_cluster, model_path, tmp_path):
    """download (adapter repo) -> serve --lora NAME=ORG/ADAPTER from the store -> the engine in the job lists it in
    /v1/models and generates with it (adapter_id and OpenAI's model). With --enable-runtime-lora, `tgi-hpc adapter
    load|list|unload JOB` changes the adapters while the job serves, and refusals are one-line errors."""
    from openai import OpenAI

    from support.adapters import make_adapter
    from support.hub_server import HubServer

    base = str(model_path("tiny-llama"))
    make_adapter(Path(base), tmp_path / "hub" / "acme" / "tiny-lora", seed=3)
    store, jobs_dir = tmp_path / "store", tmp_path / "jobs"

    def tgi(*args, env=None, code=0):
        words = 2 if args[0] == "adapter" else 1
        argv = [sys.executable, "-m", "tgi_hpc", *args[:words], "--cluster", str(local_cluster.profile),
                "--set", f"paths.jobs={jobs_dir}", "--set", f"paths.models={store}", *args[words:]]
        out = subprocess.run(argv, env={**local_cluster.env, **(env or {})}, capture_output=True, text=True, timeout=400)
        assert out.returncode == code, f"{args} exited {out.returncode}\n{out.stdout}\n{out.stderr}"
        return out

    with HubServer(tmp_path / "hub") as url:
        tgi("download", "--model", "acme/tiny-lora", env={"HF_ENDPOINT": url})
    make_adapter(Path(base), tmp_path / "checkpoint-1", seed=5)
    result = json.loads(tgi("serve", "--model", base, "--lora", "mine=acme/tiny-lora", "--release", str(venv_release()),
                            "--engine-arg", "--enable-runtime-lora", "--engine-arg", "--max-loras=2",
                            "--wait", "--timeout", "300", "--json").stdout)
    job_id, st = result["job_id"], result["status"]
    try:
        assert st["state"] == "READY" and st["served"] == [base, "mine"]
        key = Path(st["api_key_file"]).read_text().strip()
        headers = {"Authorization": f"Bearer {key}"}
        listed = httpx.get(f"{st['url']}/v1/models", headers=headers, timeout=30).json()
        assert [m["id"] for m in listed["data"]] == [base, "mine"]
        body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6, "adapter_id": "mine"}}
        tuned = httpx.post(f"{st['url']}/generate", headers=headers, json=body, timeout=60)
        assert tuned.status_code == 200, tuned.text
        oai = OpenAI(base_url=f"{st['url']}/v1", api_key=key)
        assert oai.completions.create(model="mine", prompt="Hello", max_tokens=4).choices[0].text is not None
        unknown = httpx.post(f"{st['url']}/generate", headers=headers, timeout=60,
                             json={**body, "parameters": {**body["parameters"], "adapter_id": "nope"}})
        assert unknown.status_code == 422 and "mine" in unknown.text   # the engine names the adapters it has
        assert "tgi-hpc-lora/mine" in Path(result["script_path"]).read_text()

        checkpoint = tmp_path / "checkpoint-1"
        loaded = json.loads(tgi("adapter", "load", job_id, f"ckpt1={checkpoint}", "--json").stdout)
        assert loaded["servers"] == {job_id: "Success: LoRA adapter 'ckpt1' added successfully."}
        assert loaded["path"] == str(checkpoint) and not loaded["service"]
        listing = json.loads(tgi("adapter", "list", job_id, "--json").stdout)
        assert listing["servers"] == {job_id: {"model": base, "adapters": ["mine", "ckpt1"]}}
        assert oai.completions.create(model="ckpt1", prompt="Hello", max_tokens=4).choices[0].text is not None
        assert tgi("adapter", "list", job_id).stdout == f"{job_id}  {base}: mine, ckpt1\n"
        # a bad NAME=PATH is refused before any server is called: tests/tgi_hpc/test_runtime_adapters.py
        refusals = [(("load", job_id, f"mine={checkpoint}"), 2, "'mine' is already loaded"),
                    (("load", job_id, f"other={tmp_path / 'nowhere'}"), 8, "does not exist"),
                    (("load", job_id, f"two={checkpoint}"), 2, "no free LoRA slot"),
                    (("unload", job_id, "nope"), 2, "'nope' is not loaded"),
                    (("load", "99999999", f"z={checkpoint}"), 5, "no such job")]
        for args, code, message in refusals:
            out = tgi("adapter", *args, code=code)
            assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
        unloaded = json.loads(tgi("adapter", "unload", job_id, "ckpt1", "--json").stdout)
        assert unloaded["servers"] == {job_id: "Success: LoRA adapter 'ckpt1' removed successfully."}
        assert [m.id for m in oai.models.list().data] == [base, "mine"]
    finally:
        tgi("stop", job_id)


def test_two_models_on_their_own_gpus_requeue_to_the_same_ports(local_cluster, model_path, tmp_path):
    """--gpus 2 for two models: one GPU each (CUDA_VISIBLE_DEVICES split); USR1 before the time limit with
    --requeue: the job comes back READY on the same two ports (stand-in engines: this is about the job)."""
    from support.releases import standin_release

    jobs_dir, records = tmp_path / "jobs", tmp_path / "records"
    records.mkdir()
    env = {**local_cluster.env, "STANDIN_RECORD": str(records / "{port}.json")}

    def tgi(*args):
        argv = [sys.executable, "-m", "tgi_hpc", args[0], "--cluster", str(local_cluster.profile),
                "--set", f"paths.jobs={jobs_dir}", *args[1:]]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=200)
        assert out.returncode == 0, f"{args} exited {out.returncode}\n{out.stdout}\n{out.stderr}"
        return out

    result = json.loads(tgi("serve", "--model", str(model_path("tiny-llama")), "--model", str(model_path("smollm2")),
                            "--gpus", "2", "--requeue", "--partition", "long", "--release",
                            str(standin_release(tmp_path / "rel")), "--wait", "--timeout", "120", "--json").stdout)
    job_id, st = result["job_id"], result["status"]
    try:
        ports = [m["port"] for m in st["models"]]
        seen = [json.loads((records / f"{p}.json").read_text()) for p in ports]
        gpus = [r["cuda_visible_devices"] for r in seen]
        assert len(set(gpus)) == 2 and all(g and "," not in g for g in gpus), gpus
        first_pids = {r["pid"] for r in seen}
        local_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
        local_cluster.wait_for_state(job_id, {"PENDING"}, timeout=30)
        deadline = time.monotonic() + 120
        while (again := json.loads(tgi("status", job_id, "--json").stdout)[0])["state"] != "READY":
            assert time.monotonic() < deadline, again
            time.sleep(0.5)
        assert [m["port"] for m in again["models"]] == ports
        assert not any(_alive(pid) for pid in first_pids), "an engine of the first run outlived it"
    finally:
        tgi("stop", job_id)


def _alive(pid: int) -> bool:
    from tgi_hpc.slurm.local_job import pid_alive

    return pid_alive(pid)

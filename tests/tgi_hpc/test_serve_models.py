"""`serve --model A --model B` (one engine per model) and `serve --lora NAME=ADAPTER`: planning, checks before
submitting, rendering (bash -n on every profile, hostile values), and real job scripts run by the local backend
with the stand-in engine (ports, GPU split, endpoint file, one engine dying fails the whole job)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.releases import standin_release
from tgi_hpc.errors import ModelNotFoundError, UsageError
from tgi_hpc.models.adapter import same_base
from tgi_hpc.slurm.cluster import open_cluster
from tgi_hpc.slurm.jobspec import ShellPath
from tgi_hpc.slurm.render import render_job
from tgi_hpc.profiles.schema import Resources
from tgi_hpc.workflows.engines import ModelPlan, gpu_slices, memory_shares, plan_engines
from tgi_hpc.workflows.serve import ServeOptions, build_serve_spec, check_before_submit

BIG, SMALL = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"


def _bash_n(script: str) -> None:
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _adapter(folder: Path, base: str | None) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "base_model_name_or_path": base}))
    (folder / "adapter_model.safetensors").write_bytes(b"x")
    return folder


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 1}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    return folder


# planning

def test_gpus_are_split_when_there_is_one_per_model_else_shared_by_size():
    assert gpu_slices(4, 2) == [((0, 2), 2), ((2, 2), 2)]
    assert gpu_slices(3, 2) == [((0, 1), 1), ((1, 1), 1)]
    assert gpu_slices(1, 2) == [(None, 1), (None, 1)]
    assert gpu_slices(0, 2) == [(None, 1), (None, 1)]
    plans = [ModelPlan("a/big", ShellPath(), 8.0), ModelPlan("a/small", ShellPath(), 2.0)]
    assert memory_shares(plans, []) == [0.8, 0.2]
    assert memory_shares([ModelPlan("a/x", ShellPath(), None), ModelPlan("a/y", ShellPath(), 1.0)], []) == [0.5, 0.5]
    assert memory_shares(plans, [0.3, 0.6]) == [0.3, 0.6]
    with pytest.raises(UsageError, match="at most 1"):
        memory_shares(plans, [0.6, 0.6])
    with pytest.raises(UsageError, match="one per model"):
        memory_shares(plans, [0.5])
    with pytest.raises(UsageError, match=r"\(0, 1\]"):
        memory_shares(plans, [0.0, 0.5])


def test_cpu_engines_share_the_node_memory_by_size_and_its_threads():
    plans = [ModelPlan("a/big", ShellPath(), 8.0), ModelPlan("a/small", ShellPath(), 2.0)]
    engines = plan_engines(plans, [(), ()], Resources(gpus=0, cpus_per_task=8), (), [])
    assert [e.engine_args for e in engines] == [("--cuda-memory-fraction", "0.8", "--cpu-threads", "4"),
                                                ("--cuda-memory-fraction", "0.2", "--cpu-threads", "4")]
    alone = plan_engines(plans[:1], [()], Resources(gpus=0, cpus_per_task=8), (), [])
    assert alone[0].engine_args == ("--cpu-threads", "8")   # one engine: the whole node, no fraction


def test_several_models_render_one_engine_each_on_every_profile():
    for name in ("mila", "computecanada"):
        cluster = open_cluster(name, ["slurm.account=def-x"] if name != "mila" else [], strict_paths=False)
        for gpus, shares in ((1, True), (2, False)):
            spec = build_serve_spec(cluster, ServeOptions(model=BIG, other_models=[SMALL], gpus=gpus))
            script = render_job(cluster.profile, spec, job_dir=cluster.job_dir)
            _bash_n(script)
            assert [e.model for e in spec.engines] == [BIG, SMALL]
            assert script.count("python -m engine --model-id") == 2 and "# Model: " + BIG + " + " + SMALL in script
            assert ("--cuda-memory-fraction 0.94" in script) == shares and ("gpu-slice --first 1 --count 1" in script) != shares


def test_several_models_size_the_job_by_their_sum():
    cluster = open_cluster("mila", strict_paths=False)
    one = build_serve_spec(cluster, ServeOptions(model=BIG))
    two = build_serve_spec(cluster, ServeOptions(model=BIG, other_models=["meta-llama/Llama-3.1-8B"]))
    assert two.resources.gpus >= one.resources.gpus and two.resources.mem != one.resources.mem


@pytest.mark.parametrize("opts, message", [
    (dict(other_models=[BIG]), "given twice"),
    (dict(other_models=[SMALL], engine_args=["--served-model-name=x"]), "named after its --model"),
    (dict(other_models=[SMALL], engine_args=["--cuda-memory-fraction=0.5"]), "once per --model"),
    (dict(memory_fractions=[0.5, 0.4]), "give one per model"),
    (dict(loras=["bad name=a/b"]), "adapter name"),
    (dict(loras=["x,y=a/b"]), "adapter name"),
    (dict(loras=["../x=a/b"]), "adapter name"),
    (dict(loras=["_x=a/b"]), "adapter name"),
    (dict(loras=["tgi=a/b"]), "means the base model"),
    (dict(loras=["x=a/b"], engine_args=["--lora-adapters=y=/p"]), "--lora only"),
    (dict(other_models=[SMALL], engine_args=["--lora-adapters=y=/p"]), "trained on"),
    (dict(loras=["noequals"]), "NAME=ORG/ADAPTER"),
    (dict(loras=["a=org/x", "a=org/y"]), "already served"),
    (dict(loras=[f"{BIG}=org/x"]), "adapter name"),
    (dict(loras=["x=org/$(touch /tmp/pwned)"]), "invalid model id"),
])
def test_bad_flag_values_are_refused_before_anything_is_rendered(opts, message):
    cluster = open_cluster("mila", strict_paths=False)
    with pytest.raises(UsageError, match=message):
        build_serve_spec(cluster, ServeOptions(model=BIG, **opts))


def test_base_names_compare_hub_ids_and_folders():
    assert same_base("HuggingFaceTB/SmolLM2-135M", "huggingfacetb/smollm2-135m")
    assert same_base("/models/SmolLM2-135M/", "HuggingFaceTB/SmolLM2-135M")
    assert same_base("/store/HuggingFaceTB--SmolLM2-135M/main", "HuggingFaceTB/SmolLM2-135M")
    assert not same_base("other/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M")
    assert not same_base("HuggingFaceTB/SmolLM2-360M", "HuggingFaceTB/SmolLM2-135M")


def test_adapters_attach_to_their_base_and_a_stray_one_is_refused_or_warned(tmp_path, caplog):
    store = tmp_path / "store"
    _adapter(store / "acme--big-lora" / "main", BIG)
    _adapter(store / "acme--small-lora" / "main", SMALL)
    _adapter(store / "acme--stray" / "main", "someone/else")
    cluster = open_cluster("mila", [f"paths.models={store}"], strict_paths=False)
    both = ServeOptions(model=BIG, other_models=[SMALL], loras=["b=acme/big-lora", "s=acme/small-lora"], gpus=2)
    spec = build_serve_spec(cluster, both)
    assert [[a.name for a in e.loras] for e in spec.engines] == [["b"], ["s"]]
    with pytest.raises(UsageError, match="stray: the adapter was trained on someone/else, which matches none"):
        build_serve_spec(cluster, ServeOptions(model=BIG, other_models=[SMALL], loras=["stray=acme/stray"], gpus=2))
    spec = build_serve_spec(cluster, ServeOptions(model=BIG, loras=["stray=acme/stray"]))   # one model: a warning
    assert [a.name for a in spec.loras] == ["stray"] and "trained on someone/else, not on " + BIG in caplog.text


def test_an_absent_or_incomplete_adapter_is_refused_before_submitting(tmp_path, model_path):
    store = tmp_path / "store"
    cluster = open_cluster("local", [f"paths.models={store}", f"paths.jobs={tmp_path / 'jobs'}"])
    release = standin_release(tmp_path / "rel")
    spec = build_serve_spec(cluster, ServeOptions(model=str(model_path("tiny-llama")), loras=["a=acme/lora"]))
    with pytest.raises(ModelNotFoundError, match="run `tgi-hpc download --model acme/lora` first"):
        check_before_submit(cluster, spec, ShellPath("", str(release)), True)
    folder = _adapter(store / "acme--lora" / "main", None)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="adapter_model.safetensors is missing"):
        check_before_submit(cluster, spec, ShellPath("", str(release)), True)


def test_hostile_adapter_folders_and_model_folders_run_nothing(hostile, tmp_path):
    """Folders full of shell, as adapters and as a second model: the rendered job treats them as data."""
    release = standin_release(tmp_path / "release")
    for i, (value, marker) in enumerate(hostile[:5]):
        name = value.replace("/", "_").replace(",", "_")
        model = _model(tmp_path / f"m{i}" / name)
        other = _model(tmp_path / f"o{i}" / ("2" + name))
        lora = _adapter(tmp_path / f"l{i}" / name, str(model))
        cluster = open_cluster("local", [f"paths.jobs={tmp_path / f'jobs{i}'}"])
        spec = build_serve_spec(cluster, ServeOptions(model=str(model), other_models=[str(other)],
                                                      loras=[f"lora{i}={lora}"]))
        script = render_job(cluster.profile, spec, job_dir=cluster.job_dir, release_dir=ShellPath("", str(release)))
        _bash_n(script)
        records = _run_until_recorded(script, tmp_path / f"rec{i}", 2)
        assert not marker.exists(), f"{value!r} ran as shell"
        # the folder names hold the marker's path with "/" replaced: run, it would land in the job's cwd
        assert not list((tmp_path / f"rec{i}").glob("*pwned*")), f"{name!r} ran as shell"
        argvs = sorted((r["argv"] for r in records), key=lambda a: a[a.index("--model-id") + 1] != str(model))
        assert argvs[0][argvs[0].index("--lora-adapters") + 1] == f"lora{i}={lora}"
        assert argvs[1][argvs[1].index("--model-id") + 1] == str(other) and "--lora-adapters" not in argvs[1]


def _run_until_recorded(script: str, where: Path, count: int, env: dict | None = None) -> list[dict]:
    where.mkdir()
    env = {**os.environ, "TGI_HPC_JOB_ID": "4243", "STANDIN_RECORD": str(where / "{port}.json"),
           "SLURM_TMPDIR": str(where), **(env or {})}
    proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=where)
    try:
        deadline = time.monotonic() + 30
        while len(list(where.glob("*.json"))) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        return [json.loads(p.read_text()) for p in sorted(where.glob("*.json"))]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


# a real job (local backend, stand-in engines)

def _cli(tmp_path, *args, check=True, timeout=120):
    argv = [sys.executable, "-m", "tgi_hpc", args[0], "--cluster", "local", "--set", f"paths.jobs={tmp_path / 'jobs'}",
            *args[1:]]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d", "STANDIN_RECORD": str(tmp_path / "{port}.json")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and out.returncode != 0:
        raise AssertionError(f"{args} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def _alive(pid: int) -> bool:
    from tgi_hpc.slurm.local_job import pid_alive

    return pid_alive(pid)


def test_two_models_ready_on_two_ports_with_their_gpus_and_one_death_fails_the_job(tmp_path, model_path):
    release = standin_release(tmp_path / "rel")
    lora = _adapter(tmp_path / "lora", str(model_path("tiny-llama")))
    result = json.loads(_cli(tmp_path, "serve", "--model", str(model_path("tiny-llama")), "--model",
                             str(model_path("smollm2")), "--gpus", "4", "--lora", f"mine={lora}",
                             "--release", str(release), "--wait", "--timeout", "60", "--json").stdout)
    job_id, st = result["job_id"], result["status"]
    try:
        _check_two_models_then_kill_one(tmp_path, model_path, job_id, st)
    finally:
        _cli(tmp_path, "stop", job_id, check=False)


def _check_two_models_then_kill_one(tmp_path, model_path, job_id, st):
    import httpx

    assert st["state"] == "READY" and len(st["models"]) == 2
    ports = [m["port"] for m in st["models"]]
    assert ports[0] == st["port"] == 10000 + int(job_id[-4:]) and ports[1] > ports[0]
    assert st["served"] == [str(model_path("tiny-llama")), "mine", str(model_path("smollm2"))]
    key = Path(st["api_key_file"]).read_text().strip()
    for m in st["models"]:
        ok = httpx.post(f"{m['url']}/generate", json={"inputs": "hi"}, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    records = [json.loads((tmp_path / f"{port}.json").read_text()) for port in ports]
    assert [r["cuda_visible_devices"] for r in records] == ["GPU-a,GPU-b", "GPU-c,GPU-d"]
    assert [r["argv"][r["argv"].index("--num-shard") + 1] for r in records] == ["2", "2"]
    listed = json.loads(_cli(tmp_path, "status", job_id, "--json").stdout)[0]
    assert listed["served"] == st["served"] and listed["state"] == "READY"
    # one engine dies: the job fails as a whole and the other engine is gone too
    os.kill(records[1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = json.loads(_cli(tmp_path, "status", job_id, "--json", check=False).stdout)[0]
        if st["state"] not in ("READY", "STARTING", "LISTENING", "RUNNING"):
            break
        time.sleep(0.5)
    assert st["state"] == "FAILED"
    assert not _alive(records[0]["pid"])
    log = _cli(tmp_path, "logs", job_id).stdout
    assert "ended (status 137): stopping the others" in log


def test_one_model_with_adapters_lists_them_in_the_endpoint_and_status(tmp_path, model_path):
    release = standin_release(tmp_path / "rel")
    model = str(model_path("tiny-llama"))
    first, second = _adapter(tmp_path / "l 1", model), _adapter(tmp_path / "l2", model)
    result = json.loads(_cli(tmp_path, "serve", "--model", model, "--lora", f"one={first}", "--lora", f"two={second}",
                             "--release", str(release), "--wait", "--timeout", "60", "--json").stdout)
    st = result["status"]
    try:
        assert st["state"] == "READY" and st["served"] == [model, "one", "two"]
        endpoint = json.loads((tmp_path / "jobs" / f"{result['job_id']}.endpoint.json").read_text())
        assert endpoint["model"] == model and endpoint["adapters"] == ["one", "two"] and endpoint["port"] == st["port"]
        argv = json.loads((tmp_path / f"{st['port']}.json").read_text())["argv"]
        assert argv[argv.index("--lora-adapters") + 1] == f"one={first},two={second}"
        assert f"{Path(model).name} (+2)" in _cli(tmp_path, "status", result["job_id"]).stdout.replace("\n", " ")
    finally:
        _cli(tmp_path, "stop", result["job_id"], check=False)


def test_a_dry_run_from_a_laptop_reads_no_adapter_and_still_renders(monkeypatch, caplog):
    from tgi_hpc.cli import main

    monkeypatch.setenv("TGI_HPC_REMOTE", "1")
    code = main(["serve", "--cluster", "mila", "--model", BIG, "--model", SMALL, "--lora", "x=acme/lora", "--dry-run"])
    assert code == 0 and "dry run: adapter x is not read from the cluster" in caplog.text


def test_the_summary_names_each_model_and_its_adapters():
    from tgi_hpc.workflows.serve import ServeResult

    models = [{"model": "a/x", "url": "http://n:10001", "port": 10001, "adapters": ["sql"]},
              {"model": "b/y", "url": "http://n:10002", "port": 10002, "adapters": []}]
    status = {"state": "READY", "url": "http://n:10001", "node": "n", "api_key_file": "", "models": models}
    text = ServeResult("", "7", status=status).summary()
    assert "  a/x at http://n:10001 (adapters: sql)\n  b/y at http://n:10002\n" in text


def test_an_adapter_given_as_the_model_points_to_lora(tmp_path):
    lora = _adapter(tmp_path / "lora", BIG)
    cluster = open_cluster("local", [f"paths.jobs={tmp_path / 'jobs'}"])
    spec = build_serve_spec(cluster, ServeOptions(model=str(lora)))
    with pytest.raises(ModelNotFoundError, match="PEFT adapter, not a model: serve its base model with --lora"):
        check_before_submit(cluster, spec, ShellPath("", str(standin_release(tmp_path / "rel"))), True)


def test_the_python_api_passes_adapters_like_the_command(monkeypatch, tmp_path):
    import tgi_hpc.api as api

    seen = {}

    def fake_run_serve(cluster, opts, **kwargs):
        seen["loras"] = opts.loras
        raise UsageError("stop here")

    monkeypatch.setattr(api, "run_serve", fake_run_serve)
    with pytest.raises(UsageError, match="stop here"):
        api.serve("a/b", cluster="local", overrides=[f"paths.jobs={tmp_path}"], lora={"sql": "acme/sql-lora"})
    assert seen["loras"] == ["sql=acme/sql-lora"]

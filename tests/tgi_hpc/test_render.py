"""Rendering job scripts: valid bash for every shipped profile, and nothing a user types can run."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from support.releases import standin_release
from tgi_hpc.errors import TemplateError, UsageError
from tgi_hpc.slurm.cluster import open_cluster
from tgi_hpc.slurm.jobspec import ShellPath
from tgi_hpc.slurm.render import render_job, sbatch_directives
from tgi_hpc.workflows.serve import ServeOptions, build_serve_spec

CLUSTERS = ["mila", "computecanada", "fir", "nibi", "rorqual", "narval", "trillium"]


def _bash_n(script: str) -> None:
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", CLUSTERS)
@pytest.mark.parametrize("kind", ["serve", "download", "compile"])
def test_every_profile_renders_valid_bash(name, kind, tmp_path):
    cluster = open_cluster(name, ["slurm.account=def-x"] if name != "mila" else [], strict_paths=False)
    if kind == "serve":
        gpus = 4 if name == "trillium" else 2   # Trillium: 1 GPU or whole nodes of 4
        spec = build_serve_spec(cluster, ServeOptions(model="meta-llama/Llama-3.1-8B-Instruct", gpus=gpus, keep_alive=True))
        script = render_job(cluster.profile, spec, job_dir=cluster.job_dir)
        assert f"--num-shard {gpus}" in script and "#SBATCH --requeue" in script
    else:
        from tgi_hpc.release.options import CompileOptions
        from tgi_hpc.workflows.prepare import run_compile, run_download

        run = run_download if kind == "download" else run_compile
        args = ("meta-llama/Llama-3.1-8B-Instruct",) if kind == "download" else (CompileOptions(cuda_archs="8.0;9.0"),)
        script = run(cluster, *args, here=False, dry_run=True).script
    _bash_n(script)
    assert f"#SBATCH --job-name=tgi-hpc-{kind}" in script
    # caches and logs never go to $HOME; only the release (a virtualenv, read by jobs) lives there on DRAC
    assert "~/" not in script
    watched = [line for line in script.splitlines() if line.startswith(("export ", "JOB_DIR=", "#SBATCH", "MODEL_DIR="))]
    assert watched and all("$HOME" not in line for line in watched)


def test_directives_are_sorted_quoted_for_sbatch_and_validated():
    lines = sbatch_directives({"time": "1:00:00", "constraint": "ampere&nvlink", "requeue": True, "x": False,
                               "comment": 'a b#c "q" d\\e'})
    # sbatch reads only double quotes and backslash escapes, and a bare # ends a value
    assert lines == ['#SBATCH --comment="a b\\#c \\"q\\" d\\\\e"', '#SBATCH --constraint="ampere&nvlink"',
                     "#SBATCH --requeue", "#SBATCH --time=1:00:00"]
    with pytest.raises(TemplateError):
        sbatch_directives({"time; rm -rf /": "1"})


@pytest.mark.parametrize("args", [
    ["--partition", "main\ntouch /tmp/pwned #"],
    ["--time", "1:00:00\rid"],
    ["--set", 'slurm.account="def-x\\nid #"'],   # a YAML escape: the value holds a real newline
])
def test_a_line_break_in_a_directive_is_refused(args, capsys):
    from tgi_hpc.cli import main

    assert main(["serve", "--cluster", "mila", "--model", "a/b", "--dry-run", *args]) == 4
    assert "line break" in capsys.readouterr().err


def test_gpu_counts_a_cluster_does_not_allow_are_refused():
    from tgi_hpc.slurm import jobs

    cluster = open_cluster("trillium", ["slurm.account=def-x"], strict_paths=False)
    spec = build_serve_spec(cluster, ServeOptions(model="meta-llama/Llama-3.1-8B-Instruct", gpus=2))
    with pytest.raises(UsageError, match=r"1 GPU\(s\) on one node, or exactly 4 GPUs per node, not 2 .*Trillium_Quickstart"):
        jobs.render(cluster, spec)


def test_hostile_hub_id_is_refused_before_rendering():
    cluster = open_cluster("mila", strict_paths=False)
    with pytest.raises(UsageError, match="invalid model id"):
        build_serve_spec(cluster, ServeOptions(model="x/$(touch /tmp/pwned)"))


def test_unknown_engine_flag_and_secret_env_are_refused():
    cluster = open_cluster("mila", strict_paths=False)
    with pytest.raises(UsageError, match="not an engine flag"):
        build_serve_spec(cluster, ServeOptions(model="a/b", engine_args=["--rm-rf=1"]))
    with pytest.raises(UsageError, match="set by tgi-hpc"):
        build_serve_spec(cluster, ServeOptions(model="a/b", engine_args=["--api-key=abc"]))
    with pytest.raises(UsageError, match="secret"):
        build_serve_spec(cluster, ServeOptions(model="a/b", env=["HF_TOKEN=hf_x"]))


def test_executing_a_script_with_hostile_values_runs_nothing(hostile, tmp_path, model_path):
    """Model directory, --env values and engine flag values full of shell: the job runs them as data."""
    release = standin_release(tmp_path / "release")
    for i, (value, marker) in enumerate(hostile):
        model = tmp_path / f"m{i}" / value.replace("/", "_")
        model.mkdir(parents=True)
        (model / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 1}))
        jobs = tmp_path / f"jobs{i}"
        cluster = open_cluster("local", [f"paths.jobs={jobs}"])
        spec = build_serve_spec(cluster, ServeOptions(model=str(model), env=[f"EVIL={value}"],
                                                      engine_args=[f"--served-model-name={value}"]))
        script = render_job(cluster.profile, spec, job_dir=cluster.job_dir, release_dir=ShellPath("", str(release)))
        _bash_n(script)
        record = tmp_path / f"record{i}.json"
        # Run it for real, with the stand-in engine that records its argv and exits at once.
        env = {**os.environ, "TGI_HPC_JOB_ID": "4242", "STANDIN_RECORD": str(record), "SLURM_TMPDIR": str(tmp_path)}
        cwd = tmp_path / f"cwd{i}"   # the model folder holds the marker's path with "/" replaced: run, it lands here
        cwd.mkdir()
        proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=cwd)
        try:
            deadline = time.monotonic() + 15
            while not (record.exists() and record.stat().st_size) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        assert not marker.exists() and not list(cwd.glob("*pwned*")), f"{value!r} ran as shell"
        argv = json.loads(record.read_text())["argv"]
        assert argv[argv.index("--served-model-name") + 1] == value
        assert argv[argv.index("--model-id") + 1] == str(model)

"""`serve --speculative-model`: the engine's flags checked before anything is rendered, the draft resolved in the
store or as a folder, checked complete before submitting, staged and passed to the engine; a folder full of
shell is data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.releases import standin_release
from test_serve_models import _bash_n, _model, _run_until_recorded
from tgi_hpc.errors import ModelNotFoundError, UsageError
from tgi_hpc.slurm.cluster import open_cluster
from tgi_hpc.slurm.jobspec import ShellPath
from tgi_hpc.slurm.render import render_job
from tgi_hpc.workflows.engine_flags import engine_args
from tgi_hpc.workflows.serve import ServeOptions, build_serve_spec, check_before_submit

SPECULATE = ["--speculate=3"]


def _medusa(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    (folder / "medusa_lm_head.safetensors").write_bytes(b"x")
    return folder


@pytest.mark.parametrize("opts, message", [
    (dict(engine_args=[]), "add --engine-arg --speculate=N"),
    (dict(engine_args=["--speculate=0"]), "add --engine-arg --speculate=N"),
    (dict(engine_args=["--speculate=17"]), "add --engine-arg --speculate=N"),
    (dict(engine_args=[*SPECULATE, "--speculative-layers=4"]), "two drafters"),
    (dict(engine_args=[*SPECULATE, "--lora-adapters=a=/p"]), "LoRA adapters"),
    (dict(engine_args=SPECULATE, other_models=["Qwen/Qwen2.5-0.5B-Instruct"]), "several --model"),
    (dict(engine_args=SPECULATE, speculative_model="org/$(touch /tmp/pwned)"), "invalid model id"),
])
def test_flags_the_engine_would_refuse_are_refused_before_rendering(opts, message, tmp_path):
    cluster = open_cluster("local", [f"paths.jobs={tmp_path / 'jobs'}", f"paths.models={tmp_path / 'store'}"])
    opts = {"speculative_model": "acme/medusa", **opts}
    with pytest.raises(UsageError, match=message):
        build_serve_spec(cluster, ServeOptions(model="meta-llama/Llama-3.1-8B-Instruct", **opts))


def test_the_engine_flag_itself_points_at_the_serve_option():
    with pytest.raises(UsageError, match="use `tgi-hpc serve --speculative-model`"):
        engine_args(["--speculative-model=/x"])


def test_a_stored_draft_is_checked_complete_before_submitting_and_staged(tmp_path, model_path):
    store = tmp_path / "store"
    cluster = open_cluster("local", [f"paths.models={store}", f"paths.jobs={tmp_path / 'jobs'}"])
    release = ShellPath("", str(standin_release(tmp_path / "rel")))
    spec = build_serve_spec(cluster, ServeOptions(model=str(model_path("tiny-llama")), speculative_model="acme/medusa",
                                                  engine_args=SPECULATE))
    with pytest.raises(ModelNotFoundError, match="run `tgi-hpc download --model acme/medusa` first"):
        check_before_submit(cluster, spec, release, True)
    folder = _medusa(store / "acme--medusa" / "main")
    (folder / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match=r"incomplete: no weights \(\*.safetensors"):
        check_before_submit(cluster, spec, release, True)
    (folder / "medusa_lm_head.safetensors").write_bytes(b"x")
    check_before_submit(cluster, spec, release, True)
    slurm = open_cluster("mila", [f"paths.models={store}", f"paths.jobs={tmp_path / 'jobs'}"])
    script = render_job(slurm.profile, build_serve_spec(slurm, ServeOptions(
        model="meta-llama/Llama-3.1-8B-Instruct", speculative_model="acme/medusa", engine_args=SPECULATE,
        gpus=1), offline=True), job_dir="/j")
    _bash_n(script)
    assert 'tgi_hpc.slurm.job stage --src "$DRAFT_DIR"' in script and '--speculative-model "$DRAFT_DIR"' in script


def test_hostile_draft_folders_run_nothing_and_reach_the_engine_whole(hostile, tmp_path):
    release = ShellPath("", str(standin_release(tmp_path / "release")))
    for i, (value, marker) in enumerate(hostile[:5]):
        name = value.replace("/", "_")
        model = _model(tmp_path / f"m{i}" / "model")
        draft = _medusa(tmp_path / f"d{i}" / name)
        cluster = open_cluster("local", [f"paths.jobs={tmp_path / f'jobs{i}'}"])
        spec = build_serve_spec(cluster, ServeOptions(model=str(model), speculative_model=str(draft),
                                                      engine_args=SPECULATE))
        script = render_job(cluster.profile, spec, job_dir=cluster.job_dir, release_dir=release)
        _bash_n(script)
        records = _run_until_recorded(script, tmp_path / f"rec{i}", 1)
        assert not marker.exists(), f"{value!r} ran as shell"
        argv = records[0]["argv"]
        assert argv[argv.index("--speculative-model") + 1] == str(draft)

"""tgi_hpc.batch.submission: reopening a batch, refusing a changed one, and the job script it renders."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tgi_hpc.batch.ledger import Ledger
from tgi_hpc.batch.submission import batch_dir_of, prepare
from tgi_hpc.errors import UsageError
from tgi_hpc.slurm.cluster import open_cluster
from tgi_hpc.slurm.jobspec import BatchSpec, ShellPath
from tgi_hpc.slurm.render import render_job

LOCAL_PROFILE = Path(__file__).resolve().parents[1] / "cluster" / "local-profile.yaml"
IDENTITY = {"model": "org/m", "revision": "main", "engine_args": []}


def write_input(path: Path, ids: list[str]) -> Path:
    path.write_text("".join(json.dumps({"custom_id": i, "url": "/v1/completions", "body": {"prompt": i}}) + "\n"
                            for i in ids))
    return path


def open_batch(tmp_path, src, identity=IDENTITY, restart=False, stopped=None):
    out = tmp_path / "out.jsonl"
    return prepare(batch_dir_of(out), src, out, identity, shard_size=None, jobs_count=2, lease_s=60,
                   restart=restart, on_restart=(lambda p: None) if stopped is None else stopped.append)


def test_the_same_command_reopens_the_batch_and_keeps_its_progress(tmp_path):
    src = write_input(tmp_path / "in.jsonl", [f"r{i}" for i in range(50)])
    ledger = open_batch(tmp_path, src)
    assert ledger.root == tmp_path / "out.jsonl.tgi-batch" and ledger.num_records == 50
    assert ledger.shard_size == 4 and ledger.manifest["output"] == str(tmp_path / "out.jsonl")
    lease = ledger.claim("job-1")
    ledger.commit(lease, [json.dumps({"custom_id": f"r{i}"}) for i in range(4)])
    again = open_batch(tmp_path, src)
    assert again.progress().done == 4 and again.manifest["created"] == ledger.manifest["created"]


def test_a_changed_input_or_model_is_refused_unless_restart(tmp_path):
    src = write_input(tmp_path / "in.jsonl", ["a", "b"])
    first = open_batch(tmp_path, src)
    first.commit(first.claim("h"), ['{"custom_id": "a"}', '{"custom_id": "b"}'])
    write_input(src, ["a", "b", "c"])
    with pytest.raises(UsageError, match=r"input .* changed .*2 requests done.*--restart"):
        open_batch(tmp_path, src)
    write_input(src, ["a", "b"])
    with pytest.raises(UsageError, match="model or engine options changed"):
        open_batch(tmp_path, src, identity={**IDENTITY, "model": "org/other"})
    stopped: list[Path] = []
    fresh = open_batch(tmp_path, src, identity={**IDENTITY, "model": "org/other"}, restart=True, stopped=stopped)
    assert fresh.progress().done == 0 and stopped == [fresh.root]
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("out.jsonl.tgi-batch.old-")]
    assert len(kept) == 1 and Ledger(kept[0]).progress().done == 2      # the old state is kept aside


def test_duplicate_ids_and_empty_or_missing_inputs_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(UsageError, match=r"'x' on lines 1, 3"):
        open_batch(tmp_path, write_input(tmp_path / "dup.jsonl", ["x", "y", "x"]))
    assert not batch_dir_of(tmp_path / "out.jsonl").exists()
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UsageError, match="no requests"):
        open_batch(tmp_path, tmp_path / "empty.jsonl")
    with pytest.raises(UsageError, match="no such file"):
        open_batch(tmp_path, tmp_path / "missing.jsonl")


def test_a_file_mixing_embeddings_with_generation_is_refused_naming_lines_but_chat_with_completions_is_kept(tmp_path):
    def line(url, **body):
        return json.dumps({"custom_id": f"{url}-{len(body)}-{sorted(body)}", "url": url, "body": body}) + "\n"
    src = tmp_path / "mixed.jsonl"
    src.write_text(line("/v1/embeddings", input="a") + "{not json\n" + json.dumps({"messages": []}) + "\n"
                   + line("/v1/nope", x=1) + line("/v1/embeddings", input="b", dimensions=4))
    with pytest.raises(UsageError, match=r"mixes /v1/embeddings lines \(lines 1, 5\) with chat or completion "
                                         r"lines \(lines 3\).*one endpoint per file.*split it"):
        open_batch(tmp_path, src)
    assert not batch_dir_of(tmp_path / "out.jsonl").exists()
    src.write_text(line("/v1/embeddings", input="a") + "{not json\n" + line("/v1/nope", x=1))
    assert open_batch(tmp_path, src).num_records == 3       # bad lines become error lines, as ever
    src.write_text(line("/v1/chat/completions", messages=[]) + line("/v1/completions", prompt="x"))
    assert open_batch(tmp_path, src, restart=True).num_records == 2


def test_a_half_made_batch_folder_is_made_again(tmp_path):
    batch_dir_of(tmp_path / "out.jsonl").mkdir()          # a prepare that died before its manifest
    (batch_dir_of(tmp_path / "out.jsonl") / "input.jsonl").write_text("junk")
    ledger = open_batch(tmp_path, write_input(tmp_path / "in.jsonl", ["a"]))
    assert ledger.num_records == 1


def test_the_batch_script_is_valid_bash_and_runs_no_hostile_path(tmp_path, hostile):
    cluster = open_cluster(str(LOCAL_PROFILE), [f"paths.jobs={tmp_path / 'jobs'}"], strict_paths=False)
    release = tmp_path / "release"
    (release / "bin").mkdir(parents=True)
    seen = tmp_path / "argv"
    (release / "bin" / "python").write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > {shlex.quote(str(seen))}\n')
    (release / "bin" / "python").chmod(0o755)
    for value, marker in hostile:
        spec = BatchSpec(kind="batch", resources=cluster.profile.slurm.defaults["serve"], keep_alive=True,
                         model=value, model_dir=ShellPath("", value), engine_args=("--max-total-tokens", "256"),
                         batch_dir=value)
        script = render_job(cluster.profile, spec, job_dir=str(tmp_path / "jobs"),
                            release_dir=ShellPath("", str(release)))
        assert "#SBATCH --job-name=tgi-hpc-batch" in script and "#SBATCH --requeue" in script
        env = {**os.environ, "TGI_HPC_JOB_ID": "77", "PATH": f"{release / 'bin'}:{os.environ['PATH']}"}
        env.pop("SLURM_JOB_ID", None)
        run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        assert not marker.exists(), value
        argv = seen.read_text().split("\0")
        assert argv[:4] == ["-m", "engine.offline", "--batch-dir", value]
        assert argv[argv.index("--served-model-name") + 1] == value
        assert "--workers" not in argv
    spec = BatchSpec(kind="batch", resources=cluster.profile.slurm.defaults["serve"], model="m",
                     model_dir=ShellPath("", "m"), batch_dir="/b", workers=3, engine_args=("--max-total-tokens", "256"))
    script = render_job(cluster.profile, spec, job_dir=str(tmp_path / "jobs"), release_dir=ShellPath("", str(release)))
    assert "--served-model-name m --workers 3 --max-total-tokens 256 &" in script


def test_the_identity_keeps_what_changes_answers_and_drops_what_only_sizes_the_batch():
    from tgi_hpc.batch.submission import identity_of

    args = ("--max-total-tokens", "512", "--max-concurrent-requests", "8", "--kv-cache-bytes=1GiB",
            "--quantize", "fp8", "--cpu-threads", "4", "--speculate", "2")
    assert identity_of("org/m", "main", args) == {
        "model": "org/m", "revision": "main",
        "engine_args": ["--max-total-tokens", "512", "--quantize", "fp8", "--speculate", "2"]}
    assert identity_of("org/m", "main", ("--max-concurrent-requests", "2")) == identity_of("org/m", "main", ())

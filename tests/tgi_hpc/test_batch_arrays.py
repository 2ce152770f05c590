"""A batch as a Slurm job array: the rendered array script and the holder name of each task, an array's jobs
seen as active while any task is, `tgi-hpc logs BATCH` (every task's log, in task order), and the
`--wait` progress view (a rich bar on a terminal, plain lines elsewhere)."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tgi_hpc.batch.ledger import Progress
from tgi_hpc.batch.logs import followed, logs
from tgi_hpc.batch.submission import _active
from tgi_hpc.cli._app import App
from tgi_hpc.cli.batch import ProgressView
from tgi_hpc.errors import SlurmError, UsageError
from tgi_hpc.slurm.cluster import open_cluster
from tgi_hpc.slurm.commands import SlurmJob
from tgi_hpc.slurm.jobspec import BatchSpec, ShellPath
from tgi_hpc.slurm.render import render_job

LOCAL_PROFILE = Path(__file__).resolve().parents[1] / "cluster" / "local-profile.yaml"


def local(tmp_path):
    return open_cluster(str(LOCAL_PROFILE), [f"paths.jobs={tmp_path / 'jobs'}"], strict_paths=False)


def holder_of(tmp_path, array_size: int, env: dict[str, str]) -> tuple[str, list[str]]:
    """Render the batch script, run it with a stand-in python; (the script, the argv python got)."""
    cluster = local(tmp_path)
    release, seen = tmp_path / "release", tmp_path / "argv"
    (release / "bin").mkdir(parents=True, exist_ok=True)
    (release / "bin" / "python").write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > "{seen}"\n')
    (release / "bin" / "python").chmod(0o755)
    spec = BatchSpec(kind="batch", resources=cluster.profile.slurm.defaults["serve"], keep_alive=True, model="m",
                     model_dir=ShellPath("", "/models/m"), batch_dir="/b", array_size=array_size)
    script = render_job(cluster.profile, spec, job_dir=str(tmp_path / "jobs"), release_dir=ShellPath("", str(release)))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    run = subprocess.run(["bash", "-c", script], env={**clean, "PATH": f"{release / 'bin'}:{clean['PATH']}", **env},
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    argv = seen.read_text().split("\0")
    return script, argv


def test_an_array_task_holds_shards_under_its_array_task_id_and_logs_to_its_own_file(tmp_path):
    script, argv = holder_of(tmp_path, 3, {"SLURM_JOB_ID": "903", "SLURM_ARRAY_JOB_ID": "900",
                                           "SLURM_ARRAY_TASK_ID": "2"})
    assert "#SBATCH --array=0-2\n" in script
    assert f"#SBATCH --output={tmp_path / 'jobs'}/%A_%a.out\n" in script
    assert re.fullmatch(r"900_2@.+", argv[argv.index("--holder") + 1])
    plain, argv = holder_of(tmp_path, 0, {"TGI_HPC_JOB_ID": "77"})     # no Slurm: N plain jobs
    assert "--array" not in plain and "%j.out" in plain
    assert re.fullmatch(r"77@.+", argv[argv.index("--holder") + 1])


def test_a_one_task_array_is_still_an_array(tmp_path):
    cluster = local(tmp_path)
    spec = BatchSpec(kind="batch", resources=cluster.profile.slurm.defaults["serve"], model="m",
                     model_dir=ShellPath("", "/m"), batch_dir="/b", array_size=1)
    assert "#SBATCH --array=0-0\n" in render_job(cluster.profile, spec, job_dir="/j")


class Backend:
    """squeue/sacct's answers for an array and a plain job (the process boundary, faked)."""

    def __init__(self, states: dict[str, str]):
        self.table = {k: SlurmJob(k, "tgi-hpc-batch", v) for k, v in states.items()}
        self.asked: list[list[str]] = []

    def states(self, job_ids):
        self.asked.append(list(job_ids))
        return {k: v for k, v in self.table.items() if k.split("_")[0] in job_ids}


class FakeCluster:
    def __init__(self, states):
        self.backend = Backend(states)


@pytest.mark.parametrize("states, active", [
    ({"12_0": "COMPLETED", "12_[1-3]": "PENDING"}, ["12"]),             # pending tasks: one folded line
    ({"12_0": "CANCELLED", "12_1": "RUNNING"}, ["12"]),
    ({"12_0": "CANCELLED", "12_1": "FAILED", "120_0": "RUNNING"}, []),  # another array with a longer id
    ({"12_0": "COMPLETED", "12_1": "COMPLETED", "13": "RUNNING"}, ["13"]),
    ({}, []),                                                           # forgotten by Slurm
])
def test_a_job_array_is_active_while_any_of_its_tasks_is(states, active):
    cluster = FakeCluster(states)
    assert _active(cluster, ["12", "13"]) == active
    assert cluster.backend.asked == [["12", "13"]]


def write_logs(jobs: Path, names: dict[str, str]) -> None:
    jobs.mkdir(parents=True, exist_ok=True)
    for name, text in names.items():
        (jobs / name).write_text(text)


def test_logs_of_an_array_are_every_task_in_task_order_and_nothing_of_a_look_alike(tmp_path):
    cluster = local(tmp_path)
    write_logs(tmp_path / "jobs", {"12_0.out": "zero\n", "12_10.out": "ten\n", "12_2.out": "two\n",
                                   "120_1.out": "other array\n", "12_x.out": "not a task\n", "12.sbatch": "#!"})
    assert list(logs(cluster, "12").items()) == [("12_0", "zero\n"), ("12_2", "two\n"), ("12_10", "ten\n")]
    assert logs(cluster, "12_2") == {"12_2": "two\n"}
    write_logs(tmp_path / "jobs", {"7.out": "plain job\n"})
    assert logs(cluster, "7") == {"7": "plain job\n"}
    with pytest.raises(SlurmError, match="no log for 8"):
        logs(cluster, "8")
    assert followed(cluster, "12_2") == "12_2" and followed(cluster, "7") == "7" and followed(cluster, "8") == "8"
    with pytest.raises(UsageError, match=r"12 has 3 logs \(12_0, 12_2, 12_10\): follow one task, e.g. .*12_0 -f"):
        followed(cluster, "12")


def test_logs_of_a_batch_are_those_of_every_job_it_submitted(tmp_path, hostile):
    cluster = local(tmp_path)
    out = tmp_path / "out.jsonl"
    batch_dir = tmp_path / "out.jsonl.tgi-batch"
    batch_dir.mkdir()
    (batch_dir / "manifest.json").write_text("{}")
    with pytest.raises(SlurmError, match="submitted no job"):
        logs(cluster, str(out))
    (batch_dir / "jobs.json").write_text(json.dumps(["12", "13"]))
    write_logs(tmp_path / "jobs", {"12_0.out": "a0\n", "12_1.out": "a1\n", "13_0.out": "b0\n"})
    expected = {"12_0": "a0\n", "12_1": "a1\n", "13_0": "b0\n"}
    assert logs(cluster, str(out)) == expected == logs(cluster, str(batch_dir))
    for value, marker in hostile:
        with pytest.raises(UsageError, match="neither a job id"):
            logs(cluster, value)
        assert not marker.exists()


def progress(done: int, tokens: int = 0) -> Progress:
    return Progress(total=10, done=done, failed=0, shards=5, shards_done=done // 2, tokens=tokens, elapsed_s=20.0)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_wait_off_a_terminal_prints_a_plain_line_per_change(capsys):
    with ProgressView(App(), stream=io.StringIO()) as view:
        for p in (progress(0), progress(0), progress(4, 400), progress(4, 400), progress(10, 900)):
            view(p)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["batch: 0/10 done, 0 failed", "batch: 4/10 done, 0 failed, 20 tok/s, ETA 30s",
                     "batch: 10/10 done, 0 failed, 45 tok/s (complete)"]


def test_wait_on_a_terminal_draws_a_bar_with_done_total_rate_and_eta(capsys):
    tty = Tty()
    with ProgressView(App(), stream=tty) as view:
        view(progress(4, 400))
    drawn = tty.getvalue()
    assert "4/10 done, 0 failed, 20 tok/s, ETA 30s" in drawn and "━" in drawn
    assert capsys.readouterr().err == ""                   # no plain lines beside the bar
    quiet = Tty()
    with ProgressView(App(verbosity=-1), stream=quiet) as view:   # -q: no bar, and no lines either
        view(progress(4, 400))
    assert quiet.getvalue() == "" and capsys.readouterr().err == ""


def test_status_of_an_array_id_is_a_row_per_task_in_task_order_with_the_batch_progress(tmp_path, monkeypatch):
    from tgi_hpc.batch.ledger import Ledger
    from tgi_hpc.batch.status import add_progress
    from tgi_hpc.slurm import jobs

    cluster = local(tmp_path)
    monkeypatch.setattr(cluster, "backend", Backend({"12_0": "COMPLETED", "12_10": "RUNNING", "12_1": "RUNNING",
                                                     "12_[11-13]": "PENDING", "120_0": "RUNNING", "13": "RUNNING"}))
    Ledger.create(tmp_path / "b", {"num_records": 10, "shard_size": 5})
    ledger = Ledger(tmp_path / "b")
    ledger.commit(ledger.claim("12_0@n"), ["{}"] * 5, failed=1, tokens=40)
    write_logs(tmp_path / "jobs", {"12.sbatch": f"#!/bin/bash\n# Model: m\n# Batch: {tmp_path / 'b'}\n"})
    rows = jobs.status(cluster, ["12", "13", "99"], with_probe=False)
    add_progress(cluster, rows)
    assert [(r.job_id, r.state) for r in rows] == [
        ("12_0", "COMPLETED"), ("12_1", "RUNNING"), ("12_10", "RUNNING"), ("12_[11-13]", "PENDING"),
        ("13", "RUNNING"), ("99", "UNKNOWN")]                      # 120_0 is another array
    assert all(re.fullmatch(r"batch 5/10 done, 1 failed, \d+ tok/s, ETA \d+[sm]", r.detail) for r in rows[:4]), rows
    assert all(r.model == "m" and r.kind == "batch" for r in rows[:4])
    assert rows[0].to_dict()["batch"]["done"] == 5 and rows[4].to_dict()["batch"] == {}   # --json


def test_status_of_a_batch_output_asks_for_every_job_it_submitted(tmp_path, monkeypatch, run, hostile):
    from tgi_hpc.slurm import jobs

    asked = []
    monkeypatch.setattr(jobs, "status", lambda cluster, ids, with_probe: asked.append(ids) or [])
    batch_dir = tmp_path / "out.jsonl.tgi-batch"
    batch_dir.mkdir()
    (batch_dir / "manifest.json").write_text("{}")
    (batch_dir / "jobs.json").write_text(json.dumps(["12", "15"]))
    common = ["--cluster", str(LOCAL_PROFILE), "--set", f"paths.jobs={tmp_path / 'jobs'}", "--no-probe"]
    assert run("status", str(tmp_path / "out.jsonl"), "12_1", *common)[0] == 0
    assert asked == [["12", "15", "12_1"]]
    for value, marker in hostile:
        code, _, err = run("status", str(tmp_path / value.lstrip("/")) + ".jsonl", *common)
        assert code == 2 and "neither a job id" in err and not marker.exists()

"""What a newcomer tripped over: truthful states and stop results, the failure cause on FAILED, a heartbeat
while waiting, status with model/age/active-first, and the checks `serve` makes before submitting.
Fake Slurm backends (unit tests); the real Slurm runs these paths in tests/cluster."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from tgi_hpc.cli import main
from tgi_hpc.errors import JobFailedError, ModelNotFoundError, ReleaseError
from tgi_hpc.profiles.loader import load_profile
from tgi_hpc.remote.runner import LocalRunner
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.commands import SlurmJob
from tgi_hpc.slurm.endpoint import Endpoint
from tgi_hpc.workflows.checks import check_release, check_snapshot, find_shared_weights, snapshot_problems


@dataclass
class FakeBackend:
    """Slurm as a list of jobs; `script` states can change per call to `states`."""

    jobs: dict[str, SlurmJob]
    script: list[dict[str, SlurmJob]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def states(self, job_ids):
        if self.script:
            self.jobs.update(self.script.pop(0))
        return {j: self.jobs[j] for j in job_ids if j in self.jobs}

    def mine(self):
        return list(self.jobs.values())

    def cancel(self, job_ids):
        self.cancelled += job_ids


def _cluster(tmp_path: Path, backend: FakeBackend) -> Cluster:
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir(exist_ok=True)
    profile = load_profile("mila", env={"TGI_HPC_CONFIG_DIR": str(tmp_path / "cfg")})
    return Cluster(profile, LocalRunner(), backend, str(jobs_dir))


def _job(job_id, state, reason="", node="", name="tgi-hpc-serve", elapsed="0:05"):
    return SlurmJob(job_id, name, state, reason, node, elapsed)


def test_stop_reports_ended_jobs_as_ended_and_stops_only_the_live_ones(tmp_path):
    backend = FakeBackend({"1": _job("1", "COMPLETED"), "2": _job("2", "RUNNING", node="cn-a"),
                           "3": _job("3", "PENDING", "Priority")})
    cluster = _cluster(tmp_path, backend)
    result = jobs.stop(cluster, ["1", "2"])
    assert (result.stopped, result.ended, backend.cancelled) == (["2"], {"1": "COMPLETED"}, ["2"])
    backend.cancelled.clear()
    result = jobs.stop(cluster, None)                      # --all: 21 finished jobs are not "stopped"
    assert sorted(result.stopped) == ["2", "3"] and result.ended == {} and "1" not in backend.cancelled


def test_states_are_truthful(tmp_path):
    backend = FakeBackend({"5": _job("5", "COMPLETING", node="cn-a"), "6": _job("6", "CANCELLED", "Priority"),
                           "7": _job("7", "RUNNING", node="cn-b")})
    cluster = _cluster(tmp_path, backend)
    Path(cluster.job_dir, "7.endpoint.json").write_text(
        Endpoint("7", "cn-b", "cn-b", 10007, "", model="org/model").to_json())
    rows = {st.job_id: st for st in jobs.status(cluster, ["5", "6", "7"], with_probe=False)}
    assert rows["5"].state == "ENDING"                     # CG is not STARTING
    assert (rows["6"].state, rows["6"].reason) == ("CANCELLED", "")   # no stale pending reason
    assert rows["7"].state == "LISTENING" and rows["7"].model == "org/model"   # --no-probe: not "STARTING"


def test_status_lists_active_jobs_first_newest_first_with_model_and_age(tmp_path):
    backend = FakeBackend({"9": _job("9", "COMPLETED", elapsed="1:00:00"), "10": _job("10", "PENDING", "Resources"),
                           "12": _job("12", "PENDING", "Priority"), "11": _job("11", "FAILED")})
    cluster = _cluster(tmp_path, backend)
    Path(cluster.job_dir, "12.sbatch").write_text("#!/bin/bash\n# tgi-hpc serve job\n# Model: org/the-model\n")
    rows = jobs.status(cluster, None, with_probe=False)
    assert [st.job_id for st in rows] == ["12", "10", "11", "9"]
    assert rows[0].model == "org/the-model" and rows[-1].elapsed == "1:00:00"


def test_a_failed_job_shows_the_end_of_its_log(tmp_path):
    backend = FakeBackend({"4": _job("4", "RUNNING", node="cn-a")}, script=[{}, {"4": _job("4", "FAILED")}])
    cluster = _cluster(tmp_path, backend)
    Path(cluster.job_dir, "4.out").write_text("[tgi-hpc] job 4 on cn-a\nloading...\n\n"
                                              "OSError: no file named tokenizer.json in /tmp/x\n")
    with pytest.raises(JobFailedError) as err:
        jobs.wait(cluster, "4", until={"READY"}, timeout=30)
    assert "ended FAILED" in str(err.value) and "no file named tokenizer.json" in str(err.value)


def test_waiting_beats_with_the_time_and_the_last_log_line(tmp_path, monkeypatch):
    running = _job("8", "RUNNING", node="cn-a")
    backend = FakeBackend({"8": running}, script=[{}, {}, {}, {"8": _job("8", "COMPLETED")}])
    cluster = _cluster(tmp_path, backend)
    Path(cluster.job_dir, "8.out").write_text("Loading checkpoint shards: 40%\n")
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    beats = []
    jobs.wait(cluster, "8", until={"COMPLETED"}, timeout=30, beat_every=0.0,
              on_beat=jobs.heartbeat(beats.append))
    assert beats and all("still STARTING after 0m0" in b for b in beats)     # never a beat for the end state
    assert "Loading checkpoint shards: 40%" in beats[0]


@pytest.mark.parametrize("value, longest", [("1", 1.0), ("0.5", 0.5), (None, 5.0), ("", 5.0), ("soon", 5.0),
                                            ("0", 5.0), ("-3", 5.0), ("nan", 5.0), ("inf", 5.0), ("1e9", 5.0)])
def test_wait_backs_off_to_at_most_the_max_poll(tmp_path, monkeypatch, value, longest):
    """TGI_HPC_MAX_POLL_S (the suite sets 1 s) caps the backoff; a value that is not 0.1-60 s leaves the 5 s."""
    if value is None:
        monkeypatch.delenv(jobs.MAX_POLL_ENV, raising=False)
    else:
        monkeypatch.setenv(jobs.MAX_POLL_ENV, value)
    backend = FakeBackend({"8": _job("8", "RUNNING", node="cn-a")},
                          script=[{}] * 12 + [{"8": _job("8", "COMPLETED")}])
    slept = []
    clock = SimpleNamespace(monotonic=time.monotonic, time=time.time, sleep=slept.append)
    monkeypatch.setattr(jobs, "time", clock)
    jobs.wait(_cluster(tmp_path, backend), "8", until={"COMPLETED"}, timeout=30)
    assert len(slept) == 12 and slept[0] == 0.25 and max(slept) == slept[-1] == longest
    assert slept == sorted(slept)


def _snapshot(folder: Path, *, tokenizer=True, shards=("a.safetensors", "b.safetensors"), index=True) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    for shard in shards:
        (folder / shard).write_bytes(b"x")
    if index:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"w1": "a.safetensors", "w2": "b.safetensors"}}))
    return folder


def test_snapshot_checks_name_what_is_missing(tmp_path):
    cluster = _cluster(tmp_path, FakeBackend({}))
    assert snapshot_problems(cluster, str(_snapshot(tmp_path / "ok"))) == []
    problems = snapshot_problems(cluster, str(_snapshot(tmp_path / "half", tokenizer=False, shards=("a.safetensors",))))
    assert any("tokenizer" in p for p in problems) and any("1 of 2 shards" in p for p in problems)
    with pytest.raises(ModelNotFoundError, match="not in the model store"):
        check_snapshot(cluster, str(tmp_path / "absent"), "org/x", in_store=True)
    with pytest.raises(ModelNotFoundError, match="incomplete: no tokenizer.*download --model org/x"):
        check_snapshot(cluster, str(_snapshot(tmp_path / "n", tokenizer=False)), "org/x", in_store=True)


def test_a_missing_release_is_refused_before_submitting(tmp_path):
    cluster = _cluster(tmp_path, FakeBackend({}))
    with pytest.raises(ReleaseError, match="tgi-hpc compile"):
        check_release(cluster, str(tmp_path / "releases" / "current"), explicit=False)
    (tmp_path / "rel" / "bin").mkdir(parents=True)
    (tmp_path / "rel" / "bin" / "python").symlink_to("/bin/sh")
    check_release(cluster, str(tmp_path / "rel"), explicit=True)


def test_shared_weights_are_found_by_name_and_only_when_complete(tmp_path):
    cluster = _cluster(tmp_path, FakeBackend({}))
    root = tmp_path / "weights"
    _snapshot(root / "llama.var" / "llama_3.1" / "Meta-Llama-3.1-8B-Instruct", index=False, shards=("m.safetensors",))
    (root / "restricted" / "Broken-7B").mkdir(parents=True)
    assert find_shared_weights(cluster, "meta-llama/meta-llama-3.1-8b-instruct", [str(root)]).endswith(
        "llama_3.1/Meta-Llama-3.1-8B-Instruct")
    assert find_shared_weights(cluster, "org/Broken-7B", [str(root)]) is None
    assert find_shared_weights(cluster, "org/absent", [str(root), str(tmp_path / "nowhere")]) is None


def test_serve_uses_a_shared_copy_before_the_store_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TGI_HPC_CONFIG_DIR", str(tmp_path / "cfg"))
    root = tmp_path / "weights"
    snap = _snapshot(root / "Qwen2.5-0.5B-Instruct", index=False, shards=("model.safetensors",))
    argv = ["serve", "--cluster", "mila", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--dry-run",
            "--set", f"paths.shared_weights=[{root}]"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert f"MODEL_DIR={snap}" in out and "read-only copy" in err
    assert main([*argv, "--no-shared-weights"]) == 0
    assert "MODEL_DIR=\"${SCRATCH}\"/tgi-hpc/models/" in capsys.readouterr().out


def test_exit_codes_and_the_default_tunnel_verb_are_in_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Exit codes:" in out and "7   still not ready" in out and "11  SSH" in out
    assert main(["tunnel", "--help"]) == 0
    out = capsys.readouterr().out
    assert "[open]" in out and "(default)" in out and "tgi-hpc tunnel 4148" in out

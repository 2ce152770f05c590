"""The service core: state file, lead time, replica choice (tgi_hpc/service/)."""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from tgi_hpc.errors import UsageError
from tgi_hpc.service.balance import Balancer, Target
from tgi_hpc.service.lead import check_lead, lead_time, plan
from tgi_hpc.service.state import (Replica, ServiceState, check_name, default_name, is_stopped, locked,
                                   read_state, state_path, stopped_path)


def _state(tmp_path, **kw) -> str:
    path = state_path(str(tmp_path), "svc")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as fh:
        fh.write(ServiceState("svc", **kw).to_json())
    return path


# --- names -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "a/b", "a b", "-x", "x;rm -rf ~", "é", "a" * 65, "a\nb"])
def test_hostile_service_names_are_refused(bad):
    with pytest.raises(UsageError, match="service name"):
        check_name(bad)


@pytest.mark.parametrize("model, name", [("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
                                         ("/scratch/me/models/My Model!/", "my-model"), ("/", "model"),
                                         ("ORG/" + "x" * 80, "x" * 64)])
def test_default_name_from_the_model_is_valid(model, name):
    assert default_name(model) == name and check_name(default_name(model))


# --- state file ------------------------------------------------------------------------------------

def test_unknown_service_says_how_to_start_one(tmp_path):
    with pytest.raises(UsageError, match="no service 'nope'.*tgi-hpc serve --service"):
        read_state(state_path(str(tmp_path), "nope"), "nope")


def test_state_round_trips_and_ignores_unknown_keys(tmp_path):
    path = _state(tmp_path, replicas=2, handover=True, jobs=[Replica("7", slot=1, state="ready", url="http://n:1")])
    data = json.loads(open(path).read())
    data["from_a_newer_version"] = 1
    data["jobs"][0]["also_new"] = 2
    open(path, "w").write(json.dumps(data))
    st = read_state(path)
    assert st.replicas == 2 and st.job("7").slot == 1 and [j.job_id for j in st.serving()] == ["7"]


def test_locked_update_is_atomic_and_private(tmp_path):
    path = _state(tmp_path)
    with locked(path) as st:
        st.jobs.append(Replica("1"))
    assert read_state(path).job("1").state == "submitted"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    with pytest.raises(RuntimeError):  # a failure inside leaves the old file untouched
        with locked(path) as st:
            st.jobs.append(Replica("2"))
            raise RuntimeError("boom")
    assert read_state(path).job("2") is None
    assert sorted(os.listdir(os.path.dirname(path))) == ["svc.json"]   # the lock is gone once released


def _add_jobs(path: str, start: int) -> None:
    for i in range(start, start + 25):
        with locked(path) as st:
            st.jobs.append(Replica(str(i)))


def test_concurrent_writers_lose_nothing(tmp_path):
    path = _state(tmp_path)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_add_jobs, args=(path, k * 100)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert len(read_state(path).jobs) == 100


def test_observations_keep_the_newest_and_refuse_negative_ones(tmp_path):
    st = ServiceState("s")
    for value in (1, 2, 3, 4, 5, 6, -1):
        st.observe(queue_wait_s=value, load_s=value * 10)
    assert st.queue_waits == [2, 3, 4, 5, 6] and st.load_times == [20, 30, 40, 50, 60]


def test_history_is_pruned_but_live_jobs_are_kept(tmp_path):
    st = ServiceState("s", jobs=[Replica(str(i), state="ended") for i in range(50)] + [Replica("live", state="ready")])
    st.prune(keep_ended=5)
    assert [j.job_id for j in st.jobs] == ["45", "46", "47", "48", "49", "live"]


def test_stopped_marker(tmp_path):
    path = _state(tmp_path)
    assert not is_stopped(path)
    open(stopped_path(path), "w").close()
    assert is_stopped(path)


# --- lead time -------------------------------------------------------------------------------------

def test_lead_is_queue_wait_plus_load_with_a_floor():
    assert lead_time([], [], floor_s=300) == 300
    assert lead_time([100], [50], floor_s=60) == 150
    assert lead_time([100, 10, 20, 30], [50, 5, 5, 5], floor_s=10) == 35  # the worst of the last three
    assert lead_time([100], [50], floor_s=60, explicit_s=900) == 900


def test_lead_longer_than_the_time_limit_is_refused():
    with pytest.raises(UsageError, match="not shorter than the job's time limit"):
        check_lead(3600, 3600)
    with pytest.raises(UsageError, match="positive"):
        check_lead(0, 3600)
    check_lead(600, 3600)


def test_plan_starts_the_successor_at_once_when_the_lead_exceeds_what_is_left():
    p = plan(ends_at=1000, now=900, lead_s=300)
    assert p.late and p.delay_s == 0
    p = plan(ends_at=1000, now=100, lead_s=300)
    assert not p.late and p.delay_s == 600


# --- balancing -------------------------------------------------------------------------------------

A, B, C = Target("1", "n1", 10001), Target("2", "n2", 10002), Target("3", "n3", 10003)


def test_least_outstanding_connections_wins():
    bal = Balancer()
    bal.update([A, B])
    first, second = bal.acquire(), bal.acquire()
    assert {first, second} == {A, B}           # spread, not piled on one
    bal.release(first)
    assert bal.acquire() == first              # the one with fewer outstanding
    assert bal.outstanding(second) == 1


def test_failed_replica_is_skipped_until_its_time_is_up():
    clock = [0.0]
    bal = Balancer(down_for=10, clock=lambda: clock[0])
    bal.update([A, B])
    bal.failed(A)
    assert [bal.acquire() for _ in range(3)] == [B, B, B]
    clock[0] = 11
    assert bal.acquire() == A


def test_exclude_and_no_replica_left():
    bal = Balancer()
    assert bal.acquire() is None
    bal.update([A])
    assert bal.acquire(exclude={A}) is None
    bal.update([])                               # every replica gone
    assert bal.acquire() is None


def test_a_successor_takes_new_connections_at_once():
    bal = Balancer()
    bal.update([A])
    held = bal.acquire()
    bal.update([C])                              # A draining, C (its successor) ready
    assert bal.acquire() == C
    bal.release(held)                            # A's connection ends later: no error
    assert bal.outstanding(A) == 0


def test_target_from_url():
    assert Target.from_url("5", "http://cn-g001:10005") == Target("5", "cn-g001", 10005)
    assert Target.from_url("5", "http://[::1]:8080/").host == "::1"


# --- in-job handover helpers (tgi_hpc/slurm/handover.py) ------------------------------------------

def test_successor_waits_with_begin_or_dependency():
    from tgi_hpc.slurm.handover import submission_flags

    me = Replica("41", started_at=1000.0)
    assert submission_flags("begin", 600, me, now=1100) == ["--begin=now+600"]
    assert submission_flags("dependency", 600, me, now=1100) == ["--dependency=after:41+11"]   # 11.7 min: rounded down
    assert submission_flags("at_lead", 600, me, now=1100) == []
    assert submission_flags("begin", 0, me, now=1100) == []      # late: at once


def test_successor_does_not_inherit_the_jobs_slurm_environment(monkeypatch):
    from tgi_hpc.slurm.handover import GENERATION_ENV, SLOT_ENV, _sbatch_env

    for key, value in {"SLURM_JOB_ID": "41", "SLURM_MEM_PER_NODE": "8G", "SBATCH_HOLD": "1",
                       "SLURM_CONF": "/etc/slurm.conf", "HF_HOME": "/scratch/hf"}.items():
        monkeypatch.setenv(key, value)
    env = _sbatch_env(slot=1, generation=3)
    assert "SLURM_JOB_ID" not in env and "SLURM_MEM_PER_NODE" not in env and "SBATCH_HOLD" not in env
    assert env["SLURM_CONF"] == "/etc/slurm.conf" and env["HF_HOME"] == "/scratch/hf"
    assert (env[SLOT_ENV], env[GENERATION_ENV]) == ("1", "3")


def test_slurm_times_that_are_unknown_are_zero():
    from tgi_hpc.slurm.handover import _unix

    assert _unix("Unknown") == 0.0 and _unix("None") == 0.0 and _unix("") == 0.0
    assert _unix("2026-11-24T05:00:00") > 0


class _FakeSlurm:
    """The process boundary of the in-job helper: records argv, answers sbatch with a job id."""

    def __init__(self):
        self.calls = []

    def __call__(self, argv, **kwargs):
        import subprocess

        self.calls.append(argv)
        out = "77\n" if argv[0] == "sbatch" else ""
        return subprocess.CompletedProcess(argv, 0, out, "")


@pytest.fixture
def in_job(tmp_path, monkeypatch):
    from tgi_hpc.slurm import handover

    fake = _FakeSlurm()
    monkeypatch.setattr(handover, "_run", fake)
    script = tmp_path / "svc.sbatch"
    script.write_text("#!/bin/bash\n")
    path = _state(tmp_path, handover=True, script=str(script),
                  jobs=[Replica("41", state="ready", started_at=1.0, ready_at=1.5, ends_at=2.0)])
    return handover, fake, path


def test_sigterm_lets_a_pending_successor_start_at_once(in_job):
    handover, fake, path = in_job
    with locked(path) as st:
        st.job("41").successor = "42"
        st.jobs.append(Replica("42", generation=1, predecessor="41"))
    handover.on_term(path, "41")
    assert fake.calls == [["scontrol", "update", "JobId=42", "StartTime=now"]]
    assert read_state(path).job("41").state == "draining"


def test_sigterm_without_a_successor_submits_one_now(in_job):
    handover, fake, path = in_job
    handover.on_term(path, "41")
    assert fake.calls[0][:2] == ["sbatch", "--parsable"] and not any(a.startswith("--begin") for a in fake.calls[0])
    succ = read_state(path).job("77")
    assert (succ.generation, succ.predecessor, read_state(path).job("41").successor) == (1, "41", "77")


def test_sigterm_of_a_stopped_service_submits_nothing(in_job):
    handover, fake, path = in_job
    open(stopped_path(path), "w").close()
    handover.on_term(path, "41")
    assert fake.calls == []


def test_sigterm_of_an_unknown_job_or_service_does_nothing(in_job, tmp_path):
    handover, fake, path = in_job
    handover.on_term(path, "999")
    assert fake.calls == []
    with pytest.raises(UsageError, match="no service"):
        handover.on_term(str(tmp_path / "services" / "nope.json"), "41")


def test_an_engine_crash_lets_the_successor_start_at_once(in_job):
    handover, fake, path = in_job
    with locked(path) as st:
        st.job("41").successor = "42"
        st.jobs.append(Replica("42", generation=1, predecessor="41"))
    handover.on_exit(path, "41")   # the job script ends while the job was still READY
    assert fake.calls == [["scontrol", "update", "JobId=42", "StartTime=now"]]
    assert read_state(path).job("41").state == "ended"


def test_exit_after_a_handover_releases_nothing(in_job):
    handover, fake, path = in_job
    handover.set_state(path, "41", "draining")
    handover.on_exit(path, "41")
    assert fake.calls == [] and read_state(path).job("41").state == "ended"


def test_a_job_that_never_became_ready_submits_no_successor(in_job):
    handover, fake, path = in_job
    handover.set_state(path, "41", "starting")
    handover.on_exit(path, "41")   # e.g. the model does not load: no chain of failing jobs
    assert fake.calls == []


def test_sigterm_while_loading_submits_no_new_job(in_job):
    handover, fake, path = in_job
    with locked(path) as st:
        st.job("41").state, st.job("41").ready_at = "starting", 0.0
    handover.on_term(path, "41")   # e.g. the time limit is shorter than the load: no endless chain
    assert fake.calls == []


def test_a_squeue_hiccup_is_no_verdict_on_the_successor(in_job, monkeypatch):
    import subprocess

    handover, _, path = in_job
    with locked(path) as st:
        st.jobs.append(Replica("42", generation=1))
    answers = {1: subprocess.CompletedProcess([], 1, "", "slurm_load_jobs error: Socket timed out"),
               0: subprocess.CompletedProcess([], 0, "FAILED\n", "")}
    for code, verdict in ((1, "submitted"), (0, "failed")):
        monkeypatch.setattr(handover, "_run", lambda argv, answer=answers[code], **kw: answer)
        assert handover._successor_state(path, "42") == verdict

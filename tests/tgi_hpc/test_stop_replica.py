"""`stop JOB` on a job of a service: refused (its successor would start), `--replica` replaces just it."""
from __future__ import annotations

import os

import pytest

from tgi_hpc.cli import main
from tgi_hpc.service.state import Replica, ServiceState, state_path
from tgi_hpc.slurm.backend import LocalBackend
from tgi_hpc.remote.runner import LocalRunner


@pytest.fixture
def cluster_dir(tmp_path):
    jobs = tmp_path / "jobs dir; $(x)"
    backend = LocalBackend(LocalRunner(), str(jobs))
    started: list[str] = []

    def sleeper() -> str:
        job_id = backend.submit("#!/bin/bash\nsleep 60\n", "tgi-hpc-serve")
        started.append(job_id)
        return job_id

    yield jobs, backend, sleeper
    backend.cancel(started)


def _service(jobs, name: str, job_ids: list[str], *, handover: bool, state: str = "ready") -> None:
    path = state_path(str(jobs), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    replicas = [Replica(job_id=j, slot=i, state=state, url="http://n:1") for i, j in enumerate(job_ids)]
    with open(path, "w") as f:
        f.write(ServiceState(name=name, model="a/b", handover=handover, jobs=replicas).to_json())


@pytest.fixture
def run(capsys, cluster_dir):
    def invoke(*args: str) -> tuple[int, str, str]:
        code = main(["stop", "--cluster", "local", "--set", f"paths.jobs={cluster_dir[0]}", *args])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def test_stopping_a_job_of_a_service_is_refused_and_names_both_ways(run, cluster_dir):
    jobs, backend, sleeper = cluster_dir
    other, member = sleeper(), sleeper()
    _service(jobs, "llama", [member], handover=True)
    code, out, err = run(other, member)
    assert code == 2 and out == ""
    assert f"job {member} is replica 0 of service 'llama'" in err
    assert "`tgi-hpc stop llama`" in err and f"`tgi-hpc stop {member} --replica`" in err
    assert not backend.states([member, other])[member].is_final     # nothing was cancelled, not even `other`
    assert not backend.states([other])[other].is_final


def test_replica_cancels_just_that_job(run, cluster_dir):
    jobs, backend, sleeper = cluster_dir
    member, sibling = sleeper(), sleeper()
    _service(jobs, "llama", [member, sibling], handover=True)
    code, out, err = run(member, "--replica")
    assert code == 0 and out.strip() == f"stopped {member} (replaced by its service)", err
    assert not backend.states([sibling])[sibling].is_final
    assert not os.path.exists(state_path(str(jobs), "llama")[: -len(".json")] + ".stopped")   # the service goes on


def test_replica_is_refused_where_nothing_would_replace_the_job(run, cluster_dir):
    jobs, backend, sleeper = cluster_dir
    member, loner = sleeper(), sleeper()
    _service(jobs, "fixed", [member], handover=False)
    code, _, err = run(member, "--replica")
    assert code == 2 and "service 'fixed' has no handover" in err and "`tgi-hpc stop fixed`" in err
    code, _, err = run(loner, "--replica")
    assert code == 2 and f"job {loner} is not a live job of any service" in err
    code, _, err = run("fixed", "--replica")
    assert code == 2 and "--replica takes job ids" in err
    code, _, err = run("--all", "--replica")
    assert code == 2 and "does not go with --all" in err
    assert not any(j.is_final for j in backend.states([member, loner]).values())


def test_an_ended_replica_is_no_longer_a_member(run, cluster_dir):
    jobs, backend, sleeper = cluster_dir
    job = sleeper()
    _service(jobs, "old", [job], handover=True, state="ended")
    code, out, _ = run(job)
    assert code == 0 and out.strip() == f"stopped {job}"

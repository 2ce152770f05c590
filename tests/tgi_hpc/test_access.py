"""How metrics, chat and the API reach a target on the cluster: a job (one model or several, adapters), a service
(its READY replicas, re-read from the state file), and the refusals. Fake Slurm backend; the real one, laptop
tunnels included, in tests/cluster/test_{api,metrics_chat,service_tools,laptop_tools}.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tgi_hpc.errors import SlurmError, UsageError
from tgi_hpc.service.state import Replica, ServiceState, state_path
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.endpoint import endpoint_file
from tgi_hpc.workflows import access
from test_newcomer import FakeBackend, _cluster, _job


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    backend = FakeBackend({"4148": _job("4148", "RUNNING", node="cn-a"), "4150": _job("4150", "RUNNING", node="cn-b"),
                           "4151": _job("4151", "RUNNING", node="cn-c")})
    found = _cluster(tmp_path, backend)
    key = tmp_path / "jobs" / "4148.api-key"
    key.write_text("s3cret\n")
    models = [{"model": "org/llama", "port": 10148}, {"model": "org/qwen", "port": 10149, "adapters": ["sql", "math"]}]
    Path(endpoint_file(found.job_dir, "4148")).write_text(json.dumps(
        {"job_id": "4148", "node": "cn-a", "host": "cn-a", "port": 10148, "api_key_file": str(key),
         "model": "org/llama", "models": models}))
    # READY needs a real server (tests/cluster); here the wait returns at once
    monkeypatch.setattr(jobs, "wait", lambda cluster, job_id, **kw: jobs.status(cluster, [job_id], with_probe=False)[0])
    return found


def test_a_job_serving_several_models_is_reached_at_the_first_and_read_at_all(cluster):
    found = access.connect(cluster, "4148")
    assert (found.url, found.api_key, found.model, found.via) == ("http://cn-a:10148", "s3cret", "org/llama", "direct")
    assert found.headers == {"Authorization": "Bearer s3cret"} and found.urls() == ["http://cn-a:10148"]
    assert found.replicas() == {"4148/org/llama": "http://cn-a:10148", "4148/org/qwen": "http://cn-a:10149"}


@pytest.mark.parametrize(("model", "url"), [("org/qwen", "http://cn-a:10149"), ("math", "http://cn-a:10149"),
                                            ("org/llama", "http://cn-a:10148")])
def test_model_picks_the_engine_and_an_adapter_its_base_engine(cluster, model, url):
    found = access.connect(cluster, "4148", model=model)
    assert (found.url, found.model) == (url, model)
    assert found.replicas() == {"4148": url}


def test_a_model_the_job_does_not_serve_is_refused_naming_what_it_serves(cluster):
    with pytest.raises(UsageError, match="does not serve 'org/mistral'; it serves: math, org/llama, org/qwen, sql"):
        access.connect(cluster, "4148", model="org/mistral")


def test_unknown_jobs_hostile_names_and_missing_services_are_refused(cluster):
    with pytest.raises(SlurmError, match="no such job: 999"):
        access.connect(cluster, "999")
    with pytest.raises(UsageError, match="service name '4148; rm -rf ~'"):
        access.connect(cluster, "4148; rm -rf ~")
    with pytest.raises(UsageError, match="no service 'nope'"):
        access.connect(cluster, "nope")


def test_a_service_is_its_ready_replicas_read_again_each_time(cluster, tmp_path):
    key = tmp_path / "svc.key"
    key.write_text("svc-key\n")
    state = ServiceState("svc", model="org/llama", api_key_file=str(key), jobs=[
        Replica("4150", state="ready", url="http://cn-b:10150"), Replica("4151", state="starting")])
    path = Path(state_path(cluster.job_dir, "svc"))
    path.parent.mkdir(parents=True)
    path.write_text(state.to_json())
    found = access.connect(cluster, "svc")
    assert (found.url, found.api_key, found.model, found.service) == ("http://cn-b:10150", "svc-key", "org/llama", True)
    assert found.replicas() == {"4150": "http://cn-b:10150"}
    # a handover: 4151 is READY, 4150 drains; the same access follows
    state.jobs = [Replica("4150", state="draining", url="http://cn-b:10150"),
                  Replica("4151", state="ready", url="http://cn-c:10151")]
    path.write_text(state.to_json())
    assert found.urls() == ["http://cn-c:10151"] and found.replicas() == {"4151": "http://cn-c:10151"}

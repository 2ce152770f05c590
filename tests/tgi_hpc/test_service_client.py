"""ServiceClient and `serve --replicas/--handover`, `endpoint` without a cluster: real HTTP servers on 127.0.0.1."""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tgi_hpc.service.client import ReplicaLost, ServiceClient, ServiceUnavailable
from tgi_hpc.service.state import Replica, ServiceState


def _server(behaviour: str):
    """A replica: 'ok' answers, 'draining' answers 503 draining, 'lost' closes the connection mid-request."""
    hits = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            hits.append(self.headers.get("Authorization"))
            if behaviour == "lost":
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            code, body = (200, {"generated_text": behaviour}) if behaviour == "ok" else (
                503, {"error": "draining", "error_type": "draining"})
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", hits


def _closed_port_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def servers():
    made = []

    def make(behaviour):
        server, url, hits = _server(behaviour)
        made.append(server)
        return url, hits

    yield make
    for server in made:
        server.shutdown()


def _write_state(path, urls, key_file=""):
    jobs = [Replica(str(i), slot=i, state="ready", url=u) for i, u in enumerate(urls)]
    path.write_text(ServiceState("svc", api_key_file=key_file, jobs=jobs).to_json())


def test_a_refused_replica_is_skipped_and_the_key_is_sent(servers, tmp_path):
    url, hits = servers("ok")
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    state = tmp_path / "svc.json"
    _write_state(state, [_closed_port_url(), url], str(key))
    with ServiceClient(str(state)) as client:
        for _ in range(4):
            assert client.generate("hi")["generated_text"] == "ok"
    assert hits == ["Bearer s3cret"] * 4


def test_a_draining_replica_is_retried_elsewhere(servers, tmp_path):
    draining, drained_hits = servers("draining")
    ok, _ = servers("ok")
    with ServiceClient(urls=[draining, ok]) as client:
        assert [client.generate("x")["generated_text"] for _ in range(3)] == ["ok"] * 3
    assert len(drained_hits) == 1   # tried once, then skipped


def test_no_replica_at_all_is_a_clear_error(tmp_path):
    with ServiceClient(urls=[_closed_port_url()], retry_for=1.5) as client:
        with pytest.raises(ServiceUnavailable, match="no replica of the service took the request"):
            client.generate("x")


def test_a_replica_lost_mid_request_is_a_clear_error_or_a_retry(servers):
    lost, _ = servers("lost")
    ok, _ = servers("ok")
    with ServiceClient(urls=[lost], retry_for=1) as client:
        with pytest.raises(ReplicaLost, match="went away during the request"):
            client.generate("x")
    with ServiceClient(urls=[lost, ok], retry_lost=True) as client:
        assert all(client.generate("x")["generated_text"] == "ok" for _ in range(3))


def test_the_client_follows_a_handover_in_the_state_file(servers, tmp_path):
    old, old_hits = servers("ok")
    new, new_hits = servers("ok")
    state = tmp_path / "svc.json"
    _write_state(state, [old])
    with ServiceClient(str(state), refresh_s=0) as client:
        client.generate("x")
        _write_state(state, [new])        # the predecessor drains, its successor is READY
        client.generate("x")
    assert (len(old_hits), len(new_hits)) == (1, 1)


def test_client_needs_somewhere_to_go():
    with pytest.raises(ValueError, match="TGI_HPC_SERVICE_STATE"):
        ServiceClient()


# --- CLI ---------------------------------------------------------------------------------------------

def test_service_dry_run_renders_the_handover_job(run):
    code, out, err = run("serve", "--cluster", "mila", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct",
                         "--replicas", "2", "--handover", "15:00", "--dry-run")
    assert code == 0, err
    assert "#SBATCH --no-requeue" in out and "#SBATCH --requeue" not in out
    assert "python -m tgi_hpc.slurm.job service watch --state" in out and "service term" in out
    assert "services/smollm2-135m-instruct.api-key" in out and "--drain-timeout 28" in out


@pytest.mark.parametrize("args, message", [
    (("--replicas", "0"), "0 is not in the range"),
    (("--handover", "2-00:00:00", "--time", "1-00:00:00"), "not shorter than the job's time limit"),
    (("--handover", "soon"), "--handover 'soon'"),
    (("--keep-alive", "--time", "4:00"), "is not shorter than the time limit (240 s)"),
    (("--service", "../etc"), "service name '../etc'"),
    (("--keep-alive", "--requeue"), "--requeue is for a single job"),
])
def test_hostile_service_options(run, args, message):
    code, _, err = run("serve", "--cluster", "mila", "--model", "a/b", "--dry-run", *args)
    assert code == 2 and message in err


def test_endpoint_of_an_unknown_service(run, tmp_path):
    code, _, err = run("endpoint", "--cluster", "local", "--set", f"paths.jobs={tmp_path}", "nope")
    assert code == 2 and "no service 'nope'" in err


def test_endpoint_prints_exports_without_the_key(run, tmp_path, servers):
    url, _ = servers("ok")
    (tmp_path / "services").mkdir()
    key = tmp_path / "services" / "svc.api-key"
    key.write_text("s3cret\n")
    _write_state(tmp_path / "services" / "svc.json", [url], str(key))
    code, out, err = run("endpoint", "--cluster", "local", "--set", f"paths.jobs={tmp_path}", "--no-check", "svc")
    assert code == 0, err
    assert f"export TGI_HPC_URLS={url}" in out and "s3cret" not in out
    assert f'export TGI_HPC_API_KEY="$(cat {key})"' in out
    code, out, _ = run("endpoint", "--cluster", "local", "--set", f"paths.jobs={tmp_path}", "--no-check", "--json", "svc")
    assert json.loads(out)["urls"] == [url] and json.loads(out)["api_key"] == "s3cret"


def test_service_job_with_a_hostile_job_dir_is_valid_bash(run, tmp_path):
    import subprocess

    jobs = "/tmp/a b'c;$(x)"
    code, out, err = run("serve", "--cluster", "mila", "--model", "a/b", "--keep-alive", "--dry-run",
                         "--set", f"paths.jobs={jobs}")
    assert code == 0, err
    assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0
    assert "--state \"$SERVICE_STATE\" || true' TERM INT" in out     # the trap quotes nothing itself
    state_line = next(line for line in out.splitlines() if line.startswith("SERVICE_STATE="))
    assert subprocess.run(["bash", "-c", state_line + '; printf %s "$SERVICE_STATE"'], capture_output=True,
                          text=True).stdout == f"{jobs}/services/b.json"


def test_stop_service_marks_it_stopped_first(run, tmp_path):
    (tmp_path / "services").mkdir()
    _write_state(tmp_path / "services" / "svc.json", ["http://127.0.0.1:9"])
    code, out, err = run("stop", "--cluster", "local", "--set", f"paths.jobs={tmp_path}", "svc")
    assert code == 0, err
    assert out.strip() == "service svc stopped" and (tmp_path / "services" / "svc.stopped").exists()
    code, _, err = run("stop", "--cluster", "local", "--set", f"paths.jobs={tmp_path}", "other")
    assert code == 2 and "no service 'other'" in err and "known: svc" in err

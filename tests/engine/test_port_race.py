"""The port race: a port taken between the job's pick-port and the engine's bind. The engine binds the
next free one itself (the bind is the check) and the toolkit learns the port it really bound."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine.launcher import bind_socket
from tgi_hpc.slurm.endpoint import Endpoint
from tgi_hpc.slurm.ports import is_port_free

ROOT = Path(__file__).resolve().parents[2]


def _taken(start: int = 0) -> socket.socket:
    """A port another process listens on (the one the job picked, taken right after the check)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", start))
    sock.listen()
    return sock


def _free_run(length: int) -> int:
    """A port p with p..p+length-1 free now (the OS's ephemeral range moves on, so a race with others is rare)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + length < 65536 and all(is_port_free(p, "127.0.0.1") for p in range(first, first + length)):
            return first
    pytest.fail("no run of free ports")


def test_a_taken_port_makes_the_engine_bind_the_next_free_one():
    first = _free_run(3)
    other = _taken(first)
    try:
        sock = bind_socket("127.0.0.1", first, attempts=3)
        port = sock.getsockname()[1]
        assert first < port < first + 3
        # bound and already listening: another job's check-then-bind (SO_REUSEADDR) sees it taken
        assert not is_port_free(port, "127.0.0.1")
        sock.close()
    finally:
        other.close()


def test_without_attempts_a_taken_port_is_a_clear_error():
    other = _taken()
    port = other.getsockname()[1]
    try:
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}: .*pick another --port"):
            bind_socket("127.0.0.1", port)
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}: "):
            bind_socket("127.0.0.1", port, attempts=-5)   # nonsense counts mean one port
    finally:
        other.close()


def test_attempts_stop_at_the_last_port():
    try:
        other = _taken(65535)
    except OSError:   # another process has it: just as good
        other = None
    try:
        with pytest.raises(SystemExit, match=r"127.0.0.1:65535: "):
            bind_socket("127.0.0.1", 65535, attempts=50)
    finally:
        if other is not None:
            other.close()


def test_the_toolkit_learns_the_port_the_engine_really_bound(model_path, tmp_path):
    """The job's steps, as serve.sh.j2 runs them: PORT_ATTEMPTS=N engine --port P --ready-file, then
    `tgi_hpc.slurm.job write-endpoint`, while another process holds P."""
    first = _free_run(4)
    other = _taken(first)
    ready, endpoint_file, log = tmp_path / "ready.json", tmp_path / "job.endpoint.json", tmp_path / "engine.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TGI_HPC_JOB_ID": "1234", "PORT_ATTEMPTS": "4"}   # as the job sets
    with open(log, "wb") as out:
        engine = subprocess.Popen([sys.executable, "-m", "engine", "--model-id", str(model_path("tiny-llama")),
                                   "--hostname", "127.0.0.1", "--port", str(first),
                                   "--ready-file", str(ready), "--cpu-threads", "1", "--max-total-tokens", "64"],
                                  cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        helper = subprocess.run([sys.executable, "-m", "tgi_hpc.slurm.job", "write-endpoint", "--file",
                                 str(endpoint_file), "--ready-file", str(ready), "--pid", str(engine.pid),
                                 "--model", "m"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert helper.returncode == 0, helper.stderr + log.read_text()[-3000:]
        endpoint = Endpoint.from_json(endpoint_file.read_text())
        assert endpoint.port == json.loads(ready.read_text())["port"] != first
        assert first < endpoint.port < first + 4
        assert f":{endpoint.port}" in helper.stderr   # the job's log line
        assert httpx.get(f"http://127.0.0.1:{endpoint.port}/health", timeout=10).status_code == 200
        assert f"port {first} on 127.0.0.1 is taken: listening on {endpoint.port} instead" in log.read_text()
    finally:
        other.close()
        engine.terminate()
        try:
            engine.wait(15)
        except subprocess.TimeoutExpired:
            engine.kill()


@pytest.mark.parametrize("models", [["meta-llama/Llama-3.1-8B-Instruct"],
                                    ["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"]])
def test_serve_scripts_let_the_engine_step_past_a_taken_port(capsys, monkeypatch, tmp_path, models):
    from tgi_hpc.cli import main

    monkeypatch.setenv("TGI_HPC_CONFIG_DIR", str(tmp_path))
    argv = ["serve", "--cluster", "narval", "--dry-run", "--set", "slurm.account=def-x"]
    for model in models:
        argv += ["--model", model]
    assert main(argv) == 0
    script = capsys.readouterr().out
    engine_line = script.index("python -m engine ")
    assert 0 < script.index("export PORT_ATTEMPTS=100") < engine_line
    code = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    assert not any("--port-attempts" in line for line in code)   # a release compiled before the flag refuses it

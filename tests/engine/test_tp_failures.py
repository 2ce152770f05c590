"""A tensor-parallel rank that dies or hangs ends the engine (issue 27, failure path 1): `python -m engine
--num-shard 2` on CPU (gloo) exits non-zero within seconds, and the request in flight gets an error event
instead of waiting for the job's time limit."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from engine.rank_watch import RankState, stall_reason  # noqa: E402

RANK_TIMEOUT_S = 2.0
EXIT_WITHIN_S = 10.0        # after detection


def _worker_pid(proc):
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    workers = [int(p) for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(workers) == 1, children  # rank 1; rank 0 is the launcher itself
    return workers[0]


def _running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_dead_or_hung_worker_ends_the_engine_and_fails_the_request_in_flight(model_path, tmp_path, fault):
    from test_clients import start_server

    proc, url, log = start_server(model_path("tiny-llama"), tmp_path, "--num-shard", "2", "--device", "cpu",
                                  "--max-total-tokens", "512", "--rank-timeout", str(RANK_TIMEOUT_S))
    worker = _worker_pid(proc)
    try:
        body = {"inputs": "Count to one thousand: 1, 2, 3", "parameters": {"max_new_tokens": 480}}  # greedy: no EOS
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert json.loads(next(lines).removeprefix("data:"))["token"]   # the request is running
            os.kill(worker, fault)      # SIGSTOP: rank 0 waits for it in the next all-reduce, forever
            injected = time.monotonic()
            events = [json.loads(line.removeprefix("data:")) for line in lines if line.startswith("data:")]
        assert events and events[-1].get("error_type") == "generation", events[-3:]
        assert "rank 1" in events[-1]["error"] and "Traceback" not in events[-1]["error"]
        assert not any(event.get("details") for event in events), "the request must not end as if it had finished"
        detection = 1.0 if fault == signal.SIGKILL else RANK_TIMEOUT_S + 1.0    # + one watchdog period
        code = proc.wait(timeout=detection + EXIT_WITHIN_S + 5)   # + 5 s so that a slow exit fails on time below
        elapsed = time.monotonic() - injected
        assert code != 0
        assert elapsed < detection + EXIT_WITHIN_S, f"exited {elapsed:.1f} s after the fault"
        text = log.read_text()
        assert ("died" if fault == signal.SIGKILL else "sent no heartbeat") in text
        assert "exiting with status 1" in text
        time.sleep(0.5)
        assert not _running(worker), "the hung worker outlived its engine"
    finally:
        if _running(worker):
            os.kill(worker, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _ranks(**beats):
    return [RankState(int(rank[1:]), True, None, beat) for rank, beat in beats.items()]


def test_stall_reason_names_a_dead_rank_first():
    ranks = [RankState(1, True, None, 90.0), RankState(2, False, -9, 10.0)]
    assert stall_reason(100.0, ranks, 0.0, 5.0, 60.0) == "tensor-parallel rank 2 died (exit code -9)"


def test_stall_reason_a_silent_rank_after_the_rank_timeout():
    assert stall_reason(100.0, _ranks(r1=96.0, r2=99.5), None, 5.0, 60.0) is None
    assert "rank 1 sent no heartbeat for 6 s (--rank-timeout 5)" in stall_reason(102.0, _ranks(r1=96.0), None, 5.0, 60.0)
    assert stall_reason(100.0, _ranks(r1=0.0), None, 5.0, 60.0) is None   # not started beating yet


def test_stall_reason_a_step_longer_than_the_step_timeout_while_every_rank_beats():
    assert stall_reason(100.0, _ranks(r1=99.9), 41.0, 5.0, 60.0) is None
    assert "step has run for 61 s (--step-timeout 60)" in stall_reason(100.0, _ranks(r1=99.9), 39.0, 5.0, 60.0)
    assert stall_reason(100.0, _ranks(r1=99.9), None, 5.0, 60.0) is None   # idle: no step to time


# Rank 1 alone fails while it starts (its GPU full, say): a sitecustomize of the spawned ranks makes one method
# ("module:Class.method") raise there. Rank 0 is inside a collective meanwhile, or about to enter one.
FAULT = '''
import importlib
import os
from engine import distributed
module, _, qualified = os.environ["TGI_HPC_TEST_FAULT"].partition(":")
owner_name, name = qualified.split(".")
owner = getattr(importlib.import_module(module), owner_name)
original = getattr(owner, name)
def failing(*args, **kwargs):
    if distributed.tp_rank() == 1:
        raise MemoryError("out of memory on rank 1 (injected)")
    return original(*args, **kwargs)
setattr(owner, name, failing)
'''


@pytest.mark.parametrize("method", ["engine.worker:RankWorker._allocate_kv_cache",
                                    "engine.worker:RankWorker._capture_piecewise",
                                    "engine.piecewise_graphs:PiecewiseGraphs.capture"])
def test_a_rank_failing_at_start_up_fails_the_engine_at_once_with_its_error(model_path, tmp_path, monkeypatch,
                                                                               method):
    """The last case: a capture that fails on one rank only ends the start (the peers are in the self-check's
    collectives), where one rank alone would fall back to eager steps."""
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.model_runner import ModelRunner

    (tmp_path / "sitecustomize.py").write_text(FAULT)
    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{root}")
    monkeypatch.setenv("TGI_HPC_TEST_FAULT", method)
    path = model_path("tiny-llama")
    config = EngineConfig(model_id=str(path), device="cpu", block_size=4, cpu_kv_cache_bytes=2**20, num_shard=2,
                          master_port=0, piecewise_graphs=[1, 2, 4, 8, 16, 32])
    started = time.monotonic()
    with pytest.raises(RuntimeError) as failure:
        ModelRunner(config, ModelConfig.from_pretrained(path))
    assert time.monotonic() - started < 60
    message = str(failure.value)
    assert "rank 1" in message and "out of memory on rank 1 (injected)" in message, message
    assert "rank 1 died" in message or "rank 1 failed to start" in message, message
    if method.endswith("PiecewiseGraphs.capture"):
        assert "--piecewise-graphs 0" in message, message

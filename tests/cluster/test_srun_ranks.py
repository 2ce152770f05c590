"""The engine's ranks under a real `srun` (the local cluster has one node: two tasks on it): ranks from
SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID, a two-stage pipeline answers /generate from rank 0 only,
and a killed rank ends the whole step (srun --kill-on-bad-exit=1), leaving no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_two_srun_tasks_serve_one_pipeline_and_die_together(local_cluster, model_path, tmp_path):
    httpx = pytest.importorskip("httpx")
    from engine.distributed import find_free_port

    ready, pids = tmp_path / "ready.json", tmp_path / "pids"
    rank = tmp_path / "rank.sh"
    rank.write_text(f"""#!/bin/bash
echo "$SLURM_PROCID $$" >> {pids}
exec env PYTHONPATH={ROOT} OMP_NUM_THREADS=1 {sys.executable} -m engine --model-id {model_path("tiny-llama")} \\
  --num-shard 1 --pipeline-parallel-size 2 --device cpu --master-addr 127.0.0.1 --master-port {find_free_port()} \\
  --hostname 127.0.0.1 --port 0 --ready-file {ready} --rank-timeout 5 --cpu-threads 1 --max-total-tokens 64
""")
    rank.chmod(0o755)
    step = subprocess.Popen(["srun", "--ntasks=2", "--ntasks-per-node=2", "--kill-on-bad-exit=1",
                             "--distribution=block", "--cpus-per-task=1", "--time=10", "-J", "tgi-hpc-test-srun",
                             str(rank)], env=local_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert step.poll() is None and time.monotonic() < deadline, step.stdout.read() if step.poll() else "slow"
            time.sleep(0.5)
        by_rank = dict(line.split() for line in pids.read_text().splitlines())
        endpoint = json.loads(ready.read_text())
        assert endpoint["pid"] == int(by_rank["0"])          # only rank 0 serves
        reply = httpx.post(f"http://127.0.0.1:{endpoint['port']}/generate", timeout=60,
                           json={"inputs": "Hello there", "parameters": {"max_new_tokens": 4}})
        assert reply.status_code == 200 and reply.json()["generated_text"]
        os.kill(int(by_rank["1"]), signal.SIGKILL)
        assert step.wait(timeout=60) != 0
        time.sleep(1)
        assert not any(_alive(int(pid)) for pid in by_rank.values())
    finally:
        if step.poll() is None:
            step.kill()

"""`--workers N`: N engine processes on one node, each with its share of the CPU threads and of the window,
taking shards from the same ledger (work stealing, as the tasks of a job array do).

Why: on CPU a batch's time is the model's forward (scripts/profile_batch.py: ~96% of its CPU, the rest of
the batch path under 1%), and one forward on N threads waits at every OpenMP barrier for its slowest core,
which a busy node makes often. N single-threaded forwards do not wait for each other. The price is N copies
of the weights, so it is for small models on CPU. Each worker is `python -m engine.offline` with
`--workers 1`; SIGTERM/SIGINT go to every worker (each gives its open shards back), and a worker whose
parent dies is sent SIGTERM by the kernel (PR_SET_PDEATHSIG), so no worker outlives the job. The workers
start claiming together, once each has loaded its model (a start barrier: a file per ready worker in a
folder the parent makes, `BARRIER_ENV`, which also marks a worker that ended, say killed at load; at most
`BARRIER_S` of waiting), so the first to load does not take a short batch's whole share while others load.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("engine.offline")

PR_SET_PDEATHSIG = 1
BARRIER_ENV = "TGI_HPC_WORKERS_BARRIER"     # "FOLDER:COUNT"
BARRIER_S = 600.0


def wait_for_siblings(name: str, stop: threading.Event, timeout_s: float = BARRIER_S) -> None:
    """Say this worker is ready, then wait until all are (or `stop`, or the timeout); nothing without a barrier."""
    where, _, count = os.environ.get(BARRIER_ENV, "").rpartition(":")
    if not where or not count.isdigit():
        return
    folder = Path(where)
    try:
        (folder / name.replace("/", "_")).touch()
    except OSError:
        return
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            if len(list(folder.iterdir())) >= int(count):
                return
        except OSError:
            return
        stop.wait(0.05)
    if not stop.is_set():
        logger.warning("the other workers were not ready after %.0f s: starting without them", timeout_s)


def shares(total: int, workers: int) -> list[int]:
    """`total` split over `workers`, each at least 1: 5 over 2 -> [3, 2]."""
    base, extra = divmod(max(total, workers), workers)
    return [base + (k < extra) for k in range(workers)]


def on_cpu(device: str | None) -> bool:
    """Whether the engine runs on the CPU (None: torch's choice, cuda when it sees a GPU)."""
    if device is not None:
        return device == "cpu"
    import torch
    return not torch.cuda.is_available()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):      # not Linux: a worker may outlive a SIGKILLed parent
        pass


def worker_argv(batch_dir: str, holder: str, k: int, window: int, threads: int, lease_s: float | None,
                engine_argv: Sequence[str], workers: int = 1) -> list[str]:
    """Worker k's command line (the last --cpu-threads wins over one in `engine_argv`). Each of the `workers` sizes
    its KV cache from 1/workers of the node's share (`--cuda-memory-fraction`, unless the flags set one): started
    together, they would otherwise each take the share that the free memory allows one engine."""
    argv = [sys.executable, "-m", "engine.offline", "--batch-dir", batch_dir, "--holder", f"{holder}/w{k}",
            "--window", str(window), "--workers", "1"]
    if lease_s is not None:
        argv += ["--lease-s", str(lease_s)]
    if workers > 1 and not any(a.split("=")[0] == "--cuda-memory-fraction" for a in engine_argv):
        argv += ["--cuda-memory-fraction", f"{1 / workers:.6g}"]
    return argv + [*engine_argv, "--cpu-threads", str(threads)]


def run_workers(argvs: list[list[str]]) -> int:
    """Start every worker, pass SIGTERM/SIGINT on to them, wait for all; the worst exit code."""
    procs: list[subprocess.Popen] = []

    def forward(signum: int, frame: Any) -> None:
        logger.info("signal %d: passing it on to %d worker(s)", signum, len(procs))
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    barrier = tempfile.TemporaryDirectory(prefix="tgi-hpc-workers-")
    env = {**os.environ, BARRIER_ENV: f"{barrier.name}:{len(argvs)}"}
    for argv in argvs:
        procs.append(subprocess.Popen(argv, preexec_fn=_die_with_parent, env=env))
    logger.info("%d workers started (pids %s)", len(procs), " ".join(str(p.pid) for p in procs))
    while True:
        codes = [proc.poll() for proc in procs]
        for k, code in enumerate(codes):      # one that ended (a crash at load: OOM) no longer holds the others
            if code is not None:
                (Path(barrier.name) / f"ended-{k}").touch()
        if None not in codes:
            break
        time.sleep(0.5)
    barrier.cleanup()
    bad = [code for code in codes if code]
    if bad:
        logger.error("worker exit codes: %s", codes)
    return (bad[0] if bad[0] > 0 else 1) if bad else 0

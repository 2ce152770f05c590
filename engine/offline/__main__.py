"""`python -m engine.offline --batch-dir DIR --holder ID [engine flags]`: run a batch's shards in this process.

Engine flags are the server's (`python -m engine --help`: --model-id, --quantize, limits...). SIGTERM gives
the open shards back and exits; the job (or a rerun) goes on from the ledger. The last holder to commit
writes the batch's output (the manifest names it).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("engine.offline")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.offline", add_help=True,
                                     description="Run a tgi-hpc batch's shards with an in-process engine.")
    parser.add_argument("--batch-dir", required=True, help="the batch folder (tgi-hpc batch makes it)")
    parser.add_argument("--holder", default=f"{socket.gethostname()}:{os.getpid()}",
                        help="this worker's name in the ledger's leases")
    parser.add_argument("--lease-s", type=float, default=None, help="lease length (default: the manifest's)")
    parser.add_argument("--window", type=int, default=None,
                        help="requests in flight at most (default: --max-concurrent-requests)")
    parser.add_argument("--workers", type=int, default=1,
                        help="engine processes on this node, splitting the CPU threads (--cpu-threads, default "
                             "every core) and the window between them and taking shards from the same ledger: "
                             "on CPU, N single-threaded forwards outrun one N-thread forward (N copies of the "
                             "weights: small models)")
    ours, engine_argv = parser.parse_known_args(argv)

    from engine.launcher import parse_args, resolve_model_dir, setup_logging, to_config
    args = parse_args(engine_argv)
    setup_logging(args.json_output)
    config = to_config(args, resolve_model_dir(args.model_id, args.revision))

    from tgi_hpc.batch.assembly import assemble
    from tgi_hpc.batch.ledger import DEFAULT_LEASE_S, Ledger
    probe = Ledger(ours.batch_dir)
    lease_s = ours.lease_s or float(probe.manifest.get("lease_s", DEFAULT_LEASE_S))
    ledger = Ledger(ours.batch_dir, lease_s=lease_s)
    if ledger.progress().complete:
        logger.info("the batch is complete already")
        return _assemble(ledger, assemble)
    if ours.workers < 1:
        parser.error(f"--workers must be >= 1, got {ours.workers}")
    if ours.workers > 1:
        from engine.offline.workers import on_cpu, run_workers, shares, worker_argv
        if config.num_shard > 1 or not on_cpu(config.device):
            parser.error("--workers is for the CPU (one engine process per share of the cores); on GPUs run one "
                         "worker per job (--jobs)")
        threads = shares(args.cpu_threads or len(os.sched_getaffinity(0)), ours.workers)
        windows = shares(ours.window or config.max_concurrent_requests, ours.workers)
        return run_workers([worker_argv(ours.batch_dir, ours.holder, k, windows[k], threads[k], ours.lease_s,
                                        engine_argv, ours.workers) for k in range(ours.workers)])

    import torch

    from engine.offline.requests import OfflineState
    from engine.offline.runner import BatchRunner
    if args.cpu_threads is not None:
        torch.set_num_threads(args.cpu_threads)
    from engine.launcher import build_engine
    try:
        llm = build_engine(config)   # an embedder: /v1/embeddings lines; an encoder-decoder: completions
    except (ValueError, FileNotFoundError) as exc:
        logger.error("cannot start the engine: %s", exc)
        return 1
    runner = BatchRunner(llm, OfflineState.of(llm, config), ledger, ours.holder,
                         window=ours.window or config.max_concurrent_requests)

    def stop(signum: int, frame: Any) -> None:
        logger.info("signal %d: giving the open shards back", signum)
        runner.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    from engine.offline.workers import wait_for_siblings
    wait_for_siblings(ours.holder, runner.stop_event)      # with --workers: claim once every worker has loaded
    try:
        summary = runner.run()
    finally:
        llm.close()
    logger.info("this worker: %d request(s), %d failed, %d shard(s) committed, %.1f tok/s over %.0f s%s",
                summary.requests, summary.failed, summary.shards_committed, summary.tokens_per_s, summary.seconds,
                " (stopped)" if summary.stopped else "")
    if summary.stopped:
        return 0
    return _assemble(ledger, assemble)


def _assemble(ledger: Any, assemble: Any) -> int:
    output = ledger.manifest.get("output")
    if output and assemble(ledger, Path(output)):
        logger.info("batch complete: %s", output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

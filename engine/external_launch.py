"""Ranks started by an external launcher (srun, one process per GPU across nodes; or torchrun).

Rank 0 is the driver: it runs the scheduler, the sampler and HTTP (engine/launcher.py), and a
`DistributedRunner` that each step broadcasts the spans to every rank over a gloo control group, runs
its own share of the forward, and gets the logits back (engine/pipeline.py with pipeline stages).
Every other rank runs `follower_main`: it builds its shard and stage, then runs whatever it receives.

If any rank dies, every other rank exits instead of hanging: each rank bumps a heartbeat counter in the
rendezvous store (hosted by rank 0) every second; rank 0 watches everyone, the others watch rank 0 and
the store itself. A counter that stops for `rank_timeout_s`, or a store that is gone, ends the process
with status 1 (srun --kill-on-bad-exit then ends the whole step). The control group waits without a
timeout (an idle server sends nothing); the device group's collectives time out after LAUNCHED_GROUP_TIMEOUT_S
(loading a large model's weights takes a while on some ranks).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from engine import distributed
from engine.batch import SeqSpan
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.model_inputs import validate_spans
from engine.model_runner import split_logits
from engine.models.decoder import check_tensor_parallel
from engine.parallel_layout import ParallelLayout
from engine.worker import LAUNCHED_GROUP_TIMEOUT_S, RankWorker

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
EXIT_GRACE_S = 10.0


class PeerWatch:
    """Heartbeats through the rendezvous store; calls `on_dead(reason)` once when a watched rank goes quiet."""

    def __init__(self, config: EngineConfig, layout: ParallelLayout, on_dead: Callable[[str], None]) -> None:
        self.layout, self.on_dead, self.timeout = layout, on_dead, config.rank_timeout_s
        # its own connection: the process group's store client is not for a second thread
        self.store = distributed.create_store(config.master_addr, config.master_port, layout.world_size,
                                              is_master=False, timeout_s=max(self.timeout, 5.0))
        self.watched = range(1, layout.world_size) if layout.rank == 0 else [0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tgi-engine-peer-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """The first heartbeat goes out at once: a rank counts as watched from its first beat on, and one that
        died right after start-up (before a beat a second later) was never declared dead."""
        last_seen: dict[int, tuple[int, float]] = {}
        while not self._stop.is_set():
            try:
                self.store.add(f"tgi/heartbeat/{self.layout.rank}", 1)
                counts = {rank: self.store.add(f"tgi/heartbeat/{rank}", 0) for rank in self.watched}
            except Exception as error:  # noqa: BLE001 - rank 0 (the store's host) is gone
                return self._dead(f"the rendezvous store on rank 0 is unreachable ({type(error).__name__})")
            now = time.monotonic()
            for rank, count in counts.items():
                seen = last_seen.get(rank)
                if seen is None or count != seen[0]:
                    last_seen[rank] = (count, now)
                elif count > 0 and now - seen[1] > self.timeout:
                    return self._dead(f"rank {rank} sent no heartbeat for {self.timeout:g} s")
            self._stop.wait(HEARTBEAT_S)

    def _dead(self, reason: str) -> None:
        if not self._stop.is_set():
            self.on_dead(reason)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop beating and wait for the thread. A daemon thread left inside a store call (C++, the GIL released)
        when the interpreter ends is ended by CPython with pthread_exit as it takes the GIL back; that unwinds
        through a C++ frame that may not be unwound and aborts the process ("terminate called without an active
        exception": rank 0 of a pipeline run died so at exit, after printing its tokens, twice in CI under load)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _exit_now(reason: str) -> None:
    logger.error("ending rank: %s", reason)
    logging.shutdown()
    os._exit(1)


def _control_group() -> dist.ProcessGroup:
    """CPU broadcasts of the step's spans; no timeout, since an idle server sends nothing for hours."""
    return dist.new_group(backend="gloo", timeout=timedelta(days=365))


class DistributedRunner:
    """Rank 0's handle on every rank: the same interface as engine.model_runner.ModelRunner."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, layout: ParallelLayout) -> None:
        if layout.rank != 0:
            raise ValueError("only rank 0 drives the ranks; the others run follower_main")
        check_tensor_parallel(model_config, layout.tp_size)
        self.config, self.model_config, self.layout = config, model_config, layout
        self._dead: list[int] = []
        self._failure: str | None = None
        self._closed = False
        store = distributed.create_store(config.master_addr, config.master_port, layout.world_size,
                                         is_master=True, timeout_s=LAUNCHED_GROUP_TIMEOUT_S)
        self._store = store
        self._watch = PeerWatch(config, layout, self._on_dead)
        try:
            self._worker = RankWorker(config, model_config, 0, store, layout)
            self._control = _control_group()
        except BaseException:
            self._watch.stop()   # the others see the store go and exit
            raise
        worker = self._worker
        self.device, self.dtype, self.block_size = worker.device, worker.dtype, worker.block_size
        self.num_kv_blocks, self.attention_backend = worker.num_kv_blocks, worker.attention_backend
        self.attention_checks, self.linear_backend = worker.attention_report, worker.linear_backend
        self.elementwise_backend, self.quant_checks = worker.elementwise_backend, worker.quant_report
        self.decode_step_report = worker.decode_step_report
        self.cuda_graph_sizes: list[int] = []
        self.piecewise_graph_sizes: list[int] = worker.piecewise.sizes if worker.piecewise is not None else []
        logger.info("%d ranks ready: %d pipeline stage(s) x %d tensor shard(s), layers %s on rank 0, "
                    "%d KV blocks of %d tokens", layout.world_size, layout.pp_size, layout.tp_size,
                    worker.model.model.layer_range, self.num_kv_blocks, self.block_size)

    def _on_dead(self, reason: str) -> None:
        logger.error("a rank is gone: %s; the engine stops", reason)
        self._failure = reason
        self._dead = list(range(1, self.layout.world_size))
        # the main thread may be blocked in a collective with the dead rank: do not wait for it forever
        threading.Timer(EXIT_GRACE_S, _exit_now, args=(reason,)).start()

    def run(self, spans: list[SeqSpan]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if self._closed or self._failure:
            raise RuntimeError(f"the distributed runner cannot run: {self._failure or 'closed'}")
        if not spans:
            return torch.zeros(0, self.model_config.vocab_size, device=self.device), {}
        validate_spans(spans, self.block_size, self.num_kv_blocks, self.model_config.max_position_embeddings)
        try:
            dist.broadcast_object_list([spans], src=0, group=self._control)
            logits = self._worker.execute(spans)
        except Exception as error:
            self._failure = f"distributed step failed: {error}"
            self._dead = self._dead or list(range(1, self.layout.world_size))
            raise RuntimeError(self._failure) from error
        return split_logits(spans, logits)

    @property
    def worker_pids(self) -> list[int]:
        return []    # the other ranks are not our children (srun started them)

    def dead_workers(self) -> list[int]:
        """Ranks gone (all others once one is: the launcher then shuts down)."""
        return list(self._dead)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._watch.stop()
        if not self._failure:
            try:
                dist.broadcast_object_list([None], src=0, group=self._control)  # followers exit
            except Exception:  # noqa: BLE001 - best effort: they also exit when the store goes
                logger.exception("telling the other ranks to stop failed")
        self._worker.close()
        # the control group goes now, while the interpreter is whole: a gloo group freed during finalisation (the
        # engine held by a module global) may release its work's tensors from a gloo thread as the GIL goes, which
        # aborts the process ("terminate called without an active exception" after a clean run, rank 0 only). The
        # store stays: the other ranks' watches read it until they stop.
        self._control = None

    def __enter__(self) -> DistributedRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def follower_main(config: EngineConfig, model_config: ModelConfig, layout: ParallelLayout) -> int:
    """Ranks 1..N-1: build this rank's shard and stage, then run each broadcast step until told to stop."""
    store = distributed.create_store(config.master_addr, config.master_port, layout.world_size,
                                     is_master=False, timeout_s=LAUNCHED_GROUP_TIMEOUT_S)
    watch = PeerWatch(config, layout, _exit_now)
    worker = RankWorker(config, model_config, layout.rank, store, layout)
    control = _control_group()
    logger.info("rank %d ready: stage %d, tensor rank %d, layers %s", layout.rank, layout.stage, layout.tp_rank,
                worker.model.model.layer_range)
    try:
        while True:
            message: list[list[SeqSpan] | None] = [None]
            dist.broadcast_object_list(message, src=0, group=control)
            if message[0] is None:
                break
            worker.execute(message[0])
    except Exception as error:  # noqa: BLE001 - a peer died mid-step: exit, do not linger
        watch.stop()
        _exit_now(f"rank {layout.rank}: {type(error).__name__}: {error}")
    watch.stop()
    worker.close()
    return 0

"""ModelRunner: the scheduler's handle on the model. Rank 0 runs in the caller's process and
drives num_shard - 1 spawned worker ranks over pipes; the math goes over torch.distributed
(gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing as mp
import threading
import time

import torch

from engine import distributed
from engine.batch import SeqSpan
from engine.config import EngineConfig
from engine.lora.adapter import read_adapters
from engine.model_config import ModelConfig
from engine.model_inputs import validate_spans
from engine.models.decoder import check_tensor_parallel
from engine.models.transformers_backend import check_engine_options
from engine.rank_watch import HEARTBEAT_S, RankState, stall_reason
from engine.worker import RankWorker, available_cpus, resolve_device, worker_main

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 5.0


class ModelRunner:
    """Loads the model on num_shard ranks, owns the paged KV cache, runs batches of spans.

    The scheduler owns block allocation; the runner only sizes the cache (`num_kv_blocks` blocks of
    `block_size` tokens) and writes/reads the slots the spans' block tables name.
    """

    takes_device_input_ids = True   # run(input_ids=...): rank 0 broadcasts them to the other tensor ranks

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        if config.num_shard < 1:
            raise ValueError(f"num_shard must be >= 1, got {config.num_shard}")
        check_engine_options(config.num_shard, config.lora_adapters, config.quantize, model_config)
        check_tensor_parallel(model_config, config.num_shard)
        if config.lora_adapters:  # every adapter problem fails here, before minutes of weight loading
            read_adapters(config.lora_adapters, model_config, config.served_model_name or config.model_id)
        self.config, self.model_config = config, model_config
        self._workers: list[tuple[mp.process.BaseProcess, mp.connection.Connection]] = []
        self._rank0: RankWorker | None = None
        self._failure: str | None = None
        self._closed = False
        self._step_started: float | None = None
        self._starting = False      # ranks still loading: only a dead rank counts (a silent one may be in C code)
        self._beats = None
        self._threads_before: int | None = None
        try:
            self._start(config, model_config)
        except BaseException:
            self.close()
            raise
        self.device: torch.device = self._rank0.device
        self.dtype: torch.dtype = self._rank0.dtype
        self.block_size: int = self._rank0.block_size
        self.num_kv_blocks: int = self._rank0.num_kv_blocks
        self.kv_eager_blocks: int | None = self._rank0.kv_eager_blocks   # CPU: see BlockManager's eager_blocks
        self.attention_backend: str = self._rank0.attention_backend
        self.attention_checks: dict[str, str] = self._rank0.attention_report  # candidate -> "ok" or why not
        self.linear_backend: str = self._rank0.linear_backend
        self.elementwise_backend: str = self._rank0.elementwise_backend
        self.decode_step_report: str = self._rank0.decode_step_report  # engine/cpu_decode_step.py: fused or why not
        self.lora_backend: str = self._rank0.lora_backend            # "none" without adapters
        self.lora_checks: dict[str, str] = self._rank0.lora_report
        self.quant_checks: dict[str, str] = self._rank0.quant_report
        graphs = self._rank0.graphs
        self.cuda_graph_sizes: list[int] = graphs.batch_sizes if graphs is not None else []
        self.forward_steps = self._rank0.forward_steps   # rank 0's target forwards by path (every rank's are alike)
        pieces = self._rank0.piecewise
        self.piecewise_graph_sizes: list[int] = pieces.sizes if pieces is not None else []
        logger.info("model runner ready: %s on %s x%d, %s, attention %s, linear %s, element-wise %s, decode CUDA "
                    "graphs %s, piecewise graphs %s, decode step %s, %d KV blocks of %d tokens",
                    model_config.architecture, self.device, config.num_shard, self.dtype, self.attention_backend,
                    self.linear_backend, self.elementwise_backend, self.cuda_graph_sizes or "none",
                    self.piecewise_graph_sizes or "none", self.decode_step_report, self.num_kv_blocks, self.block_size)

    def _start(self, config: EngineConfig, model_config: ModelConfig) -> None:
        store = None
        if config.num_shard > 1:
            port = distributed.pick_master_port(config.master_addr, config.master_port)
            store = distributed.create_store(config.master_addr, port, config.num_shard, is_master=True)
            self._spawn_workers(config, model_config, (config.master_addr, store.port))
            if resolve_device(config.device, 0).type == "cpu":
                self._threads_before = torch.get_num_threads()  # ranks share the cores; restored on close
                torch.set_num_threads(max(1, available_cpus() // config.num_shard))
            self._wait_for("joining")
            # from here on a rank that dies ends the others' collectives (a peer failing at start-up, e.g. out of
            # memory on its GPU alone, would leave NCCL waiting in rank 0's first all-reduce)
            self._starting = True
            threading.Thread(target=self._watch_workers, name="tgi-engine-watchdog", daemon=True).start()
        try:
            self._rank0 = RankWorker(config, model_config, 0, store)
        except Exception as error:
            if not self._workers or isinstance(error, ValueError):  # bad input: every rank refuses it alike
                raise
            raise RuntimeError(self._peer_failure("start-up", error)) from error
        self._wait_for("ready")
        self._starting = False

    def _spawn_workers(self, config: EngineConfig, model_config: ModelConfig, master: tuple[str, int]) -> None:
        context = mp.get_context("spawn")
        self._beats = context.RawArray("d", config.num_shard)   # heartbeats (engine/rank_watch.py)
        worker_config = dataclasses.replace(config, api_key=None)  # secrets stay in rank 0
        for rank in range(1, config.num_shard):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=worker_main, name=f"tgi-engine-rank{rank}", daemon=True,
                                      args=(worker_config, model_config, rank, master, child_end, self._beats))
            process.start()
            child_end.close()
            self._workers.append((process, parent_end))

    def _wait_for(self, state: str) -> None:
        """Block until every worker reports `state`; fail fast if one dies or reports an error."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (process, conn) in enumerate(self._workers, start=1):
            while not conn.poll(0.1):
                if not process.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start "
                                       f"(exit code {process.exitcode}){self._worker_errors()}")
            message = conn.recv()
            if message[0] != state:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {message[-1]}")

    def draft_heads(self, rows: list) -> list[list[int]]:
        """Medusa / EAGLE-3 drafts (engine/spec_decode/head_drafter.py): rank 0 alone holds the heads."""
        self._check_usable()
        return self._rank0.draft_heads(rows)

    def run(self, spans: list[SeqSpan], num_layers: int | None = None, draft: bool = False,
            input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Forward one batch of spans (`num_layers`: through the first layers only, a layer-skip draft;
        `draft`: through the draft model alone; `input_ids`: the first spans' tokens on rank 0's device in place
        of their `token_ids`, broadcast from there to the other ranks, engine/async_scheduling.py).

        Returns the float32 logits [n, vocab] of the last token of every span whose `logits` is not
        "none" (span order), and seq_id -> [len(span.token_ids), vocab] for spans asking for "all".
        """
        self._check_usable()
        if not spans:
            return torch.zeros(0, self.model_config.vocab_size, device=self.device), {}
        validate_spans(spans, self.block_size, self.num_kv_blocks, self.model_config.max_position_embeddings)
        for rank, (_, conn) in enumerate(self._workers, start=1):
            try:
                conn.send(("run", spans, num_layers, draft, None, 0 if input_ids is None else len(input_ids)))
            except OSError as error:
                self._fail(f"tensor-parallel rank {rank} is gone ({error})")
        self._step_started = time.monotonic()
        try:
            logits = self._rank0.execute(spans, num_layers, draft, input_ids)
        except Exception as error:
            if not self._workers:
                raise
            self._fail(self._peer_failure("step", error))
        finally:
            self._step_started = None
        return split_logits(spans, logits)

    def encode_images(self, spans: list[SeqSpan]) -> dict[int, str]:
        """The vision encoder, before a step's forward: seq_id -> why, for the requests whose images it failed on
        (the engine ends them; the others run). Rank 0 alone: vision-language models run on one rank."""
        self._check_usable()
        return self._rank0.encode_images(spans)

    def load_lora(self, slot: int, name: str, path: str) -> None:
        """Runtime LoRA (engine/lora/runtime.py): an adapter into `slot` on every rank, between steps."""
        self._each_rank("load_lora", slot, name, path)

    def unload_lora(self, slot: int) -> None:
        self._each_rank("unload_lora", slot)

    def _each_rank(self, command: str, *args: object) -> None:
        self._check_usable()
        for rank, (_, conn) in enumerate(self._workers, start=1):
            try:
                conn.send((command, *args))
            except OSError as error:
                self._fail(f"tensor-parallel rank {rank} is gone ({error})")
        getattr(self._rank0, command)(*args)

    def _watch_workers(self) -> None:
        """A dead, silent or hung rank fails the runner and the step at once (engine/rank_watch.py): the workers
        are killed, so rank 0's collective errors out (gloo) or is aborted (NCCL) instead of waiting for its
        timeout, and the launcher ends the process."""
        while not self._closed and not self._failure:
            time.sleep(HEARTBEAT_S)
            ranks = [RankState(rank, process.is_alive(), process.exitcode, self._beats[rank])
                     for rank, (process, _) in enumerate(self._workers, start=1)]
            reason = stall_reason(time.monotonic(), ranks, self._step_started,
                                  math.inf if self._starting else self.config.rank_timeout_s,
                                  self.config.step_timeout_s)
            if reason is not None and not self._closed:
                self._abort(reason)

    def _abort(self, reason: str) -> None:
        logger.error("%s: the model runner stops", reason)
        self._failure = reason
        for process, _ in self._workers:
            process.kill()      # SIGKILL ends a stopped (SIGSTOP) process too
        abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
        if resolve_device(self.config.device, 0).type == "cuda" and abort is not None:
            try:
                abort()         # NCCL waits forever on a dead peer (gloo notices by itself)
            except Exception:  # noqa: BLE001 - best effort: the launcher exits either way
                logger.exception("aborting the process group failed")

    @property
    def failure(self) -> str | None:
        """Why the runner cannot run any more (a rank died or hung, a step failed), or None."""
        return self._failure

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the model runner is closed")
        if self._failure:
            raise RuntimeError(f"the model runner failed earlier and must be restarted: {self._failure}")
        for rank, (process, _) in enumerate(self._workers, start=1):
            if not process.is_alive():
                self._fail(f"tensor-parallel rank {rank} died (exit code {process.exitcode})"
                           f"{self._worker_errors()}")

    def _fail(self, message: str) -> None:
        self._failure = message
        raise RuntimeError(message)

    def _peer_failure(self, what: str, error: Exception) -> str:
        """Rank 0's `error` in `what` with what became of the other ranks: the watchdog's reason when it ended
        them, their states, and the errors they sent."""
        cause = f"{self._failure}; " if self._failure else ""
        return f"tensor-parallel {what} failed ({cause}{self._worker_states()}): {error}{self._worker_errors()}"

    def _worker_states(self, grace_s: float = 1.0) -> str:
        """'rank 1 died (exit code -9), ...' once a failed collective hints that a peer is gone."""
        states = []
        for rank, (process, _) in enumerate(self._workers, start=1):
            process.join(grace_s)  # a peer that just died needs a moment to be reaped
            alive = process.is_alive()
            states.append(f"rank {rank} " + ("alive" if alive else f"died (exit code {process.exitcode})"))
        return ", ".join(states)

    def _worker_errors(self) -> str:
        errors = []
        for _, conn in self._workers:
            try:
                while conn.poll(0):
                    message = conn.recv()
                    if message[0] == "error":
                        errors.append(message[1])
            except (OSError, EOFError):
                continue
        return "\n" + "\n".join(errors) if errors else ""

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (empty with one shard)."""
        return [process.pid for process, _ in self._workers]

    def dead_workers(self) -> list[int]:
        """Ranks' pids that are gone (is_alive also reaps them, so a dead rank is never a zombie)."""
        return [process.pid for process, _ in self._workers if not process.is_alive()]

    def close(self) -> None:
        """Stop the workers and free the model; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for _, conn in self._workers:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process, conn in self._workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(STOP_TIMEOUT_S)
            conn.close()
        if self._rank0 is not None:
            self._rank0.close()
            self._rank0 = None
        else:
            distributed.destroy_tensor_parallel()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def split_logits(spans: list[SeqSpan], logits: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Rows come in span order: all rows of "all" spans, one row of "last" spans, none of "none"."""
    last_rows, all_logits, row = [], {}, 0
    for span in spans:
        if span.logits == "all":
            all_logits[span.seq_id] = logits[row:row + len(span.token_ids)]
            row += len(span.token_ids)
            last_rows.append(row - 1)
        elif span.logits == "last":
            last_rows.append(row)
            row += 1
    if not all_logits and row == logits.shape[0] == len(last_rows) and logits.is_contiguous():
        return logits, all_logits  # every row is a "last" row, in order (a plain decode): no copy
    return logits[last_rows], all_logits

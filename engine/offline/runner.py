"""The job's loop: take shards from the ledger, keep the engine's batch full, commit each shard as it ends.

Requests go to the engine as slots free (at most `window` in flight), so a shard's stragglers share the
batch with the next shard's first requests. The next shard is claimed only when the current one is all in
flight. A background thread renews the leases of the shards this holder has open. When no shard is free but
others hold some, the runner waits for them to commit or for their leases to expire (a dead holder's shard
is then taken over). `stop()` (SIGTERM: time limit, scancel, preemption) gives the open shards back at once.
Every finished line is also appended to the shard's journal (tgi_hpc/batch/journal.py; one fsync'ed write per
`journal_s` at most, and at a stop), and a shard taken over starts from the lines its journals hold: the work
done inside a shard survives a requeue or a kill, so a shard longer than a job's run still ends.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.offline.requests import (OfflineState, Prepared, RequestError, embedding_line, error_line, prepare,
                                     response_line)
from engine.pooling.engine import PoolingParams
from engine.server.errors import ServerError
from engine.server.infer import Collector, Timings
from tgi_hpc.batch.inputs import Records
from tgi_hpc.batch.journal import Entry, JournalWriter
from tgi_hpc.batch.ledger import Lease, Ledger

logger = logging.getLogger(__name__)


@dataclass
class _OpenShard:
    lease: Lease
    lines: list[str | None]
    journal: JournalWriter
    failed: int = 0
    tokens: int = 0
    unjournaled: list[Entry] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(line is not None for line in self.lines)


@dataclass
class _Pooled:
    """The inputs of one embeddings line in flight: one engine request each, the line done when all are."""
    rids: list[str]
    rows: list[Any]
    left: int


@dataclass
class Summary:
    shards_committed: int = 0
    requests: int = 0
    failed: int = 0
    resumed: int = 0              # lines taken from the journals of shards taken over (not in requests)
    generated_tokens: int = 0     # or embedded (prompt) tokens, for embeddings lines
    seconds: float = 0.0
    stopped: bool = False
    lost_shards: list[int] = field(default_factory=list)   # committed by another holder first

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


class BatchRunner:
    def __init__(self, llm: Any, state: OfflineState, ledger: Ledger, holder: str, *, window: int = 128,
                 poll_s: float = 5.0, journal_s: float = 1.0):
        self.llm, self.state, self.ledger, self.holder = llm, state, ledger, holder
        self.records = Records(ledger.root)
        self.window, self.poll_s, self.journal_s = max(1, window), poll_s, journal_s
        self._journaled = 0.0
        self._open: dict[int, _OpenShard] = {}
        self._queue: deque[tuple[int, int, Prepared]] = deque()     # (shard, position, request) not yet added
        self._in_flight: dict[str, tuple[int, int, Prepared, Collector | _Pooled]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._next_claim = 0.0
        self.summary = Summary()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stop_event(self) -> threading.Event:
        return self._stop

    def run(self) -> Summary:
        started = self._started = time.monotonic()
        renewer = threading.Thread(target=self._renew_leases, name="lease-renewer", daemon=True)
        renewer.start()
        try:
            while not self._stop.is_set():
                self._feed()
                if not self._in_flight:
                    if not self._wait_for_others():
                        break
                    continue
                self._collect(self.llm.step())
                if time.monotonic() - self._journaled >= self.journal_s:
                    self._write_journals()
        finally:
            self._stop.set()
            self._write_journals()
            self._give_back()
            self.summary.seconds = time.monotonic() - started
        return self.summary

    # feeding
    def _feed(self) -> None:
        while len(self._in_flight) < self.window and not self._stop.is_set():
            if not self._queue and not self._open_next_shard():
                return
            if not self._queue:
                continue
            index, pos, prep = self._queue.popleft()
            rid = f"{index}.{self._open[index].lease.gen}.{pos}"
            if prep.inputs is not None:
                self._add_inputs(index, pos, prep, rid)
                continue
            assert prep.valid is not None
            try:
                self.llm.add_request(rid, prep.valid.prompt_token_ids, prep.valid.params, prep.valid.images)
            except Exception as exc:  # noqa: BLE001 - the engine's own checks (ValueError) and anything odd
                self._finish(index, pos, error_line(prep.custom_id, "invalid_request", str(exc)), failed=True)
                continue
            self._in_flight[rid] = (index, pos, prep, Collector(prep.valid.input_length, Timings(time.monotonic())))

    def _add_inputs(self, index: int, pos: int, prep: Prepared, rid: str) -> None:
        assert prep.inputs is not None
        n = len(prep.inputs)
        parts = _Pooled([f"{rid}.{k}" for k in range(n)], [None] * n, n)
        for sub, ids in zip(parts.rids, prep.inputs):
            self.llm.add_request(sub, ids, PoolingParams(skip=prep.skip))
            self._in_flight[sub] = (index, pos, prep, parts)

    def _open_next_shard(self) -> bool:
        if time.monotonic() < self._next_claim:
            return False          # none was free a moment ago: no directory listing on every engine step
        lease = self.ledger.claim(self.holder)
        if lease is None:
            self._next_claim = time.monotonic() + self.poll_s
            return False
        shard = lease.shard
        records = self.records.read(shard.start, shard.stop)
        open_shard = _OpenShard(lease, [None] * len(shard), self.ledger.journal(lease))
        for pos, entry in self.ledger.resumed(lease, [r.custom_id for r in records]).items():
            open_shard.lines[pos] = entry.line
            open_shard.failed += entry.failed
            open_shard.tokens += entry.tokens
        resumed = len(shard) - open_shard.lines.count(None)
        self.summary.resumed += resumed
        with self._lock:
            self._open[shard.index] = open_shard
        logger.info("shard %d (records %d-%d) taken, lease %d%s", shard.index, shard.start, shard.stop - 1, lease.gen,
                    f"; {resumed} line(s) done already (its journals)" if resumed else "")
        if open_shard.finished:           # its last holder died between its last line and the commit
            self._commit(open_shard)
            return True
        for pos, record in enumerate(records):
            if open_shard.lines[pos] is not None:
                continue
            try:
                self._queue.append((shard.index, pos, prepare(self.state, record.custom_id, record.text)))
            except RequestError as exc:
                self._finish(shard.index, pos, error_line(record.custom_id, exc.code, exc.message, record.line_no),
                             failed=True)
            except Exception as exc:  # noqa: BLE001 - one odd line must not fail every job that takes its shard
                logger.exception("line %d could not be prepared", record.line_no)
                self._finish(shard.index, pos, error_line(record.custom_id, "internal_error",
                                                          f"{type(exc).__name__}: {exc}", record.line_no), failed=True)
        return True

    # results
    def _collect(self, outputs: list[Any]) -> None:
        for out in outputs:
            entry = self._in_flight.get(out.request_id)
            if entry is None:
                continue
            index, pos, prep, collector = entry
            if isinstance(collector, _Pooled):
                self._pooled(out, index, pos, prep, collector)
                continue
            try:
                gen = collector.add(out)
            except ServerError:
                del self._in_flight[out.request_id]
                self._finish(index, pos, error_line(prep.custom_id, "generation_failed",
                                                    out.error or f"ended early ({out.finish_reason})"), failed=True)
                continue
            if gen is not None:
                del self._in_flight[out.request_id]
                self.summary.generated_tokens += gen.generated_tokens
                self._finish(index, pos, response_line(self.state, prep, gen), tokens=gen.generated_tokens)

    def _pooled(self, out: Any, index: int, pos: int, prep: Prepared, parts: _Pooled) -> None:
        del self._in_flight[out.request_id]
        if out.error is not None or out.data is None:
            for rid in parts.rids:          # the line fails as a whole: its other inputs are not needed
                if self._in_flight.pop(rid, None) is not None:
                    self.llm.abort(rid)
            self._finish(index, pos, error_line(prep.custom_id, "embedding_failed", out.error or "no vector"),
                         failed=True)
            return
        parts.rows[int(out.request_id.rsplit(".", 1)[1])] = out.data
        parts.left -= 1
        if parts.left:
            return
        try:
            line, failed = embedding_line(self.state, prep, parts.rows), False
        except ServerError as exc:        # e.g. `dimensions` above the model's
            line, failed = error_line(prep.custom_id, "invalid_request", str(exc)), True
        tokens = sum(map(len, prep.inputs or []))
        self.summary.generated_tokens += tokens
        self._finish(index, pos, line, failed, tokens)

    def _finish(self, index: int, pos: int, line: str, failed: bool = False, tokens: int = 0) -> None:
        shard = self._open[index]
        shard.lines[pos] = line
        shard.failed += failed
        shard.tokens += tokens
        self.summary.requests += 1
        self.summary.failed += failed
        if shard.finished:
            self._commit(shard)
        else:
            shard.unjournaled.append(Entry(pos, line, failed, tokens))

    def _write_journals(self) -> None:
        self._journaled = time.monotonic()
        for shard in list(self._open.values()):
            shard.journal.append(shard.unjournaled)
            shard.unjournaled.clear()

    def _commit(self, shard: _OpenShard) -> None:
        lease = shard.lease
        committed = self.ledger.commit(lease, [line for line in shard.lines if line is not None], shard.failed,
                                       shard.tokens)
        with self._lock:
            del self._open[lease.shard.index]
        shard.journal.close()
        self.ledger.drop_journals(lease.shard.index)
        if committed:
            self.summary.shards_committed += 1
            logger.info("shard %d committed (%d/%d shards done); this worker: %d requests, %d failed, %.1f tok/s",
                        lease.shard.index, self.ledger.shards_done(), len(self.ledger.shards), self.summary.requests,
                        self.summary.failed, self.summary.generated_tokens / max(time.monotonic() - self._started, 1e-9))
        else:
            self.summary.lost_shards.append(lease.shard.index)
            logger.warning("shard %d was committed by another holder first; this copy is dropped", lease.shard.index)

    # leases
    def _wait_for_others(self) -> bool:
        """Nothing to do here: wait while other holders have shards open (False once the batch is complete, or
        when no shard is open anywhere: then a claim would have succeeded)."""
        progress = self.ledger.progress()
        expiry = self.ledger.next_expiry()
        if progress.complete:
            return False
        if expiry is None:        # nobody holds a shard, yet some are not done: claim again now, or stop
            retry, self._next_claim = self._next_claim > 0, 0.0
            return retry
        logger.info("no free shard; %s hold the rest (%d/%d done): waiting", ", ".join(progress.holders) or "nobody",
                    progress.done, progress.total)
        until_claim = self._next_claim - time.monotonic()
        self._stop.wait(max(min(expiry - self.ledger.clock(), self.poll_s), until_claim, 0.05))
        return True

    def _renew_leases(self) -> None:
        every = max(self.ledger.lease_s / 3, 0.05)
        while not self._stop.wait(every):
            with self._lock:
                leases = [s.lease for s in self._open.values()]
            for lease in leases:
                if not self.ledger.renew(lease) and self.ledger.commit_record(lease.shard.index) is None:
                    logger.warning("lost the lease on shard %d (another holder took it over)", lease.shard.index)

    def _give_back(self) -> None:
        with self._lock:
            leases = [s.lease for s in self._open.values()]
        for lease in leases:
            self.ledger.release(lease)
            logger.info("shard %d given back unfinished", lease.shard.index)
        for shard in list(self._open.values()):
            shard.journal.close()
        for rid in list(self._in_flight):
            self.llm.abort(rid)
        self.summary.stopped = bool(leases)

"""The batch ledger: which shards (ranges of input records) are done, and who holds the others.

A batch folder, on a filesystem every node of the cluster sees:

    manifest.json               what the batch is (input hash, model, options) and its shard size; written once
    leases/<shard>.<gen>        a holder's lease on a shard: created exclusively, renewed in place until it
                                expires; a reclaimer takes generation <gen>+1, so two reclaimers cannot both win
    parts/<shard>.<gen>.jsonl   the output lines of one shard, by the holder of lease <gen>, written before ...
    done/<shard>.json           ... the commit, which names that part; created exclusively: one commit per shard
    journal/<shard>.<gen>.jsonl the lines the holder of lease <gen> finished so far (journal.py): a holder that
                                takes the shard over runs only the others; deleted once the shard is committed

A part without a commit (the holder died between the two) is never read; the shard is done again under a
new lease. Two holders of one shard (a lease that expired while its holder still worked) both may write a
part, and only the first commit counts. So every shard is in the output exactly once.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tgi_hpc.batch.durable import create_exclusive, write_durable
from tgi_hpc.batch.journal import Entry, JournalWriter, count_entries, read_entries
from tgi_hpc.errors import TgiHpcError

DEFAULT_LEASE_S = 120.0
SHOWN_SHARDS = 4            # open shards named in a one-line progress (all of them in to_dict)
MANIFEST = "manifest.json"


class LedgerError(TgiHpcError):
    """The batch folder is not a ledger, or a commit does not fit its shard."""


@dataclass(frozen=True)
class Shard:
    index: int
    start: int        # first record, 0-based
    stop: int         # one past the last

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Lease:
    shard: Shard
    gen: int
    holder: str


@dataclass(frozen=True)
class OpenShard:
    """A shard not committed yet that someone holds or has worked on: its lines in the journals so far."""
    index: int
    done: int                   # lines finished (every lease's journal: they survive a requeue)
    total: int
    holder: str = ""            # "" when no live lease holds it (given back, or its holder died)

    def to_dict(self) -> dict:
        return {"shard": self.index, "done": self.done, "total": self.total, "holder": self.holder}


@dataclass
class Progress:
    total: int                  # records (requests) in the batch
    done: int                   # records finished: in committed shards, or in the journals of open ones
    failed: int                 # of those, error lines
    shards: int
    shards_done: int
    holders: list[str] = field(default_factory=list)   # who holds a live lease now
    tokens: int = 0             # generated (embedded, in an embedding batch) by the finished records
    elapsed_s: float = 0.0      # since the batch began (its manifest), queue waits included
    open_shards: list[OpenShard] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.shards_done == self.shards

    @property
    def committed(self) -> int:
        """Records in committed shards (`done` less the lines only journals hold so far)."""
        return self.done - sum(s.done for s in self.open_shards)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """At the pace so far (None before the first finished record)."""
        if self.complete:
            return 0.0
        return self.elapsed_s * (self.total - self.done) / self.done if self.done else None

    def to_dict(self) -> dict:
        return {"total": self.total, "done": self.done, "committed": self.committed, "failed": self.failed,
                "shards": self.shards, "shards_done": self.shards_done, "holders": self.holders,
                "complete": self.complete, "tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
                "requests_per_s": self.requests_per_s, "elapsed_s": self.elapsed_s, "eta_s": self.eta_s,
                "open_shards": [s.to_dict() for s in self.open_shards]}

    def describe(self, shards: bool = False) -> str:
        """`1200/2000 done, 3 failed, 850 tok/s, ETA 14m` (one line for status and --wait); with `shards`,
        the first open shards' lines too: `; shard 3 12/16 (12_0@cn1), shard 7 4/16 (+2 more)`."""
        line = f"{self.done}/{self.total} done, {self.failed} failed"
        if self.tokens:
            line += f", {self.tokens_per_s:.0f} tok/s"
        eta = self.eta_s
        if eta is not None and not self.complete:
            line += f", ETA {_duration(eta)}"
        line += " (complete)" if self.complete else ""
        if shards and self.open_shards:
            line += "; " + ", ".join(f"shard {s.index} {s.done}/{s.total}" + (f" ({s.holder})" if s.holder else "")
                                     for s in self.open_shards[:SHOWN_SHARDS])
            more = len(self.open_shards) - SHOWN_SHARDS
            line += f" (+{more} more)" if more > 0 else ""
        return line


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 60:.0f}m" if seconds >= 60 else f"{seconds:.0f}s"


def _json(data: dict) -> bytes:
    return (json.dumps(data, sort_keys=True) + "\n").encode()


class Ledger:
    """One batch folder. `clock` is wall time (leases are compared across nodes); tests pass their own."""

    def __init__(self, root: Path | str, *, lease_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.lease_s = lease_s
        self.clock = clock
        try:
            self.manifest = json.loads((self.root / MANIFEST).read_text())
            self.num_records = int(self.manifest["num_records"])
            self.shard_size = int(self.manifest["shard_size"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LedgerError(f"{self.root} is not a batch folder (its {MANIFEST} is missing or broken: {exc})") \
                from None
        if self.shard_size < 1 or self.num_records < 0:
            raise LedgerError(f"{self.root / MANIFEST}: shard_size must be >= 1 and num_records >= 0")
        self.shards = [Shard(i, start, min(start + self.shard_size, self.num_records))
                       for i, start in enumerate(range(0, self.num_records, self.shard_size))]

    @staticmethod
    def create(root: Path | str, manifest: dict) -> None:
        """Write the manifest (with num_records and shard_size) of a new batch folder; the folders under it."""
        root = Path(root)
        for sub in ("leases", "parts", "done", "journal"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        if not create_exclusive(root / MANIFEST, _json(manifest)):
            raise LedgerError(f"{root / MANIFEST} exists already")

    # paths
    def _lease_path(self, index: int, gen: int) -> Path:
        return self.root / "leases" / f"{index}.{gen}"

    def _part_path(self, index: int, gen: int) -> Path:
        return self.root / "parts" / f"{index}.{gen}.jsonl"

    def _done_path(self, index: int) -> Path:
        return self.root / "done" / f"{index}.json"

    def _journals(self, index: int) -> list[Path]:
        """Shard `index`'s journals, oldest lease first (none in a folder made before journals existed)."""
        found = []
        for path in (self.root / "journal").glob(f"{index}.*.jsonl"):
            gen = path.name[len(f"{index}."):-len(".jsonl")]
            if gen.isdigit():
                found.append((int(gen), path))
        return [path for _, path in sorted(found)]

    # reading the state
    def _latest_gens(self) -> dict[int, int]:
        latest: dict[int, int] = {}
        for name in (p.name for p in (self.root / "leases").iterdir()):
            index, dot, gen = name.partition(".")
            if dot and index.isdigit() and gen.isdigit():
                latest[int(index)] = max(latest.get(int(index), -1), int(gen))
        return latest

    def _read_lease(self, index: int, gen: int) -> dict | None:
        try:
            data = json.loads(self._lease_path(index, gen).read_text())
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None

    def _done_indices(self) -> set[int]:
        names = (p.name for p in (self.root / "done").iterdir())
        return {int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()}

    def shards_done(self) -> int:
        """How many shards are committed (one directory listing: cheap enough to call after every commit)."""
        return len(self._done_indices())

    def commit_record(self, index: int) -> dict | None:
        try:
            return json.loads(self._done_path(index).read_text())
        except FileNotFoundError:
            return None

    def progress(self) -> Progress:
        """Committed shards from their commits; the others from their journals (a status, not a resumption:
        a journal is not matched against the input)."""
        done, failed, tokens = 0, 0, 0
        indices = self._done_indices()
        for index in indices:
            record = self.commit_record(index) or {}
            done += int(record.get("lines", 0))
            failed += int(record.get("failed", 0))
            tokens += int(record.get("tokens", 0))
        now, holders, held = self.clock(), set(), {}
        for index, gen in self._latest_gens().items():
            lease = self._read_lease(index, gen)
            if index not in indices and lease and float(lease.get("expires", 0)) > now:
                held[index] = str(lease.get("holder", ""))
                holders.add(held[index])
        open_shards = []
        for index in sorted((self._journaled() | set(held)) - indices):
            if not 0 <= index < len(self.shards):
                continue
            entries = count_entries(self._journals(index), len(self.shards[index]))
            done += len(entries)
            failed += sum(e.failed for e in entries.values())
            tokens += sum(e.tokens for e in entries.values())
            open_shards.append(OpenShard(index, len(entries), len(self.shards[index]), held.get(index, "")))
        elapsed = max(0.0, now - float(self.manifest.get("created", now)))
        return Progress(self.num_records, done, failed, len(self.shards), len(indices), sorted(holders), tokens,
                        elapsed, open_shards)

    def _journaled(self) -> set[int]:
        """The shards that have a journal (one directory listing)."""
        try:
            names = [p.name for p in (self.root / "journal").iterdir()]
        except OSError:
            return set()
        return {int(n.split(".", 1)[0]) for n in names if n.endswith(".jsonl") and n.split(".", 1)[0].isdigit()}

    def next_expiry(self) -> float | None:
        """When the earliest live lease of an unfinished shard expires (None: no shard is held)."""
        done, expiries = self._done_indices(), []
        for index, gen in self._latest_gens().items():
            lease = self._read_lease(index, gen)
            if index not in done and lease is not None:
                expiries.append(float(lease.get("expires", 0)))
        return min(expiries) if expiries else None

    # holding shards
    def _lease_bytes(self, holder: str, index: int, gen: int, expires: float) -> bytes:
        return _json({"holder": holder, "shard": index, "gen": gen, "expires": expires})

    def claim(self, holder: str) -> Lease | None:
        """The first shard neither done nor held by a live lease, now held by `holder`; None if there is none."""
        done, latest, now = self._done_indices(), self._latest_gens(), self.clock()
        for shard in self.shards:
            if shard.index in done:
                continue
            gen = latest.get(shard.index)
            if gen is not None:
                lease = self._read_lease(shard.index, gen)
                if lease is not None and float(lease.get("expires", 0)) > now:
                    continue
            new = 0 if gen is None else gen + 1
            if not create_exclusive(self._lease_path(shard.index, new),
                                    self._lease_bytes(holder, shard.index, new, now + self.lease_s)):
                continue          # another holder took it first
            if self._done_path(shard.index).exists():   # committed since we listed: nothing to do
                continue
            return Lease(shard, new, holder)
        return None

    def holds(self, lease: Lease) -> bool:
        """False once another holder reclaimed the shard (this lease had expired) or it is committed."""
        return not self._lease_path(lease.shard.index, lease.gen + 1).exists() and \
            not self._done_path(lease.shard.index).exists()

    def renew(self, lease: Lease) -> bool:
        if not self.holds(lease):
            return False
        write_durable(self._lease_path(lease.shard.index, lease.gen),
                      self._lease_bytes(lease.holder, lease.shard.index, lease.gen, self.clock() + self.lease_s))
        return self.holds(lease)

    def release(self, lease: Lease) -> None:
        """Give an unfinished shard back now (the holder is stopping), instead of when its lease expires."""
        if self.holds(lease):
            write_durable(self._lease_path(lease.shard.index, lease.gen),
                          self._lease_bytes(lease.holder, lease.shard.index, lease.gen, 0.0))

    # the work inside an open shard
    def journal(self, lease: Lease) -> JournalWriter:
        """Where this lease's holder appends the lines it finishes before the commit."""
        return JournalWriter(self.root / "journal" / f"{lease.shard.index}.{lease.gen}.jsonl")

    def resumed(self, lease: Lease, custom_ids: Sequence[str]) -> dict[int, Entry]:
        """The lines earlier holders of this shard finished (their journals), by position in the shard."""
        if len(custom_ids) != len(lease.shard):
            raise LedgerError(f"shard {lease.shard.index} has {len(lease.shard)} records, got {len(custom_ids)} ids")
        return read_entries(self._journals(lease.shard.index), custom_ids)

    def drop_journals(self, index: int) -> None:
        """Once shard `index` is committed its journals are not needed."""
        for path in self._journals(index):
            path.unlink(missing_ok=True)

    # committing
    def write_part(self, lease: Lease, lines: Sequence[str]) -> None:
        """Step 1 of a commit: the shard's output lines, one per record, durable under this lease's name."""
        if len(lines) != len(lease.shard):
            raise LedgerError(f"shard {lease.shard.index} has {len(lease.shard)} records, got {len(lines)} lines")
        if any("\n" in line for line in lines):
            raise LedgerError("an output line contains a newline")
        write_durable(self._part_path(lease.shard.index, lease.gen), "".join(f"{line}\n" for line in lines).encode())

    def record(self, lease: Lease, failed: int = 0, tokens: int = 0) -> bool:
        """Step 2: the commit. False when the shard was committed already (by a holder whose lease ours replaced)."""
        if not self._part_path(lease.shard.index, lease.gen).exists():
            raise LedgerError(f"no part written for shard {lease.shard.index} under lease {lease.gen}")
        return create_exclusive(self._done_path(lease.shard.index), _json(
            {"shard": lease.shard.index, "gen": lease.gen, "holder": lease.holder, "lines": len(lease.shard),
             "failed": failed, "tokens": tokens, "committed_at": self.clock()}))

    def commit(self, lease: Lease, lines: Sequence[str], failed: int = 0, tokens: int = 0) -> bool:
        self.write_part(lease, lines)
        return self.record(lease, failed, tokens)

    def committed_lines(self, index: int) -> list[str]:
        """The committed output lines of shard `index` (the part its commit names)."""
        record = self.commit_record(index)
        if record is None:
            raise LedgerError(f"shard {index} is not committed")
        text = self._part_path(index, int(record["gen"])).read_text()
        lines = text.splitlines()
        if len(lines) != len(self.shards[index]):
            raise LedgerError(f"shard {index}'s part has {len(lines)} lines, expected {len(self.shards[index])}")
        return lines

"""A shard's journal: the lines finished inside a shard that is not committed yet, so that they survive a
requeue, a scancel or a SIGKILL of its holder, whatever the shard size and the time limit.

`journal/<shard>.<gen>.jsonl` is written only by the holder of lease <gen>: one entry per finished record,
`{"pos", "failed", "tokens", "line"}` (`line` is the output line itself), appended in one write and fsync'ed.
The holder that takes the shard over next reads every generation's journal and runs only the records none of
them has. A holder killed mid-write leaves a torn last line: without its newline, or not a whole entry, or
not the line of the record at `pos`; it is dropped (that record runs again). The commit (ledger.py) stays
the only source of the output: a journal is read only to resume its shard, and is deleted once the shard is
committed.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tgi_hpc.batch.durable import fsync_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    pos: int          # the record's place in its shard
    line: str         # its output line
    failed: bool = False
    tokens: int = 0

    def to_bytes(self) -> bytes:
        return (json.dumps({"pos": self.pos, "failed": self.failed, "tokens": self.tokens, "line": self.line})
                + "\n").encode()


class JournalWriter:
    """Appends entries to one lease's journal. A write that fails (disk full, a lost mount) turns the journal
    off with a warning: the shard still commits from memory, only its resumption after a kill is lost."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self._broken = False

    def append(self, entries: Sequence[Entry]) -> None:
        if not entries or self._broken:
            return
        data = b"".join(e.to_bytes() for e in entries)
        try:
            if self._fd is None:
                self.path.parent.mkdir(exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                fsync_dir(self.path.parent)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError as exc:
            self._broken = True
            logger.warning("journal %s: %s; this shard's finished lines are kept in memory only", self.path, exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_entries(paths: Iterable[Path], custom_ids: Sequence[str]) -> dict[int, Entry]:
    """The whole entries of `paths` (a shard's journals), by position; the first one of a position counts.
    `custom_ids[pos]` is the id of the record at `pos`: an entry whose line answers another id is dropped."""
    found: dict[int, Entry] = {}
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        *whole, torn = data.split(b"\n")
        if torn:
            logger.info("journal %s: dropping a torn last line (%d bytes)", path, len(torn))
        for raw in whole:
            entry = _entry(raw, len(custom_ids), custom_ids)
            if entry is None:
                logger.warning("journal %s: dropping a line that is not an entry of this shard", path)
            elif entry.pos not in found:
                found[entry.pos] = entry
    return found


def count_entries(paths: Iterable[Path], size: int) -> dict[int, Entry]:
    """What `tgi-hpc status` reads: the whole entries of a shard of `size` records, by position, without the
    input's ids (a line is not matched to its record: a count, not a resumption)."""
    found: dict[int, Entry] = {}
    for path in paths:
        try:
            whole = path.read_bytes().split(b"\n")[:-1]
        except OSError:
            continue
        for raw in whole:
            entry = _entry(raw, size)
            if entry is not None and entry.pos not in found:
                found[entry.pos] = entry
    return found


def _entry(raw: bytes, size: int, custom_ids: Sequence[str] | None = None) -> Entry | None:
    try:
        data = json.loads(raw)
        pos, line, failed, tokens = data["pos"], data["line"], data["failed"], data["tokens"]
        if not (type(pos) is int and 0 <= pos < size and isinstance(line, str) and "\n" not in line
                and isinstance(failed, bool) and type(tokens) is int and tokens >= 0):
            return None
        if custom_ids is not None and json.loads(line).get("custom_id") != custom_ids[pos]:
            return None
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None
    return Entry(pos, line, failed, tokens)

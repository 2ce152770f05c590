"""A batch's input: copied into the batch folder (hashed on the way), indexed by record, one id per record.

A record is a non-blank line. Its id is the line's `custom_id` (OpenAI Batch), or its 1-based line number
for a plain `{"prompt": ...}` / `{"messages": ...}` line and for a line that is not even JSON (it becomes an
error line under that id). The jobs read records through the index, never the user's file, which may change.
The scan also notes which lines are /v1/embeddings and which generate: one batch file is one kind (OpenAI's
Batch API takes one `endpoint` for all of a file's requests; here one model answers them all).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tgi_hpc.batch.durable import fsync_dir, write_durable

INPUT = "input.jsonl"
INDEX = "index.json"


@dataclass(frozen=True)
class Record:
    line_no: int          # 1-based line of the input
    custom_id: str
    text: str


@dataclass(frozen=True)
class Scan:
    sha256: str
    size: int
    num_records: int
    duplicates: list[tuple[str, list[int]]]    # (custom_id, its line numbers) for every id used twice
    kinds: dict[str, list[int]] = field(default_factory=dict)   # "embed"/"generate": line numbers (first 5)


EMBEDDINGS_URL = "/v1/embeddings"
GENERATION_URLS = ("/v1/chat/completions", "/v1/completions")


def custom_id_of(text: str, line_no: int) -> str:
    return _read(text, line_no)[0]


def _read(text: str, line_no: int) -> tuple[str, str | None]:
    """(custom_id, kind): kind is "embed", "generate", or None for a line that will be an error line anyway."""
    try:
        data = json.loads(text)
    except ValueError:
        return str(line_no), None
    if not isinstance(data, dict):
        return str(line_no), None
    found = data.get("custom_id")
    url = data.get("url")
    kind = "embed" if url == EMBEDDINGS_URL else "generate" if url in GENERATION_URLS or \
        (url is None and ("messages" in data or "prompt" in data)) else None
    return (found if isinstance(found, str) and found else str(line_no)), kind


def copy_input(src: Path, batch_dir: Path) -> Scan:
    """Copy `src` to the batch folder durably, and write the index of its records."""
    digest, offsets, size = hashlib.sha256(), [], 0
    kinds: dict[str, list[int]] = {}
    dst = batch_dir / INPUT
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for line_no, raw in enumerate(fin, start=1):
            digest.update(raw)
            fout.write(raw)
            text = raw.decode("utf-8", errors="replace").strip()
            if text:
                cid, kind = _read(text, line_no)
                offsets.append([size, line_no, cid])
                if kind is not None and len(kinds.setdefault(kind, [])) < 5:
                    kinds[kind].append(line_no)
            size += len(raw)
        fout.flush()
        os.fsync(fout.fileno())
    fsync_dir(batch_dir)
    write_durable(batch_dir / INDEX, json.dumps(offsets).encode())
    counts = Counter(cid for _, _, cid in offsets)
    duplicates = [(cid, [ln for _, ln, c in offsets if c == cid]) for cid, n in counts.items() if n > 1]
    return Scan(digest.hexdigest(), size, len(offsets), duplicates, kinds)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Records:
    """Records [start, stop) of a batch folder's input copy."""

    def __init__(self, batch_dir: Path | str):
        self.batch_dir = Path(batch_dir)
        self.index = json.loads((self.batch_dir / INDEX).read_text())

    def __len__(self) -> int:
        return len(self.index)

    def ids(self) -> list[str]:
        return [cid for _, _, cid in self.index]

    def read(self, start: int, stop: int) -> list[Record]:
        out = []
        with open(self.batch_dir / INPUT, "rb") as fh:
            for offset, line_no, cid in self.index[start:stop]:
                fh.seek(offset)
                out.append(Record(line_no, cid, fh.readline().decode("utf-8", errors="replace").strip()))
        return out

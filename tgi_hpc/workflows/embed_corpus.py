"""Embed a JSONL corpus through a pooling model's server, with a progress bar and an ETA (no torch).

    python -m tgi_hpc.workflows.embed_corpus corpus.jsonl vectors.jsonl --url http://127.0.0.1:8080
    eval "$(tgi-hpc endpoint NAME)" && python -m tgi_hpc.workflows.embed_corpus corpus.jsonl vectors.jsonl

Each input line is a JSON object with the text under `--field` (default "text"); each output line is
{"id": the line's "id" or its line number, "embedding": [...]}, in input order. Texts longer than the model
takes are cut (as sentence-transformers does) unless --no-truncate. A corpus to search is embedded with
`--input-type document` (queries with `query`): the model's sentence-transformers prompts, as encode_document and
encode_query pick them (`--prompt-name` names one). Batches of `--batch-size`
texts go to /v1/embeddings (ServiceClient: a service's READY replicas, retried on another one when one
drains). The output is written beside the target and renamed into place at the end, so a half-finished run
never looks like a finished one.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tgi_hpc.service.client import ServiceClient


def _records(source: Path, field: str) -> Iterator[tuple[Any, str]]:
    with source.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{source}:{number}: not JSON ({exc.msg})") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str) or not text:
                raise ValueError(f"{source}:{number}: no non-empty string under {field!r}")
            yield record.get("id", number), text


def embed_jsonl(client: ServiceClient, source: Path, target: Path, *, field: str = "text", batch_size: int = 256,
                dimensions: int | None = None, progress: bool = True, truncate: bool = True,
                prompt: dict[str, str] | None = None) -> int:
    """Embed every line of `source` into `target`; returns the number of texts."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    total = sum(1 for _ in _records(source, field))  # checks every line before the first request
    tmp = target.with_name(f".{target.name}.partial")
    columns = (TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TextColumn("ETA"), TimeRemainingColumn())
    try:
        options = dict(dimensions=dimensions, truncate=truncate, **(prompt or {}))
        done = _write(client, source, field, batch_size, options, tmp, Progress(*columns, disable=not progress), total)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
    return done


def _write(client: ServiceClient, source: Path, field: str, batch_size: int, options: dict[str, Any], tmp: Path,
           progress: Any, total: int) -> int:
    done = 0
    with tmp.open("w", encoding="utf-8") as out, progress as bar:
        task = bar.add_task("embed", total=total)
        batch: list[tuple[Any, str]] = []
        for item in itertools.chain(_records(source, field), [None]):
            if item is not None:
                batch.append(item)
            if batch and (item is None or len(batch) == batch_size):
                vectors = client.embed([text for _, text in batch], batch_size=batch_size, **options)
                for (key, _), vector in zip(batch, vectors):
                    out.write(json.dumps({"id": key, "embedding": vector}) + "\n")
                done += len(batch)
                bar.update(task, advance=len(batch))
                batch = []
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--url", action="append", help="a server's URL (repeat for several); default: from "
                                                       "`tgi-hpc endpoint` exports (TGI_HPC_SERVICE_STATE / _URLS)")
    parser.add_argument("--field", default="text")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dimensions", type=int, default=None)
    parser.add_argument("--input-type", choices=("query", "document"), default=None,
                        help="the model's query or document prompt (sentence-transformers' encode_query / "
                             "encode_document); default: its default prompt, if any")
    parser.add_argument("--prompt-name", default=None, help="one of the model's sentence-transformers prompts")
    parser.add_argument("--no-truncate", action="store_true", help="fail on a text longer than the model takes "
                                                                  "(default: cut it, as sentence-transformers does)")
    args = parser.parse_args(argv)
    try:
        client = ServiceClient(urls=args.url, api_key=os.environ.get("TGI_HPC_API_KEY") or None) if args.url \
            else ServiceClient.from_env()
        with client:
            count = embed_jsonl(client, args.source, args.target, field=args.field, batch_size=args.batch_size,
                                dimensions=args.dimensions, progress=sys.stderr.isatty(), truncate=not args.no_truncate,
                                prompt={k: v for k, v in (("prompt_name", args.prompt_name),
                                                          ("input_type", args.input_type)) if v})
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPStatusError as exc:  # the server's own message, e.g. a 422 naming the input
        print(f"error: {exc.response.status_code} from the server: {exc.response.text[:500]}", file=sys.stderr)
        return 1
    print(f"{count} embeddings -> {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

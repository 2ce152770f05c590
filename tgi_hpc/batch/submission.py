"""`tgi-hpc batch`: make or reopen the batch folder, submit the jobs that run it, follow it to the output.

The batch folder sits next to the output (`results.jsonl.tgi-batch/`), so the same command run again finds
it: it goes on from the ledger instead of starting over, submits jobs only when none of the batch's jobs is
still queued or running, and writes the output once every shard is committed. A changed input or model is
refused unless `restart`, which moves the old folder aside and stops its jobs.
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tgi_hpc.batch.assembly import assemble
from tgi_hpc.batch.durable import write_durable
from tgi_hpc.batch.inputs import copy_input, file_sha256
from tgi_hpc.batch.ledger import DEFAULT_LEASE_S, Ledger, Progress
from tgi_hpc.errors import JobFailedError, ReadinessTimeout, UsageError
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.jobspec import BatchSpec
from tgi_hpc.workflows.serve import ServeOptions, build_serve_spec, check_before_submit, cluster_path, release_dir

SUFFIX = ".tgi-batch"
JOBS = "jobs.json"


@dataclass
class BatchOptions:
    serve: ServeOptions           # model, GPUs, time, limits, engine flags: as `serve` takes them
    input: str
    output: str
    jobs: int = 1
    # records per shard; default: about 8 shards per job, 4 to 256 records. Not sized to the time limit: the
    # shard's journal keeps its finished lines across requeues and kills, so any size ends (journal.py)
    shard_size: int | None = None
    lease_s: float = DEFAULT_LEASE_S
    restart: bool = False
    requeue: bool = True              # requeue before the time limit (Slurm profiles)
    workers: int = 1                  # engine processes per job (engine.offline --workers): CPU, small models


@dataclass
class BatchResult:
    batch_dir: str
    output: str
    progress: dict
    submitted: list[str] = field(default_factory=list)   # job ids (Slurm: one job array, its tasks ID_0...)
    running: list[str] = field(default_factory=list)    # the batch's jobs already queued or running
    script: str = ""

    @property
    def complete(self) -> bool:
        return bool(self.progress.get("complete"))

    def to_dict(self) -> dict:
        return {"batch_dir": self.batch_dir, "output": self.output, "progress": self.progress,
                "submitted": self.submitted, "running": self.running, "complete": self.complete}

    def summary(self) -> str:
        p = self.progress
        lines = [f"batch {self.batch_dir}: {p['done']}/{p['total']} requests done, {p['failed']} failed"
                 + (f", {p['tokens_per_s']:.0f} tok/s" if p.get("tokens") else "")]
        if self.complete:
            lines.append(f"  output: {self.output}")
        if self.submitted:
            lines.append(f"  submitted job(s): {' '.join(self.submitted)}")
        if self.running:
            lines.append(f"  still running: {' '.join(self.running)} (run the same command again to see progress)")
        return "\n".join(lines)


def batch_dir_of(output: Path) -> Path:
    return output.with_name(output.name + SUFFIX)


# engine flags that size the batch or the cache, not the answers: a rerun may change them
CAPACITY_FLAGS = {"--max-concurrent-requests", "--max-batch-prefill-tokens", "--max-batch-total-tokens",
                  "--max-batch-size", "--kv-cache-bytes", "--cuda-memory-fraction", "--cpu-threads"}


def identity_of(model: str, revision: str, engine_args: tuple[str, ...]) -> dict:
    """What the answers depend on besides the input: a rerun with another value is a different batch."""
    kept, words = [], list(engine_args)
    while words:
        word = words.pop(0)
        flag, eq, _ = word.partition("=")
        if flag in CAPACITY_FLAGS:
            if not eq and words and not words[0].startswith("--"):
                words.pop(0)
            continue
        kept.append(word)
    return {"model": model, "revision": revision, "engine_args": kept}


def prepare(batch_dir: Path, src: Path, output: Path, identity: dict, *, shard_size: int | None, jobs_count: int,
            lease_s: float, restart: bool, on_restart: Callable[[Path], None] = lambda old: None) -> Ledger:
    """The batch folder for this input and identity: reopened when it matches, else made (with `restart`)."""
    if not src.is_file():
        raise UsageError(f"--input {src}: no such file")
    manifest_path = batch_dir / "manifest.json"
    if manifest_path.exists():
        ledger = Ledger(batch_dir, lease_s=lease_s)
        changes = []
        if ledger.manifest.get("input_sha256") != file_sha256(src):
            changes.append(f"the input {src} changed")
        if ledger.manifest.get("identity") != identity:
            changes.append(f"the model or engine options changed (was {ledger.manifest.get('identity')})")
        if not changes and not restart:
            return ledger
        if changes and not restart:
            raise UsageError(f"{'; '.join(changes)} since batch {batch_dir} began ({ledger.progress().done} requests "
                             "done): pass --restart to start over, or another --output")
        aside = batch_dir.with_name(f"{batch_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        on_restart(batch_dir)
        batch_dir.rename(aside)
    elif batch_dir.exists():
        shutil.rmtree(batch_dir)     # a folder from a prepare that died before its manifest: nothing ran in it
    tmp = batch_dir.with_name(f".{batch_dir.name}.new")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    scan = copy_input(src, tmp)
    if scan.duplicates:
        shutil.rmtree(tmp)
        shown = "; ".join(f"{cid!r} on lines {', '.join(map(str, lines))}" for cid, lines in scan.duplicates[:5])
        raise UsageError(f"--input {src}: a custom_id must be unique (the output has one line per id): {shown}")
    if len(scan.kinds) > 1:
        shutil.rmtree(tmp)
        raise UsageError(f"--input {src} mixes /v1/embeddings lines (lines {_lines(scan.kinds['embed'])}) with "
                         f"chat or completion lines (lines {_lines(scan.kinds['generate'])}): one batch file is one "
                         "kind of request, as OpenAI's Batch API has one endpoint per file (one model answers "
                         "them all): split it into two batches")
    if not scan.num_records:
        shutil.rmtree(tmp)
        raise UsageError(f"--input {src} has no requests")
    size = shard_size or min(256, max(4, -(-scan.num_records // (8 * jobs_count))))
    Ledger.create(tmp, {"num_records": scan.num_records, "shard_size": size, "input": str(src),
                        "input_sha256": scan.sha256, "output": str(output), "identity": identity,
                        "lease_s": lease_s, "created": time.time()})
    tmp.rename(batch_dir)
    return Ledger(batch_dir, lease_s=lease_s)


def _lines(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers)) + (", ..." if len(numbers) >= 5 else "")


def _job_ids(batch_dir: Path) -> list[str]:
    try:
        return list(json.loads((batch_dir / JOBS).read_text()))
    except (OSError, ValueError):
        return []


def _active(cluster: Cluster, ids: list[str]) -> list[str]:
    """Those of `ids` still queued or running; a job array while any of its tasks is (Slurm lists the tasks,
    4148_0 or 4148_[1-3] when pending, not the array's own id)."""
    if not ids:
        return []
    states = cluster.backend.states(ids)
    return [j for j in ids if any(not job.is_final for key, job in states.items() if key.split("_")[0] == j)]


def run_batch(cluster: Cluster, opts: BatchOptions, *, release: str | None = None, dry_run: bool = False,
              wait: bool = False, timeout: float = 24 * 3600, progress: Callable[[str], None] = lambda m: None,
              poll_s: float = 2.0, watch: Callable[[Progress], None] | None = None) -> BatchResult:
    """Make or reopen the batch, submit its jobs unless some still run, and with `wait` follow it to the
    output: `watch` gets the ledger's Progress at every poll (default: a `progress` line per change)."""
    if opts.serve.other_models or opts.serve.loras or (opts.serve.nodes or 1) > 1:
        raise UsageError("a batch runs one model on one node (no second --model, --lora or --nodes yet)")
    if opts.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    serve = build_serve_spec(cluster, opts.serve, offline=dry_run and not cluster.is_local)
    rel = release_dir(cluster, release)
    src, output = Path(cluster_path(cluster, opts.input)), Path(cluster_path(cluster, opts.output))
    batch_dir = batch_dir_of(output)
    # Slurm: one job array, a task per holder; without Slurm (--cluster local): that many jobs
    spec = BatchSpec(kind="batch", resources=serve.resources, keep_alive=opts.requeue, env=serve.env,
                     model=serve.model, model_dir=serve.model_dir, num_shard=serve.num_shard,
                     engine_args=serve.engine_args, batch_dir=str(batch_dir), workers=opts.workers,
                     array_size=opts.jobs if cluster.uses_slurm else 0)
    if dry_run:
        return BatchResult(str(batch_dir), str(output), {}, script=jobs.render(cluster, spec, release_dir=rel))
    if not cluster.is_local:
        raise UsageError("tgi-hpc batch reads and writes the batch's files directly: run it on the cluster's "
                         "login node (or with --cluster local), not through SSH from a laptop")
    identity = identity_of(opts.serve.model, opts.serve.revision, serve.engine_args)
    ledger = prepare(batch_dir, src, output, identity, shard_size=opts.shard_size,
                     jobs_count=opts.jobs * opts.workers, lease_s=opts.lease_s, restart=opts.restart,
                     on_restart=lambda old: _stop_jobs(cluster, old, progress))
    result = BatchResult(str(batch_dir), str(output), ledger.progress().to_dict())
    if result.complete:
        assemble(ledger, output)
        return result
    result.running = _active(cluster, _job_ids(batch_dir))
    if not result.running:
        check_before_submit(cluster, serve, rel, explicit_release=release is not None)
        for _ in range(1 if spec.array_size else opts.jobs):
            sub = jobs.submit(cluster, spec, release_dir=rel)
            result.submitted.append(str(sub.job_id))
            write_durable(batch_dir / JOBS, json.dumps(_job_ids(batch_dir) + [str(sub.job_id)]).encode())
        what = f"job array {result.submitted[0]} ({opts.jobs} tasks)" if spec.array_size else \
            f"{opts.jobs} job(s) {' '.join(result.submitted)}"
        progress(f"submitted {what} for {ledger.num_records} requests in {len(ledger.shards)} shards")
    if wait:
        result.progress = follow(cluster, ledger, result.submitted + result.running, timeout=timeout,
                                 progress=progress, poll_s=poll_s, watch=watch)
    return result


def line_per_change(progress: Callable[[str], None]) -> Callable[[Progress], None]:
    """A `watch` that says `batch: 12/40 done, ...` each time done or failed moves (plain logs, no terminal)."""
    last: list[tuple[int, int]] = []

    def watch(p: Progress) -> None:
        if [(p.done, p.failed)] != last:
            progress(f"batch: {p.describe()}")
            last[:] = [(p.done, p.failed)]
    return watch


def follow(cluster: Cluster, ledger: Ledger, job_ids: list[str], *, timeout: float,
           progress: Callable[[str], None], poll_s: float = 2.0,
           watch: Callable[[Progress], None] | None = None) -> dict:
    """Until the batch is complete (then the output is written); `watch` sees every poll's Progress."""
    deadline = time.monotonic() + timeout
    watch = watch or line_per_change(progress)
    while True:
        p = ledger.progress()
        watch(p)
        if p.complete:
            output = Path(ledger.manifest["output"])
            assemble(ledger, output)
            return p.to_dict()
        if not _active(cluster, job_ids):
            time.sleep(poll_s)          # the last job may have committed as it ended
            if ledger.progress().complete:
                continue
            raise JobFailedError(f"the batch's jobs ({' '.join(job_ids)}) ended with {p.done}/{p.total} requests done; "
                                 f"run the same command again to go on (see `tgi-hpc logs {ledger.root}`)")
        if time.monotonic() > deadline:
            raise ReadinessTimeout(f"the batch is at {p.done}/{p.total} after {timeout:.0f} s; its jobs keep running")
        time.sleep(poll_s)


def _stop_jobs(cluster: Cluster, batch_dir: Path, progress: Callable[[str], None]) -> None:
    active = _active(cluster, _job_ids(batch_dir))
    if active:
        progress(f"--restart: stopping the old batch's jobs {' '.join(active)}")
        cluster.backend.cancel(active)


"""Issue 26's done-when run: a batch that survives time limits, a scancel and a SIGKILL, checked line by line.

    source /tmp/tgi-hpc-cluster/env.sh      # the local Slurm cluster (docs/testing.md)
    python scripts/batch_done_when.py --requests 2000 --max-tokens 24 [--model PATH] [--time 4]

1. The reference: the same requests through one uninterrupted `python -m engine.offline` on this machine (no
   Slurm), with the same engine flags. Its wall time and tok/s are printed.
2. `tgi-hpc batch --jobs 2 --time T` on the local cluster: a job array whose tasks requeue themselves before
   the time limit (the profile's requeue signal). Once every task has been requeued `--resumptions` times,
   task 0 is scancel'ed (`tgi-hpc stop`) and task 1's engine SIGKILLed mid-shard.
3. The same command again, with `--wait`: a new array goes on from the ledger to the end (again, should that
   array's tasks run out of requeues; the profile allows `--max-requeues` per task).
4. Checks: exactly one line per custom_id in input order, no error line, every answer equal to the reference's,
   and none of the batch's jobs left in the queue. A JSON summary goes to stdout; exit 1 when a check fails.

tests/cluster/test_batch.py is the small-N variant in the suite (a tiny model; the requeue forced by the signal
Slurm sends before a time limit, not by waiting for one).
"""
from __future__ import annotations

import argparse
import re
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPICS = ["the sea", "a cat", "bread", "winter", "a bicycle", "the moon", "coffee", "a library", "rain", "music",
          "a mountain", "chess", "a garden", "trains", "honey", "a lighthouse", "paper", "the desert", "owls", "glass"]


def requests(n: int, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": f"In one sentence, tell me fact {i // len(TOPICS)} "
                                                               f"about {TOPICS[i % len(TOPICS)]}."}],
                      "max_tokens": max_tokens, "temperature": 0}} for i in range(n)]


def answers(path: Path) -> dict[str, str | None]:
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        body = (row.get("response") or {}).get("body")
        out[row["custom_id"]] = body["choices"][0]["message"]["content"] if body else None
    return out


def runner_seconds(log: str) -> float | None:
    """First 'taken' to last 'committed' log stamp: the runner's work, to the millisecond."""
    times = []
    for m in re.finditer(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO engine\.offline\.runner: shard \d+ .*?"
                         r"(taken|committed)", log, re.M):
        times.append((m.group(3), time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3))
    taken = [t for kind, t in times if kind == "taken"]
    committed = [t for kind, t in times if kind == "committed"]
    return (max(committed) - min(taken)) if taken and committed else None


def reference(model: str, src: Path, work: Path, engine_args: list[str]) -> dict:
    """The uninterrupted run: one engine.offline process over the whole batch, here."""
    from tgi_hpc.batch.submission import batch_dir_of, identity_of, prepare
    out = work / "reference.jsonl"
    batch_dir = batch_dir_of(out)
    prepare(batch_dir, src, out, identity_of(model, "main", tuple(engine_args)), shard_size=None, jobs_count=1,
            lease_s=600, restart=True)
    started = time.monotonic()
    log = work / "reference.log"
    with log.open("w") as fh:
        subprocess.run([sys.executable, "-m", "engine.offline", "--batch-dir", str(batch_dir), "--model-id", model,
                        *engine_args], check=True, stdout=fh, stderr=subprocess.STDOUT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.monotonic() - started
    return {"output": str(out), "wall_s": round(wall, 1), **reference_summary(work)}


def reference_summary(work: Path) -> dict:
    text = (work / "reference.log").read_text()
    said = [line for line in text.splitlines() if "this worker:" in line]
    seconds = runner_seconds(text)
    return {"worker": said[-1].split("this worker: ")[-1] if said else "",
            "runner_s": round(seconds, 1) if seconds else None}


class Cli:
    def __init__(self, profile: str, jobs_dir: Path, overrides: list[str]):
        self.profile, self.jobs_dir, self.overrides = profile, jobs_dir, overrides
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        sets = [w for o in [f"paths.jobs={self.jobs_dir}", *self.overrides] for w in ("--set", o)]
        argv = [sys.executable, "-m", "tgi_hpc", args[0], "--cluster", self.profile, *sets, *args[1:]]
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"tgi-hpc {' '.join(args)} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out


def job_fields(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def engine_pid(holder_prefix: str, batch_dir: Path) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if "engine.offline" in words and str(batch_dir) in words and any(w.startswith(holder_prefix) for w in words):
            return int(entry.name)
    return None


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="default: SmolLM2 from scripts/make_models.py")
    parser.add_argument("--time", default="4", help="Slurm time limit per task (minutes); the local profile's "
                        "requeue signal comes 120 s before it")
    parser.add_argument("--max-requeues", type=int, default=20)
    parser.add_argument("--shard-size", default="16", help="small: a shard open at a requeue is done again")
    parser.add_argument("--resumptions", type=int, default=2, help="requeues per task before the interruptions")
    parser.add_argument("--work", default="/tmp/batch-done-when")
    parser.add_argument("--skip-reference", action="store_true", help="reuse WORK/reference.jsonl")
    args = parser.parse_args()
    profile = os.environ.get("TGI_HPC_CLUSTER_PROFILE")
    if not profile:
        parser.error("source /tmp/tgi-hpc-cluster/env.sh first (the local cluster)")
    model = args.model or subprocess.run([sys.executable, str(ROOT / "scripts/make_models.py"), "smollm2",
                                          "--print-path"], capture_output=True, text=True, check=True).stdout.strip()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = work / "requests.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests(args.requests, args.max_tokens)))
    engine_args = ["--max-concurrent-requests", "64", "--max-total-tokens", "512", "--kv-cache-bytes", "256MiB",
                   "--cpu-threads", "1"]
    summary: dict = {"requests": args.requests, "max_tokens": args.max_tokens, "model": model, "time_limit_min": args.time}
    if not args.skip_reference:
        log("reference: one uninterrupted engine.offline run here")
        summary["reference"] = reference(model, src, work, engine_args)
        log(f"reference: {summary['reference']}")
    else:
        summary["reference"] = reference_summary(work)
    expected = answers(work / "reference.jsonl")

    from tgi_hpc.batch.ledger import Ledger
    cli = Cli(profile, work / "jobs", [f"slurm.max_requeues={args.max_requeues}"])
    out = work / "results.jsonl"
    batch_args = ["--model", model, "--input", str(src), "--output", str(out), "--jobs", "2", "--time", args.time,
                  "--release", sys.prefix, "--lease", "20", "--partition", "long", "--restart", "--shard-size", args.shard_size,
                  "--max-concurrent-requests", "64", "--max-total-tokens", "512",
                  "--engine-arg", "--kv-cache-bytes=256MiB", "--engine-arg", "--cpu-threads=1"]
    started = time.monotonic()
    first = json.loads(cli("batch", *batch_args, "--json").stdout)
    batch_args.remove("--restart")
    [array] = first["submitted"]
    tasks = [f"{array}_0", f"{array}_1"]
    batch_dir = Path(first["batch_dir"])
    ledger = Ledger(batch_dir)
    restarts = {t: 0 for t in tasks}
    log(f"array {array}: waiting for {args.resumptions} requeue(s) per task")
    while True:
        for t in tasks:
            restarts[t] = max(restarts[t], int(job_fields(t).get("Restarts", "0") or 0))
        p = ledger.progress()
        if p.complete:
            summary["error"] = "the batch completed before the interruptions: more --requests or --max-tokens"
            print(json.dumps(summary, indent=1))
            return 1
        states = [job_fields(t).get("JobState", "") for t in tasks]
        if any(s in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL") for s in states):
            summary["error"] = f"a task ended before {args.resumptions} requeues: {dict(zip(tasks, states))}"
            print(json.dumps(summary, indent=1))
            return 1
        running = all(s == "RUNNING" for s in states)
        if min(restarts.values()) >= args.resumptions and running and \
                all(any(h.startswith(f"{t}@") for h in p.holders) for t in tasks):
            break
        time.sleep(2)
    log(f"requeues so far {restarts}; {p.describe()}: scancel {tasks[0]}, SIGKILL {tasks[1]}'s engine")
    summary["before_interruptions"] = {"done": p.done, "restarts": dict(restarts)}
    cli("stop", tasks[0])
    pid = engine_pid(f"{tasks[1]}@", batch_dir)
    if pid is None:
        summary["error"] = f"no engine process of {tasks[1]} found"
        print(json.dumps(summary, indent=1))
        return 1
    os.kill(pid, signal.SIGKILL)
    while any(job_fields(t).get("JobState") in ("RUNNING", "PENDING", "COMPLETING", "REQUEUED") for t in tasks):
        time.sleep(2)
    summary["first_array"] = {t: job_fields(t).get("JobState") for t in tasks}
    summary["after_interruptions_done"] = ledger.progress().done
    log(f"first array ended {summary['first_array']}; the same command again, --wait")
    arrays = [array]
    for _ in range(5):      # each time the jobs end before the batch does, the same command again
        again = cli("batch", *batch_args, "--wait", "--json", timeout=3 * 3600, check=False)
        arrays += json.loads(again.stdout)["submitted"] if again.returncode == 0 else []
        if again.returncode == 0:
            break
        log(f"the jobs ended before the batch: {again.stderr.strip()[-300:]}; once more")
        arrays += [j for j in json.loads((batch_dir / "jobs.json").read_text()) if j not in arrays]
    summary["later_arrays"] = arrays[1:]
    summary["restarts"] = {t: int(job_fields(t).get("Restarts", "0") or 0) for a in arrays[1:]
                           for t in (f"{a}_0", f"{a}_1")}
    summary["cluster_wall_s"] = round(time.monotonic() - started, 1)

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    got = answers(out)
    ids = [r["custom_id"] for r in requests(args.requests, args.max_tokens)]
    deadline = time.monotonic() + 120
    while True:
        left = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], capture_output=True, text=True).stdout.split("\n")
        ours = [line for line in left if line.split(" ")[0].split("_")[0] in set(arrays)]
        if not ours or time.monotonic() > deadline:
            break
        time.sleep(2)
    mismatched = [cid for cid in ids if got.get(cid) != expected.get(cid)]
    summary.update({
        "lines": len(rows), "ids_in_order": [r["custom_id"] for r in rows] == ids,
        "error_lines": sum(r["error"] is not None for r in rows), "equal_to_reference": len(ids) - len(mismatched),
        "mismatched": [(cid, expected.get(cid), got.get(cid)) for cid in mismatched[:5]], "jobs_left": ours})
    ok = summary["lines"] == len(ids) and summary["ids_in_order"] and not summary["error_lines"] \
        and not mismatched and not ours
    summary["ok"] = ok
    print(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

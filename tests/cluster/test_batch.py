"""`tgi-hpc batch` on the local Slurm cluster: a job array of two tasks, one scancel'ed and one engine SIGKILLed
mid-run, then the same command again (a new array, one task told its time limit is near: it requeues itself):
the output is complete, one line per custom_id, each the greedy answer, and no job is left running.
`tgi-hpc logs OUTPUT` shows every task's log; `--wait` off a terminal prints plain progress lines."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from support.releases import venv_release
from support.tgi_cli import TgiCli
from tgi_hpc.batch.ledger import Ledger

NUM = 600   # long enough that the interruptions land mid-batch and the rerun has work for both tasks on a quiet box
pytestmark = pytest.mark.slow


def engine_pid(holder_prefix: str, batch_dir: Path) -> int | None:
    """The engine.offline process of one job (its --holder starts with the job id)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if "engine.offline" in words and str(batch_dir) in words and any(w.startswith(holder_prefix) for w in words):
            return int(entry.name)
    return None


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_batch_survives_scancel_and_sigkill_then_completes_on_rerun(local_cluster, model_path, tmp_path):
    tgi = TgiCli.for_cluster(local_cluster, tmp_path / "jobs")
    model = str(model_path("tiny-llama"))
    messages = [[{"role": "user", "content": f"Count to {i}"}] for i in range(NUM)]
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"messages": m, "max_tokens": 16, "temperature": 0}}) + "\n"
                           for i, m in enumerate(messages)))
    args = ["--model", model, "--input", str(src), "--output", str(out), "--jobs", "2", "--release",
            str(venv_release()), "--lease", "8", "--shard-size", "2", "--max-concurrent-requests", "4",
            "--max-total-tokens", "256", "--partition", "long", "--engine-arg", "--kv-cache-bytes=32MiB"]
    first = json.loads(tgi("batch", *args, "--json").stdout)
    [array] = first["submitted"]                         # one job array, a task per holder
    job_a, job_b = f"{array}_0", f"{array}_1"
    batch_dir = Path(first["batch_dir"])
    ledger = Ledger(batch_dir)
    wait_until(lambda: ledger.progress().done >= 4 and len(ledger.progress().holders) == 2, 120, "both jobs working")
    row = json.loads(tgi("status", job_a, "--json").stdout)[0]
    assert row["kind"] == "batch" and row["model"] == model and row["detail"].startswith("batch ")
    assert re.fullmatch(rf"batch \d+/{NUM} done, 0 failed, \d+ tok/s, ETA \d+[sm]"
                        rf"(; shard \d+ \d+/2 \({array}_[01]@[^)]+\))(, shard \d+ \d+/2 \({array}_[01]@[^)]+\))*"
                        r"( \(\+\d+ more\))?", row["detail"]), row
    holding = {s["holder"].split("@")[0] for s in row["batch"]["open_shards"]}
    assert row["batch"]["total"] == NUM and holding and holding <= {job_a, job_b}, row  # a job may be between shards
    tgi("stop", job_a)                                   # scancel: its open shards are given back
    pid = wait_until(lambda: engine_pid(f"{job_b}@", batch_dir), 30, "job b's engine")
    os.kill(pid, signal.SIGKILL)                         # no word: its shards wait for their leases to expire
    progress = ledger.progress()
    assert not progress.complete, "the batch ended before the interruptions; make it longer"
    wait_until(lambda: all(s["state"] in ("FAILED", "CANCELLED") for s in json.loads(
        tgi("status", job_a, job_b, "--json").stdout)), 60, "both jobs to end")
    assert not ledger.progress().complete
    shown = tgi("logs", str(out)).stdout                # the batch's logs: each task's, in task order
    assert shown.index(f"==> {job_a} <==") < shown.index(f"==> {job_b} <==")
    assert re.search(rf"==> {job_a} <==\n.*shard \d+ \(records .*\) taken.*==> {job_b} <==", shown, re.S), shown
    assert json.loads(tgi("logs", array, "--json").stdout)["logs"].keys() == {job_a, job_b}

    again = json.loads(tgi("batch", *args, "--json").stdout)
    [second] = again["submitted"]                        # the old tasks had ended: a new array goes on
    job_c, job_d = f"{second}_0", f"{second}_1"
    wait_until(lambda: any(h.startswith(f"{job_c}@") for h in ledger.progress().holders), 120, "job c working")
    local_cluster.run("scancel", "--signal=USR1", "--batch", job_c)   # what Slurm sends before the time limit
    waited = tgi("batch", *args, "--wait", "--timeout", "150", "--json", timeout=200)
    final = json.loads(waited.stdout)
    assert final["complete"] and final["submitted"] == []            # a third time: it follows the running jobs
    seen = re.findall(rf"^batch: (\d+)/{NUM} done, 0 failed.*$", waited.stderr, re.M)   # not a terminal: lines
    assert seen and seen[-1] == str(NUM) and "\x1b[" not in waited.stderr, waited.stderr
    assert [int(n) for n in seen] == sorted(set(int(n) for n in seen))                # one line per change
    wait_until(lambda: all(s["state"] == "COMPLETED" for s in json.loads(
        tgi("status", job_c, job_d, "--json").stdout)), 120, "the new tasks to end")
    assert local_cluster.show_job(job_c)["Restarts"] == "1"          # it requeued itself and came back
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"q{i}" for i in range(NUM)]
    assert all(x["error"] is None for x in lines)

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    with LLMEngine(EngineConfig(model_id=model, device="cpu", dtype="float32", cpu_kv_cache_bytes=32 * 1024**2,
                                max_total_tokens=256)) as llm:
        tok = llm.tokenizer
        ids = [tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for m in messages]
        expected = [g.text for g in llm.generate(ids, SamplingParams(max_new_tokens=16))]
    assert [x["response"]["body"]["choices"][0]["message"]["content"] for x in lines] == expected

    states = json.loads(tgi("status", job_a, job_b, job_c, job_d, "--json").stdout)
    assert all(s["state"] not in ("PENDING", "RUNNING", "STARTING") for s in states), states
    assert all(re.fullmatch(rf"batch {NUM}/{NUM} done, 0 failed, \d+ tok/s \(complete\)", s["detail"])
               for s in states), states
    done = json.loads(tgi("batch", *args, "--json").stdout)    # once more: nothing to do, nothing submitted
    assert done["complete"] and done["submitted"] == []
    with src.open("a") as fh:
        fh.write(json.dumps({"prompt": "one more"}) + "\n")
    changed = tgi("batch", *args, check=False)
    assert changed.returncode == 2 and "changed" in changed.stderr and "--restart" in changed.stderr

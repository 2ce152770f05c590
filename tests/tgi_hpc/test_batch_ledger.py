"""The batch ledger (tgi_hpc/batch/ledger.py): racing holders, dead holders, crashes mid-commit."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from tgi_hpc.batch.assembly import assemble
from tgi_hpc.batch.inputs import Records, copy_input
from tgi_hpc.batch.ledger import Ledger, LedgerError


def make_batch(tmp_path: Path, num: int, shard_size: int, blank_every: int = 0) -> Path:
    src = tmp_path / "requests.jsonl"
    lines = []
    for i in range(num):
        lines.append(json.dumps({"custom_id": f"req-{i}", "body": {"prompt": "x"}}))
        if blank_every and i % blank_every == 0:
            lines.append("")
    src.write_text("\n".join(lines) + "\n")
    root = tmp_path / "batch"
    root.mkdir()
    scan = copy_input(src, root)
    Ledger.create(root, {"num_records": scan.num_records, "shard_size": shard_size})
    return root


def answer(records, lease) -> list[str]:
    return [json.dumps({"custom_id": r.custom_id, "holder": lease.holder}) for r in records]


def work(root: str, holder: str, queue, pause: float) -> None:
    ledger, records = Ledger(root, lease_s=30), Records(root)
    while (lease := ledger.claim(holder)) is not None:
        queue.put((holder, lease.shard.index, lease.gen))
        time.sleep(pause)
        ledger.commit(lease, answer(records.read(lease.shard.start, lease.shard.stop), lease))


def test_two_processes_racing_take_every_shard_once(tmp_path):
    root = make_batch(tmp_path, 97, 5, blank_every=7)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=work, args=(str(root), f"h{i}", queue, 0.01 * (i + 1))) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    claims = []
    while not queue.empty():
        claims.append(queue.get())
    shards = sorted(index for _, index, _ in claims)
    assert shards == list(range(20))                     # every shard claimed once, none twice
    assert {h for h, _, _ in claims} == {"h0", "h1"}     # both did work
    out = tmp_path / "results.jsonl"
    assert assemble(Ledger(root), out)
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert ids == [f"req-{i}" for i in range(97)]


def hold_and_die(root: str) -> None:
    lease = Ledger(root, lease_s=1.0).claim("doomed")
    assert lease is not None and lease.shard.index == 0
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_holders_shard_is_reclaimed_after_its_lease(tmp_path):
    root = make_batch(tmp_path, 10, 5)
    proc = multiprocessing.get_context("fork").Process(target=hold_and_die, args=(str(root),))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    ledger = Ledger(root, lease_s=30)
    other = ledger.claim("survivor")
    assert other.shard.index == 1                        # shard 0 is still leased
    assert ledger.claim("survivor") is None
    assert ledger.progress().holders == ["doomed", "survivor"]
    time.sleep(max(0.0, ledger.next_expiry() - time.time()) + 0.05)
    reclaimed = ledger.claim("survivor")
    assert (reclaimed.shard.index, reclaimed.gen) == (0, 1)
    assert ledger.claim("other") is None                 # the new lease is live


def test_a_crash_between_part_and_commit_loses_nothing_and_doubles_nothing(tmp_path):
    root = make_batch(tmp_path, 12, 4)
    now = [1000.0]
    ledger = Ledger(root, lease_s=10, clock=lambda: now[0])
    records = Records(root)
    first = ledger.claim("a")
    ledger.write_part(first, answer(records.read(first.shard.start, first.shard.stop), first))
    # "a" dies here: its part is written, its commit is not
    assert not ledger.progress().shards_done
    now[0] += 11
    again = ledger.claim("b")
    assert (again.shard.index, again.gen) == (0, 1)
    assert ledger.commit(again, answer(records.read(0, 4), again))
    assert not ledger.record(first)                      # "a" coming back cannot commit the shard a second time
    assert not ledger.renew(first)                       # and learns it lost the shard
    while (lease := ledger.claim("b")) is not None:
        assert ledger.commit(lease, answer(records.read(lease.shard.start, lease.shard.stop), lease))
    out = tmp_path / "out.jsonl"
    assert assemble(ledger, out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"req-{i}" for i in range(12)]
    assert {x["holder"] for x in lines} == {"b"}         # the orphan part of "a" is never read


def test_the_old_holder_committing_first_wins_and_the_new_one_is_refused(tmp_path):
    root = make_batch(tmp_path, 4, 4)
    now = [0.0]
    ledger = Ledger(root, lease_s=5, clock=lambda: now[0])
    old = ledger.claim("old")
    now[0] = 6
    new = ledger.claim("new")
    assert ledger.commit(old, answer(Records(root).read(0, 4), old))
    assert not ledger.commit(new, answer(Records(root).read(0, 4), new))
    p = ledger.progress().to_dict()
    assert {k: p[k] for k in ("total", "done", "failed", "shards", "shards_done", "complete", "eta_s")} == {
        "total": 4, "done": 4, "failed": 0, "shards": 1, "shards_done": 1, "complete": True, "eta_s": 0.0}


def test_progress_counts_tokens_and_estimates_the_time_left(tmp_path):
    root = make_batch(tmp_path, 8, 2)
    now = [0.0]
    ledger = Ledger(root, lease_s=5, clock=lambda: now[0])
    ledger.manifest["created"] = 100.0
    now[0] = 100.0
    assert ledger.progress().eta_s is None and ledger.progress().describe() == "0/8 done, 0 failed"
    lease = ledger.claim("h")
    now[0] = 110.0
    ledger.commit(lease, answer(Records(root).read(0, 2), lease), failed=1, tokens=50)
    p = ledger.progress()
    assert (p.done, p.failed, p.tokens, p.elapsed_s) == (2, 1, 50, 10.0)
    assert p.tokens_per_s == 5.0 and p.eta_s == 30.0
    assert p.describe() == "2/8 done, 1 failed, 5 tok/s, ETA 30s"


def test_release_gives_the_shard_back_at_once(tmp_path):
    ledger = Ledger(make_batch(tmp_path, 4, 2), lease_s=3600)
    lease = ledger.claim("stopping")
    ledger.release(lease)
    assert ledger.claim("next").shard.index == 0


def test_hostile_commits_and_folders_are_refused(tmp_path):
    root = make_batch(tmp_path, 6, 3)
    ledger = Ledger(root)
    lease = ledger.claim("h")
    with pytest.raises(LedgerError, match="3 records, got 2"):
        ledger.commit(lease, ['{"custom_id": "req-0"}', '{"custom_id": "req-1"}'])
    with pytest.raises(LedgerError, match="newline"):
        ledger.commit(lease, ["a", "b\nc", "d"])
    with pytest.raises(LedgerError, match="no part"):
        ledger.record(lease)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(LedgerError, match="not a batch folder"):
        Ledger(tmp_path / "bad")
    with pytest.raises(LedgerError, match="exists already"):
        Ledger.create(root, {"num_records": 1, "shard_size": 1})


def test_assembly_refuses_a_line_that_answers_another_record(tmp_path):
    root = make_batch(tmp_path, 4, 2)
    ledger = Ledger(root)
    a, b = ledger.claim("h"), ledger.claim("h")
    ledger.commit(a, ['{"custom_id": "req-0"}', '{"custom_id": "req-1"}'])
    out = tmp_path / "out.jsonl"
    assert not assemble(ledger, out) and not out.exists()      # not complete yet
    ledger.commit(b, ['{"custom_id": "req-3"}', '{"custom_id": "req-2"}'])
    with pytest.raises(LedgerError, match="line 3 has custom_id 'req-3', expected 'req-2'"):
        assemble(ledger, out)
    assert not out.exists()


def test_ids_are_custom_ids_or_line_numbers_and_duplicates_are_found(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "a", "body": {}}\n\n{"prompt": "hi"}\nnot json at all\n'
                   '{"custom_id": 7}\n{"custom_id": "a"}\n')
    (tmp_path / "b").mkdir()
    scan = copy_input(src, tmp_path / "b")
    records = Records(tmp_path / "b")
    assert records.ids() == ["a", "3", "4", "5", "a"]
    assert scan.num_records == 5 and scan.duplicates == [("a", [1, 6])]
    assert records.read(1, 3)[1].text == "not json at all"

"""A shard's journal (tgi_hpc/batch/journal.py): whole lines kept, torn and foreign lines dropped."""
from __future__ import annotations

import json

import pytest

from tgi_hpc.batch.journal import Entry
from tgi_hpc.batch.ledger import Ledger, LedgerError
from test_batch_ledger import make_batch


def line(cid: str, text: str = "ok") -> str:
    return json.dumps({"custom_id": cid, "response": {"text": text}, "error": None})


def test_a_holder_taking_a_shard_over_gets_the_whole_lines_of_every_earlier_lease(tmp_path):
    root = make_batch(tmp_path, 10, 5)
    clock = [1000.0]
    ledger = Ledger(root, lease_s=10, clock=lambda: clock[0])
    first = ledger.claim("a")
    ids = [f"req-{i}" for i in range(5)]
    assert ledger.resumed(first, ids) == {}
    journal = ledger.journal(first)
    journal.append([Entry(1, line("req-1"), tokens=3), Entry(3, line("req-3"), failed=True)])
    journal.append([])
    journal.close()
    clock[0] += 60                                         # "a" died: its lease expired
    second = ledger.claim("b")
    assert (second.shard.index, second.gen) == (0, 1)
    got = ledger.resumed(second, ids)
    assert sorted(got) == [1, 3] and got[1].tokens == 3 and got[3].failed and got[1].line == line("req-1")
    later = ledger.journal(second)
    later.append([Entry(1, line("req-1", "again")), Entry(4, line("req-4"))])   # a position twice: the first counts
    later.close()
    clock[0] += 60
    third = ledger.claim("c")
    got = ledger.resumed(third, ids)
    assert sorted(got) == [1, 3, 4] and got[1].line == line("req-1")
    ledger.commit(third, [line(i) for i in ids])
    ledger.drop_journals(0)
    assert list((root / "journal").iterdir()) == []
    with pytest.raises(LedgerError):
        ledger.resumed(third, ids[:2])


@pytest.mark.parametrize("garbage", [
    b'{"pos": 2, "failed": false, "tokens": 1, "li',                 # torn by a kill mid-write: no newline
    b'{"pos": 2, "failed": false, "tok\n',                          # torn, then a newline
    b'\xff\xfe not utf-8\n',
    b'[1, 2]\n',
    b'{"pos": 9, "failed": false, "tokens": 0, "line": "{\\"custom_id\\": \\"req-2\\"}"}\n',   # out of range
    b'{"pos": true, "failed": false, "tokens": 0, "line": "{\\"custom_id\\": \\"req-1\\"}"}\n',
    b'{"pos": 2, "failed": false, "tokens": -5, "line": "{\\"custom_id\\": \\"req-2\\"}"}\n',
    b'{"pos": 2, "failed": "no", "tokens": 0, "line": "{\\"custom_id\\": \\"req-2\\"}"}\n',
    b'{"pos": 2, "failed": false, "tokens": 0, "line": "{\\"custom_id\\": \\"req-3\\"}"}\n',   # another record's
    b'{"pos": 2, "failed": false, "tokens": 0, "line": "[\\"req-2\\"]"}\n',
    b'{"pos": 2, "failed": false, "tokens": 0, "line": "a\\nb"}\n',
    b'[' * 100_000 + b'\n',
])
def test_a_torn_or_foreign_line_is_dropped_and_the_others_kept(tmp_path, garbage):
    root = make_batch(tmp_path, 5, 5)
    clock = [1000.0]
    ledger = Ledger(root, lease_s=10, clock=lambda: clock[0])
    first = ledger.claim("a")
    journal = ledger.journal(first)
    journal.append([Entry(0, line("req-0")), Entry(4, line("req-4"))])
    journal.close()
    with open(root / "journal" / "0.0.jsonl", "ab") as fh:
        fh.write(garbage)
    clock[0] += 60
    got = ledger.resumed(ledger.claim("b"), [f"req-{i}" for i in range(5)])
    assert sorted(got) == [0, 4]


def test_a_journal_that_cannot_be_written_is_turned_off_and_the_shard_still_commits(tmp_path):
    root = make_batch(tmp_path, 3, 3)
    ledger = Ledger(root)
    lease = ledger.claim("a")
    (root / "journal").rmdir()
    (root / "journal").write_text("not a folder")           # every append fails
    journal = ledger.journal(lease)
    journal.append([Entry(0, line("req-0"))])
    journal.append([Entry(1, line("req-1"))])
    journal.close()
    assert ledger.commit(lease, [line(f"req-{i}") for i in range(3)])


def test_progress_counts_the_journaled_lines_of_open_shards_across_a_requeue_and_once_after_the_commit(tmp_path):
    root = make_batch(tmp_path, 10, 5)
    clock = [1000.0]
    ledger = Ledger(root, lease_s=10, clock=lambda: clock[0])
    ledger.manifest["created"] = 990.0
    first = ledger.claim("a")
    journal = ledger.journal(first)
    journal.append([Entry(0, line("req-0"), tokens=4), Entry(2, line("req-2"), failed=True)])
    journal.close()
    with open(journal.path, "ab") as f:
        f.write(b'{"pos": 3, "failed": false, "tok')                        # torn by a kill: not counted
    p = ledger.progress()
    assert (p.done, p.committed, p.failed, p.tokens, p.holders) == (2, 0, 1, 4, ["a"])
    assert [s.to_dict() for s in p.open_shards] == [{"shard": 0, "done": 2, "total": 5, "holder": "a"}]
    assert p.describe(shards=True) == "2/10 done, 1 failed, 0 tok/s, ETA 40s; shard 0 2/5 (a)"
    clock[0] += 60                                                           # "a" died; a requeued job goes on
    second = ledger.claim("b")
    later = ledger.journal(second)
    later.append([Entry(0, line("req-0")), Entry(3, line("req-3"), tokens=6)])   # pos 0 twice: counted once
    later.close()
    p = ledger.progress()
    assert (p.done, p.failed, p.tokens) == (3, 1, 10)
    assert p.to_dict()["open_shards"] == [{"shard": 0, "done": 3, "total": 5, "holder": "b"}]
    assert p.requests_per_s == 3 / 70 and p.eta_s == 70 * 7 / 3
    ledger.release(second)
    assert ledger.progress().open_shards[0].holder == ""                    # given back: its lines still count
    third = ledger.claim("c")
    ledger.commit(third, [line(f"req-{i}") for i in range(5)], failed=1, tokens=12)   # journals not dropped yet
    p = ledger.progress()
    assert (p.done, p.committed, p.failed, p.tokens, p.open_shards) == (5, 5, 1, 12, [])


def test_the_one_line_progress_names_four_open_shards_and_counts_the_others(tmp_path):
    ledger = Ledger(make_batch(tmp_path, 12, 2), lease_s=60)
    for _ in range(6):
        ledger.claim("h")
    p = ledger.progress()
    assert len(p.open_shards) == 6 and p.describe(shards=True).endswith(
        "; shard 0 0/2 (h), shard 1 0/2 (h), shard 2 0/2 (h), shard 3 0/2 (h) (+2 more)")


@pytest.mark.parametrize("name", ["x.0.jsonl", "99.0.jsonl", "1.jsonl.tmp", "-1.0.jsonl", ".jsonl"])
def test_status_ignores_journal_files_of_no_shard(tmp_path, name):
    root = make_batch(tmp_path, 10, 5)
    (root / "journal" / name).write_text('{"pos": 0, "failed": false, "tokens": 1, "line": "{}"}\n')
    p = Ledger(root).progress()
    assert (p.done, p.open_shards) == (0, [])

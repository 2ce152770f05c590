"""HiddenRows (the target's hidden states per sequence, for Medusa and EAGLE-3): random puts, rollbacks and
drops against a dict of position -> row."""
import random

import pytest

torch = pytest.importorskip("torch")

from engine.spec_decode.hidden_rows import HiddenRows  # noqa: E402


def test_random_puts_and_drops_match_a_dict_of_positions():
    rng = random.Random(0)
    for _ in range(200):
        store, reference = HiddenRows(), {}
        for step in range(40):
            if rng.random() < 0.6:                   # a forward: rows at [start, start + n)
                start, n = rng.randint(0, 30), rng.randint(0, 6)
                rows = torch.arange(start, start + n, dtype=torch.float32)[:, None] + step * 1000
                store.put(7, start, rows)
                if n:   # replaces from `start` on when it follows the held rows, else starts over
                    held = reference and min(reference) < start <= max(reference) + 1
                    reference = {p: v for p, v in reference.items() if p < start} if held else {}
                    reference.update({start + i: float(rows[i, 0]) for i in range(n)})
            else:                                    # a draft took the rows before `position`
                position = rng.randint(0, 35)
                store.drop_before(7, position)
                if reference and position > min(reference):
                    reference = {p: v for p, v in reference.items() if p >= position}
            a, b = rng.randint(0, 36), rng.randint(0, 37)
            got = store.get(7, a, b)
            if b <= a or any(p not in reference for p in range(a, b)):
                assert got is None
            else:
                assert got[:, 0].tolist() == [reference[p] for p in range(a, b)]
            assert store.first(7) == (min(reference) if reference else None)


def test_without_history_the_last_forward_replaces_and_old_sequences_are_dropped():
    store = HiddenRows(max_seqs=2, history=False)
    store.put(1, 0, torch.zeros(5, 2))
    store.put(1, 5, torch.ones(1, 2))
    assert store.get(1, 4, 5) is None and store.get(1, 5, 6).tolist() == [[1.0, 1.0]]
    store.put(2, 0, torch.ones(1, 2))
    store.put(3, 0, torch.ones(1, 2))
    assert store.first(1) is None and store.first(3) == 0
    forward = torch.zeros(100, 2)
    store.put(4, 0, forward[:1])
    assert store.rows[4][1][0]._base is None     # a copy, not a view of the forward's activations

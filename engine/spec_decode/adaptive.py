"""AdaptiveDrafts (`--speculate auto`): per sequence, draft only as many tokens as pay for themselves.

Each sequence keeps a decayed count of its drafted positions and of those accepted, i.e. its per-token
acceptance a; a new sequence starts from the engine-wide acceptance of the method (PRIOR_ACCEPTED out of
PRIOR_TRIALS before any draft was verified), so a drafter that does not pay stops costing at once. A decode with k drafts yields
1 + a + ... + a^k tokens on average and costs 1 + k * (draft_cost + VERIFY_COST) plain decodes (draft_cost:
0 for n-gram drafts, K / num_layers + DRAFT_STEP_COST for layer skip), so each decode drafts the k in 0..room
with the most tokens per cost. At k = 0 the sequence stops drafting; after RETRY_AFTER undrafted decodes it
probes with one draft token, whose outcome updates its history (and may resume drafting). For a drafter that
costs forwards (draft_cost > 0), each rejected probe doubles the engine-wide wait before the next one (up to
MAX_RETRY_AFTER) and an accepted one resets it: on CPU a draft forward costs about as much for one row as for
the whole batch, so probes staggered over a batch's rows would otherwise keep a losing method costing. Deterministic (no timings): the same requests draft the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence

PRIOR_ACCEPTED, PRIOR_TRIALS = 1.6, 2.0     # a = 0.8 until the sequence shows otherwise
DECAY = 0.8                                 # weight of the older history at each drafted decode
VERIFY_COST = 0.1       # one more token in a decode span, in plain decodes (CPU, small batches; less on a GPU)
DRAFT_STEP_COST = 0.1   # per layer-skip draft forward beyond its layers' share: inputs, norm, LM head
RETRY_AFTER = 16        # undrafted decodes before a paused sequence probes with one draft token
MAX_RETRY_AFTER = 512   # the longest wait after repeated rejected probes (drafters with a forward cost)
GLOBAL_DECAY = 0.99     # the engine-wide acceptance a new sequence starts from, per verified decode


@dataclass(slots=True)
class DraftHistory:
    accepted: float = PRIOR_ACCEPTED
    trials: float = PRIOR_TRIALS
    num_paused: int = 0         # decodes without drafts since the last drafted one
    probing: bool = False       # its current draft is a probe after a pause


class AdaptiveDrafts:
    def __init__(self, draft_cost: float):
        self.draft_cost = draft_cost
        self.num_paused_total = 0   # decodes that could have drafted and did not
        self.accepted, self.trials = PRIOR_ACCEPTED, PRIOR_TRIALS   # engine-wide, decayed
        self.retry_after = RETRY_AFTER  # undrafted decodes before a probe, doubled by rejected probes

    def num_tokens(self, seq: Sequence, room: int) -> int:
        """How many of `room` draft tokens `seq` should draft now (0 = none)."""
        history = self._history(seq)
        if history.num_paused >= self.retry_after and room > 0:
            history.num_paused, history.probing = 0, True
            return 1
        num = best_num_drafts(history.accepted / history.trials, room, self.draft_cost)
        if num == 0:
            history.num_paused += 1
            self.num_paused_total += 1
        return num

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verified decode: `num_accepted` of `num_proposed` drafts kept (the positions after the first
        rejection were never tested)."""
        if num_proposed <= 0:
            return
        history = self._history(seq)
        if history.probing and self.draft_cost > 0:
            self.retry_after = RETRY_AFTER if num_accepted else min(2 * self.retry_after, MAX_RETRY_AFTER)
        history.probing = False
        num_trials = min(num_accepted + 1, num_proposed)
        history.accepted = DECAY * history.accepted + num_accepted
        history.trials = DECAY * history.trials + num_trials
        history.num_paused = 0
        self.accepted = GLOBAL_DECAY * self.accepted + num_accepted
        self.trials = GLOBAL_DECAY * self.trials + num_trials

    def _history(self, seq: Sequence) -> DraftHistory:
        if seq.draft_history is None:  # the method's acceptance so far, with the weight of the prior
            seq.draft_history = DraftHistory(PRIOR_TRIALS * self.accepted / self.trials, PRIOR_TRIALS)
        return seq.draft_history


def best_num_drafts(acceptance: float, room: int, draft_cost: float) -> int:
    """The k in 0..room with the most expected tokens per unit of cost (ties: the smaller k)."""
    best, best_gain, expected, power = 0, 1.0, 1.0, 1.0
    for k in range(1, room + 1):
        power *= acceptance
        expected += power
        gain = expected / (1 + k * (draft_cost + VERIFY_COST))
        if gain > best_gain + 1e-9:
            best, best_gain = k, gain
    return best

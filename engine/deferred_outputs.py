"""A step's plain decode rows whose RequestOutputs the delivering thread builds, not the step thread.

With `LLMEngine.defer_text` (AsyncEngine turns it on), a decode row whose text is deferred (engine/deferred_text.py)
and whose token ends nothing, with no alternatives asked and no prompt logprobs left to hand over, gets neither a
TokenInfo nor a RequestOutput in `step()`: the step appends the token and notes the row in the step's one
`DeferredRows` (its sequence, its row of the sampler's output, its token count then). Whoever delivers the step's
outputs builds them: AsyncEngine's event loop, for the rows whose clients are still there (`output(i)`), anything
else through `expand`. Each built output is, field for field, the one the step thread builds for such a row (and
its text still pending, for `deferred_text.fill`): tests/engine/test_deferred_outputs.py.

Why: building those ~1,300 small objects a step at batch 256 was ~0.4 ms of the step thread's ~1.3 ms of host time
(docs/benchmarks.md, "Host overhead per decode step"); on a GPU the event loop's thread does it while the step
thread waits for the device. Everything an output is built from is fixed once the row is noted: the sequence's
request id, seed, prompt length, cached-prompt count, sampling parameters and deferred text do not change while it
runs, and the token, its logprob and the token count are read from the row and the note.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from engine.outputs import RequestOutput, TokenInfo

if TYPE_CHECKING:
    from engine.sampler import SamplerOutput
    from engine.sequence import Sequence
    from engine.tokenizer import TokenTexts


class DeferredRows:
    """The noted rows of one step, in row order. `request_id` is None: it is not any one request's output."""

    __slots__ = ("sampled", "texts", "seqs", "rows", "num_tokens")
    request_id = None
    pending = None

    def __init__(self, sampled: SamplerOutput, texts: TokenTexts) -> None:
        self.sampled, self.texts = sampled, texts
        self.seqs: list[Sequence] = []
        self.rows: list[int] = []           # row of `sampled`
        self.num_tokens: list[int] = []     # the sequence's tokens once this row's token was appended

    def __len__(self) -> int:
        return len(self.seqs)

    def output(self, i: int) -> RequestOutput:
        """The RequestOutput of noted row i, its text pending (what `_append_one_each` builds for it)."""
        seq, j, num_tokens = self.seqs[i], self.rows[i], self.num_tokens[i]
        sampled, texts = self.sampled, self.texts
        token_id = sampled.token_ids[j]
        info = TokenInfo(token_id, texts.text(token_id), sampled.logprobs[j] if seq.params.logprobs else None,
                         token_id in texts.special_ids, ())
        num_prompt = seq.num_prompt_tokens
        # positional, in RequestOutput's field order (tests/engine/test_llm_engine.py checks it)
        return RequestOutput(seq.request_id, [info], "", False, None, None, "", num_prompt, num_tokens - num_prompt,
                             seq.seed, None, seq.num_cached_tokens or 0, None, None,
                             (seq.deferred, num_tokens - 1, num_tokens, False))

    def outputs(self) -> list[RequestOutput]:
        return [self.output(i) for i in range(len(self.seqs))]


def expand(outputs: Iterable[Any]) -> list[RequestOutput]:
    """A step's outputs with every DeferredRows replaced by its RequestOutputs, in place, order kept."""
    expanded: list[RequestOutput] = []
    for out in outputs:
        if type(out) is DeferredRows:
            expanded += out.outputs()
        else:
            expanded.append(out)
    return expanded

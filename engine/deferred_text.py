"""Text decoded off the step thread: a sequence's detokenizer run where its outputs are delivered.

With `LLMEngine.defer_text` (AsyncEngine turns it on), a sequence whose text cannot end it (no stop strings, no
grammar, no speculation) gets a `DeferredText`: the step thread appends its tokens and builds its outputs with
`pending` = (this, first, upto, final) and no text, and `fill` decodes them where the output is handed over (the
event loop's delivery, engine/async_engine.py), so the step thread does no detokenizing for it. On a GPU the loop
thread runs while the step thread waits for the device; on this CPU it is the same work moved, not saved.

Outputs of one request are filled in the order they were made (one loop delivers them, in order). An output that
is never delivered (its client left) is never filled: a later one first decodes the tokens it skipped, so the
detokenizer's state and the final `generated_text` are those of the eager path, whose pieces they equal token
for token (tests/engine/test_deferred_text.py).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer
    from engine.outputs import RequestOutput
    from engine.stop import StopMatcher

logger = logging.getLogger(__name__)


class DeferredText:
    """One sequence's detokenizer and stop matcher (without stop strings), fed on the delivering thread."""

    __slots__ = ("detokenizer", "stop", "token_ids", "num_fed")

    def __init__(self, detokenizer: IncrementalDetokenizer, stop: StopMatcher, token_ids: list[int],
                 num_prompt_tokens: int) -> None:
        assert not stop.stop, "a sequence with stop strings needs its text on the step thread"
        self.detokenizer, self.stop, self.token_ids = detokenizer, stop, token_ids
        self.num_fed = num_prompt_tokens        # tokens decoded so far

    def fill(self, out: RequestOutput, first: int, upto: int, final: bool) -> None:
        """Set `out`'s text (and on a final output its generated and stop text) from its tokens [first, upto):
        what the step thread would have set."""
        detokenizer, stop, token_ids = self.detokenizer, self.stop, self.token_ids
        pieces = []
        while self.num_fed < upto:
            self.num_fed += 1
            piece, _ = stop.feed(detokenizer.decode_next(token_ids, self.num_fed))
            if self.num_fed > first:        # else a token of an output never delivered
                pieces.append(piece)
        if not final:
            out.text, out.token_texts = pieces[0] if len(pieces) == 1 else "".join(pieces), pieces
            return
        if pieces:                          # ended by EOS or the length limit: what is held back comes out
            tail, _ = stop.feed(detokenizer.flush(token_ids, upto))
            pieces[-1] += tail + stop.flush()
            out.text, out.token_texts = "".join(pieces), pieces
        else:                               # aborted or failed: nothing of its own
            out.text = stop.flush() if out.error is None else ""
        out.generated_text, out.stop_text = stop.text, stop.cut


def fill(out: RequestOutput) -> None:
    """Decode `out`'s text if it is pending (a no-op otherwise). A failure to decode ends the output with the
    error, as a failed step does, rather than leaving the request without an answer."""
    pending = out.pending
    if pending is None:
        return
    out.pending = None
    try:
        pending[0].fill(out, pending[1], pending[2], pending[3])
    except Exception as error:  # noqa: BLE001 - the request ends with it; the others go on
        logger.exception("detokenizing request %s failed", out.request_id)
        out.text, out.token_texts, out.finished, out.finish_reason = "", None, True, None
        out.error = f"detokenizing failed: {type(error).__name__}: {error}"

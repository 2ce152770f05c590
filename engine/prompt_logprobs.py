"""Prompt logprobs (TGI `decoder_input_details`, OpenAI `echo` with `logprobs`): each prompt token's logprob under
the raw distribution of the position before it, and its alternatives when the request asks for top tokens.

A prefill chunk of such a request asks for the logits of every row ("all"); row j predicts token start + j + 1.
The work is split in two so that a step launched ahead (engine/async_scheduling.py) does not wait for it: `start`
runs on the logits' device (log-softmax, the targets' values, the top-k) and starts the copies to the host without
waiting; `PromptLogprobs.finish`, once the copies are done, appends the tokens to the sequence's `prefill_tokens`.
The synchronous step calls both at once. A recompute after preemption starts over at 0: the tokens already scored
are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device_copy import copies_done, list_to_device, to_host
from engine.outputs import TokenInfo
from engine.sampler import fresh_log_softmax
from engine.sequence import Sequence


@dataclass(slots=True)
class PromptLogprobs:
    """A chunk's prompt logprobs on their way to the host."""

    seq: Sequence
    targets: list[int]                  # the prompt tokens scored, in order
    values: torch.Tensor                # [len(targets)] their logprobs
    top_ids: torch.Tensor | None        # [len(targets), k] the alternatives, when the request asks for k
    top_values: torch.Tensor | None
    done: torch.cuda.Event | None       # when the copies are written; None off CUDA (nothing was copied)

    def finish(self, token_texts) -> None:
        """Append the scored tokens to the sequence's `prefill_tokens`, once the copies are done."""
        if self.done is not None:
            self.done.synchronize()
        text, is_special = token_texts.text, token_texts.is_special
        tops: list[list[TokenInfo]] = [[] for _ in self.targets]
        if self.top_ids is not None:
            tops = [[TokenInfo(i, text(i), lp, is_special(i)) for i, lp in zip(ids, lps)]
                    for ids, lps in zip(self.top_ids.tolist(), self.top_values.tolist())]
        self.seq.prefill_tokens += [TokenInfo(t, text(t), lp, is_special(t), top)
                                    for t, lp, top in zip(self.targets, self.values.tolist(), tops)]


def start(seq: Sequence, start_pos: int, logits: torch.Tensor) -> PromptLogprobs | None:
    """The prompt logprobs of a chunk starting at `start_pos` whose rows' logits are `logits` [rows, vocab],
    computed on their device and copied to (pinned, on CUDA) host memory without waiting; None when the chunk
    scores no prompt token (its rows all predict generated tokens, or a recompute's were scored before)."""
    first = max(start_pos, len(seq.prefill_tokens) - 1)
    end = min(start_pos + len(logits), seq.num_prompt_tokens - 1)
    if end <= first:
        return None
    targets = seq.token_ids[first + 1:end + 1]
    logprobs = fresh_log_softmax(logits[first - start_pos:end - start_pos].float())
    values = logprobs.gather(1, list_to_device(targets, torch.int64, logprobs.device)[:, None]).squeeze(1)
    top_ids = top_values = None
    if k := seq.params.top_n_tokens:  # the prompt's alternatives too (OpenAI echo + logprobs)
        top_values, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    values, top_ids, top_values = (to_host(t) for t in (values, top_ids, top_values))
    return PromptLogprobs(seq, targets, values, top_ids, top_values, copies_done(logits.device))

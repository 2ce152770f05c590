"""FakeRunner: a deterministic stand-in for ModelRunner over a real paged token store.

The "model" reads each sequence's whole context back from the KV slots that the block tables
name, and its logits are a pseudo-random function of that context. A block handed to the wrong
sequence, a span written at the wrong offset or a bad prefix-cache hit therefore changes the
generated tokens, and the tests compare against `reference_greedy`, which needs no KV cache.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.batch import SeqSpan

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_model_path(name: str) -> Path:
    """Snapshot of a test model from scripts/make_models.py (built once, cached)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    from make_models import ensure_model
    return ensure_model(name)


test_model_path.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def fake_logits(context: list[int], vocab_size: int) -> torch.Tensor:
    seed = hash(tuple(context)) % (2**63)
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def reference_greedy(prompt: list[int], max_new_tokens: int, vocab_size: int,
                     eos_token_ids: set[int] = frozenset()) -> list[int]:
    context = list(prompt)
    for _ in range(max_new_tokens):
        token = int(fake_logits(context, vocab_size).argmax())
        context.append(token)
        if token in eos_token_ids:
            break
    return context[len(prompt):]


@dataclass
class FakeModelConfig:
    vocab_size: int = 1024
    max_position_embeddings: int = 512


class FakeRunner:
    takes_device_input_ids = True   # run(input_ids=...) as ModelRunner's, so async scheduling can be on

    def __init__(self, vocab_size: int = 1024, num_kv_blocks: int = 64, block_size: int = 4):
        self.vocab_size = vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.device = torch.device("cpu")
        self.attention_backend = "fake"
        self.slots: list[int | None] = [None] * (num_kv_blocks * block_size)
        self.calls: list[list[SeqSpan]] = []
        self.fail_next = False
        self.closed = False

    def _slot(self, span: SeqSpan, pos: int) -> int:
        block = pos // self.block_size
        assert block < len(span.block_table), f"seq {span.seq_id}: position {pos} has no block"
        return span.block_table[block] * self.block_size + pos % self.block_size

    def run(self, spans: list[SeqSpan], input_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        if input_ids is not None:   # async scheduling: the first spans' tokens are the picks in flight
            spans = [replace(s, token_ids=[t]) for s, t in zip(spans, input_ids.tolist())] + spans[len(input_ids):]
        self.calls.append([SeqSpan(s.seq_id, list(s.token_ids), s.start_pos, list(s.block_table), s.logits)
                           for s in spans])
        for span in spans:
            for i, token in enumerate(span.token_ids):
                self.slots[self._slot(span, span.start_pos + i)] = token
        last, every = [], {}
        for span in spans:
            if span.logits == "none":
                continue
            end = span.start_pos + len(span.token_ids)
            context = [self.slots[self._slot(span, p)] for p in range(end)]
            assert None not in context, f"seq {span.seq_id} reads an unwritten slot"
            rows = range(span.start_pos + 1, end + 1) if span.logits == "all" else [end]
            logits = torch.stack([fake_logits(context[:n], self.vocab_size) for n in rows])
            last.append(logits[-1])
            if span.logits == "all":
                every[span.seq_id] = logits
        return (torch.stack(last) if last else torch.empty(0, self.vocab_size)), every

    def close(self) -> None:
        self.closed = True

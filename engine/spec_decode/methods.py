"""Speculation: which drafter a `--speculate` engine uses (n-gram or layer skip), checked before loading."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.spec_decode.adaptive import DRAFT_STEP_COST, AdaptiveDrafts
from engine.spec_decode.batch_drafter import BatchDrafter
from engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence


@dataclass(slots=True)
class Speculation:
    method: str                                             # "ngram" | "layers"
    propose: Callable[[Sequence, int], list[int]]           # the scheduler's per-row hook
    fill: Callable[[ScheduledBatch], None] | None = None    # model drafters: the batched draft forwards
    adaptive: AdaptiveDrafts | None = None                  # --speculate auto

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        if self.adaptive is not None:
            self.adaptive.record(seq, num_proposed, num_accepted)


def check_speculation(config: EngineConfig, model_config: Any) -> None:
    """Refuse flag combinations that cannot work, in one line each, before minutes of loading."""
    if not config.speculative_layers:
        return
    num_hidden_layers = model_config.num_hidden_layers
    if config.speculate < 1:
        raise ValueError(f"--speculative-layers {config.speculative_layers} drafts --speculate N tokens per step: "
                         "set --speculate (1 to 16)")
    if not 1 <= config.speculative_layers < num_hidden_layers:
        raise ValueError(f"--speculative-layers {config.speculative_layers}: use 1 to {num_hidden_layers - 1} "
                         f"(the model has {num_hidden_layers} layers)")
    if config.pipeline_parallel_size > 1:
        raise ValueError("--speculative-layers with --pipeline-parallel-size > 1 is not supported")


def build_speculation(config: EngineConfig, runner: Any, model_config: Any) -> Speculation | None:
    if config.speculate < 1:
        return None
    if not config.speculative_layers:
        ngram = NgramProposer().propose
        if not config.speculate_auto:
            return Speculation("ngram", ngram)
        adaptive = AdaptiveDrafts(draft_cost=0.0)
        return Speculation("ngram", lambda seq, room: ngram(seq, adaptive.num_tokens(seq, room)), adaptive=adaptive)
    if "num_layers" not in inspect.signature(runner.run).parameters:
        raise ValueError(f"--speculative-layers is not supported by {type(runner).__name__} (ranks started by "
                         "srun or torchrun)")
    num_layers = config.speculative_layers
    adaptive = None
    if config.speculate_auto:
        adaptive = AdaptiveDrafts(draft_cost=num_layers / model_config.num_hidden_layers + DRAFT_STEP_COST)
    drafter = BatchDrafter(lambda spans: runner.run(spans, num_layers=num_layers)[0],
                           adaptive.num_tokens if adaptive else None)
    return Speculation("layers", drafter.propose, drafter.fill, adaptive)

"""Speculation: which drafter a `--speculate` engine uses (n-gram, layer skip, a draft model, Medusa heads or
EAGLE-3), checked before loading."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.spec_decode.adaptive import DRAFT_STEP_COST, AdaptiveDrafts
from engine.spec_decode.batch_drafter import BatchDrafter
from engine.spec_decode.draft_model import check_draft_model
from engine.spec_decode.head_drafter import HeadDrafter
from engine.spec_decode.heads import speculative_kind
from engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence


@dataclass(slots=True)
class Speculation:
    method: str                                             # "ngram" | "layers" | "draft" | "medusa" | "eagle3"
    propose: Callable[[Sequence, int], list[int]]           # the scheduler's per-row hook
    fill: Callable[[ScheduledBatch], None] | None = None    # model drafters: the batched draft forwards
    adaptive: AdaptiveDrafts | None = None                  # --speculate auto

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        if self.adaptive is not None:
            self.adaptive.record(seq, num_proposed, num_accepted)


def check_speculation(config: EngineConfig, model_config: Any, tokenizer: Any = None) -> Any:
    """Refuse flag combinations that cannot work, in one line each, before minutes of loading; the draft
    model's ModelConfig when there is one."""
    if config.speculative_model:
        return _check_draft(config, model_config, tokenizer)
    if not config.speculative_layers:
        return None
    num_hidden_layers = model_config.num_hidden_layers
    if config.speculate < 1:
        raise ValueError(f"--speculative-layers {config.speculative_layers} drafts --speculate N tokens per step: "
                         "set --speculate (1 to 16)")
    if not 1 <= config.speculative_layers < num_hidden_layers:
        raise ValueError(f"--speculative-layers {config.speculative_layers}: use 1 to {num_hidden_layers - 1} "
                         f"(the model has {num_hidden_layers} layers)")
    if config.pipeline_parallel_size > 1:
        raise ValueError("--speculative-layers with --pipeline-parallel-size > 1 is not supported")
    return None


def _check_draft(config: EngineConfig, model_config: Any, tokenizer: Any) -> Any:
    path = config.speculative_model
    if config.speculative_layers:
        raise ValueError("--speculative-model and --speculative-layers are two drafters: pick one")
    if config.speculate < 1:
        raise ValueError(f"--speculative-model {path!r} drafts --speculate N tokens per step: set --speculate "
                         "(1 to 16, or auto)")
    if config.pipeline_parallel_size > 1 or config.lora_adapters:
        raise ValueError("--speculative-model with --pipeline-parallel-size > 1 or --lora-adapters is not supported")
    kind = speculative_kind(path)
    if kind == "medusa":
        from engine.spec_decode.medusa import check_medusa
        num_heads, head_params = check_medusa(path, model_config.hidden_size, model_config.vocab_size,
                                              config.speculate, config.speculate_auto)
        return HeadsConfig(kind, num_heads, head_params / max(model_config.estimate_num_params(), 1))
    if kind == "eagle3":
        from engine.spec_decode.eagle3 import check_eagle3
        if config.num_shard > 1:
            raise ValueError(f"--speculative-model {path!r} is an EAGLE-3 draft: not supported with --num-shard > 1 "
                             "yet (Medusa heads and draft models are)")
        layer_params = check_eagle3(path, model_config)
        return HeadsConfig(kind, config.speculate, layer_params / max(model_config.estimate_num_params(), 1))
    max_total = config.max_total_tokens or min(model_config.max_position_embeddings, 4096)
    return check_draft_model(path, config.model_id, tokenizer, max_total)


@dataclass(slots=True)
class HeadsConfig:
    """Checked Medusa heads or EAGLE-3 layer: its kind, the drafts per step it can make, and the cost of one
    draft token in target forwards (Medusa: all drafts from one hidden state, at the cost of its heads)."""
    kind: str
    max_drafts: int
    draft_cost: float


def _build_heads(config: EngineConfig, runner: Any, heads: HeadsConfig) -> Speculation:
    if not hasattr(runner, "draft_heads"):
        raise ValueError(f"{heads.kind} heads (--speculative-model) are not supported by {type(runner).__name__} "
                         "(ranks started by srun or torchrun)")
    adaptive = AdaptiveDrafts(draft_cost=heads.draft_cost + DRAFT_STEP_COST) if config.speculate_auto else None
    drafter = HeadDrafter(runner.draft_heads, heads.max_drafts, adaptive.num_tokens if adaptive else None)
    return Speculation(heads.kind, drafter.propose, drafter.fill, adaptive)


def build_speculation(config: EngineConfig, runner: Any, model_config: Any,
                      draft_config: Any = None) -> Speculation | None:
    if config.speculate < 1:
        return None
    if isinstance(draft_config, HeadsConfig):
        return _build_heads(config, runner, draft_config)
    if draft_config is not None:
        if "draft" not in inspect.signature(runner.run).parameters:
            raise ValueError(f"--speculative-model is not supported by {type(runner).__name__} (ranks started by "
                             "srun or torchrun)")
        adaptive = None
        if config.speculate_auto:  # a draft forward costs about its share of the parameters
            share = draft_config.estimate_num_params() / max(model_config.estimate_num_params(), 1)
            adaptive = AdaptiveDrafts(draft_cost=share + DRAFT_STEP_COST)
        drafter = BatchDrafter(lambda spans: runner.run(spans, draft=True)[0],
                               adaptive.num_tokens if adaptive else None)
        return Speculation("draft", drafter.propose, drafter.fill, adaptive)
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

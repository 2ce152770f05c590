"""Model registry: config.json `architectures` name -> model class."""
from __future__ import annotations

from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(f"architecture {config.architecture!r} is not supported; supported: "
                         f"{', '.join(MODEL_REGISTRY)}") from None

"""Model registry: config.json `architectures` name -> model class."""
from __future__ import annotations

from torch import nn

from engine.model_config import ModelConfig
from engine.models.bloom import BloomForCausalLM
from engine.models.falcon import FalconForCausalLM
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.olmo2 import Olmo2ForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.starcoder2 import Starcoder2ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "FalconForCausalLM": FalconForCausalLM,
    "BloomForCausalLM": BloomForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    if config.impl == "transformers":
        from engine.models.transformers_backend import TransformersForCausalLM
        return TransformersForCausalLM
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(f"architecture {config.architecture!r} is not supported; supported: "
                         f"{', '.join(MODEL_REGISTRY)}") from None

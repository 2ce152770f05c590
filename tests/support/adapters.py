"""Tiny PEFT LoRA adapters for toolkit tests, made with the real `peft` library (imports torch)."""
from __future__ import annotations

from pathlib import Path


def make_adapter(base: Path, out: Path, *, seed: int = 0, rank: int = 4, base_name: str | None = None) -> Path:
    """Save a random LoRA adapter (q/v projections) for the model at `base` into `out`; PEFT records `base`
    (or `base_name`) as its base_model_name_or_path."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = base_name or str(base)
    peft_model.save_pretrained(str(out))
    return out

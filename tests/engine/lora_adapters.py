"""Tiny random PEFT LoRA adapters built with the real `peft` library, and their merged transformers models."""
from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir, out_dir, *, targets=ALL_TARGETS, r=4, alpha=8, seed=0, **lora_config):
    """Save a random adapter (lora_B is not zero: init_lora_weights=False) to `out_dir`; return the merged model.

    A and B are scaled down so the update changes the tokens without swamping the tiny base model.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **lora_config)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    peft_model.save_pretrained(out_dir)
    return peft_model.merge_and_unload().eval()

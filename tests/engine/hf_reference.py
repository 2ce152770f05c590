"""transformers' own greedy generation, the reference the engine's tokens are compared with."""
import torch


def hf_greedy(model, ids, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(ids):].tolist()

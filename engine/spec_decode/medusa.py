"""Medusa heads (`--speculative-model DIR` where DIR holds Medusa heads): k small heads on the target's last
hidden state, head i proposing the token i + 2 positions ahead, all k drafts from one hidden row.

The checkpoint is the one FasterDecoding's Medusa and TGI load: `config.json` with `medusa_num_heads` and
`medusa_num_layers` (plus `base_model_name_or_path`), and `medusa_lm_head.safetensors` whose head i has
`{i}.{j}.linear.{weight,bias}` (ResBlock j: x + SiLU(W x + b)) for j < medusa_num_layers and `{i}.{L}.weight`
(its vocabulary projection, L = medusa_num_layers). The heads run on rank 0 only (replicated), after the target
forward has left its final-norm hidden states in a `HiddenRows` store; `--speculate N` uses the first N heads.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine.batch import SeqSpan
from engine.spec_decode.head_drafter import DraftRow
from engine.spec_decode.hidden_rows import HiddenRows

WEIGHTS = ("medusa_lm_head.safetensors", "model.safetensors")


def is_medusa(path: str) -> bool:
    config = Path(path, "config.json")
    return config.is_file() and "medusa_num_heads" in json.loads(config.read_text())


def medusa_weights(path: str) -> Path:
    for name in WEIGHTS:
        if Path(path, name).is_file():
            return Path(path, name)
    raise ValueError(f"--speculative-model {path!r}: Medusa heads without weights; expected "
                     f"{' or '.join(WEIGHTS)} beside config.json")


def check_medusa(path: str, hidden_size: int, vocab_size: int, speculate: int, auto: bool) -> tuple[int, int]:
    """Refuse heads this target cannot use, before loading anything; the number of heads and the parameters
    of one."""
    config = json.loads(Path(path, "config.json").read_text())
    num_heads, num_layers = config.get("medusa_num_heads"), config.get("medusa_num_layers", 1)
    if not isinstance(num_heads, int) or num_heads < 1 or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"--speculative-model {path!r}: medusa_num_heads={num_heads!r}, "
                         f"medusa_num_layers={num_layers!r}; expected integers >= 1 and >= 0")
    if speculate > num_heads and not auto:
        raise ValueError(f"--speculate {speculate} with {num_heads} Medusa heads: each head drafts one token, "
                         f"use --speculate 1 to {num_heads}")
    with safe_open(medusa_weights(path), "pt") as f:
        names = set(f.keys())
        prefix = "medusa_head." if any(n.startswith("medusa_head.") for n in names) else ""
        for head in range(num_heads):
            name = f"{prefix}{head}.{num_layers}.weight"
            if name not in names:
                raise ValueError(f"--speculative-model {path!r}: no tensor {name!r} (head {head}'s projection)")
            shape = tuple(f.get_slice(name).get_shape())
            if shape != (vocab_size, hidden_size):
                raise ValueError(f"--speculative-model {path!r}: head {head} projects {shape[1]} -> {shape[0]}, the "
                                 f"model needs {hidden_size} -> {vocab_size}; these heads were trained for another "
                                 "model")
    return num_heads, num_layers * (hidden_size + 1) * hidden_size + vocab_size * hidden_size


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, path: str, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        config = json.loads(Path(path, "config.json").read_text())
        self.num_heads, num_layers = config["medusa_num_heads"], config.get("medusa_num_layers", 1)
        with safe_open(medusa_weights(path), "pt", device="cpu") as f:
            prefix = "medusa_head." if any(n.startswith("medusa_head.") for n in f.keys()) else ""
            tensors = {name[len(prefix):]: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)}
        vocab_size, hidden_size = tensors[f"0.{num_layers}.weight"].shape
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                          nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(self.num_heads))
        missing = set(self.heads.state_dict()) - set(tensors)
        if missing:
            raise ValueError(f"--speculative-model {path!r}: Medusa tensors missing: {', '.join(sorted(missing))}")
        self.heads.load_state_dict({name: tensors[name] for name in self.heads.state_dict()})
        self.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.hidden = HiddenRows(history=False)

    def observe(self, spans: list[SeqSpan], hidden: torch.Tensor, logits_rows: torch.Tensor, **_: Any) -> None:
        """After a target forward: keep each span's final-norm hidden rows of its logits rows."""
        self.hidden.put_spans(spans, hidden[logits_rows])

    @torch.inference_mode()
    def draft(self, rows: list[DraftRow], **_: Any) -> list[list[int]]:
        """Each row's drafts: head i's argmax on the hidden state that produced the row's last token (the
        position before it), or that token repeated where the state is gone (a poor draft, never a wrong
        output: the verifier decides)."""
        drafts = [[row.token_ids[row.num_computed]] * min(row.num_drafts, self.num_heads) for row in rows]
        found = []
        for i, row in enumerate(rows):
            state = self.hidden.get(row.seq_id, row.num_computed - 1, row.num_computed)
            if state is not None and drafts[i]:
                found.append((i, state))
        if not found:
            return drafts
        states = torch.cat([state for _, state in found])
        for head_index in range(max(len(drafts[i]) for i, _ in found)):
            active = [n for n, (i, _) in enumerate(found) if len(drafts[i]) > head_index]
            best = self.heads[head_index](states[active]).argmax(dim=-1).tolist()
            for n, token in zip(active, best):
                drafts[found[n][0]][head_index] = token
        return drafts

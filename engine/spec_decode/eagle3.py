"""EAGLE-3 (`--speculative-model DIR` holding an EAGLE-3 draft): one decoder layer that reads the target's
hidden states from three of its layers, keeps its own small KV cache and drafts a chain of tokens.

The checkpoint is the one vLLM and SGLang load as `LlamaForCausalLMEagle3` (the community EAGLE-3 drafts for
Llama 3.x and Qwen3): config.json (architectures naming Eagle3, hidden_size, heads, `draft_vocab_size`,
optionally `eagle_config.eagle_aux_hidden_state_layer_ids` and `norm_before_residual`) and weights
(safetensors or pytorch_model.bin) named `fc.weight` [hidden, 3 * hidden], `midlayer.*` (its q/k/v projections
read [embedding, feature], 2 * hidden wide; `hidden_norm` normalises the feature), `norm.weight`,
`lm_head.weight` over the draft vocabulary and `d2t` (target id = draft id + d2t[draft id]); the token
embeddings are the target's unless the checkpoint has `embed_tokens.weight`.

Alignment (EAGLE's): the draft's row at position i reads token i + 1 and the target's feature of position i
(fc of the inputs of layers `aux` at i), and predicts token i + 2 and, pre-norm, the feature of i + 1, which
the next draft step reads. The target's features wait in a `HiddenRows` store until the sequence drafts; a
draft first runs those positions (a prefill of one layer, rewriting its KV there), then one token per further
draft. Its KV lives in the target's blocks (the start-up budget counts it); slots past the computed tokens are
rewritten by the next catch-up, so the block manager's rollback covers it. Rank 0 only, one shard.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from engine.batch import SeqSpan
from engine.layers.attention import Attention
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.spec_decode.head_drafter import DraftRow
from engine.spec_decode.hidden_rows import HiddenRows


def _read(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = json.loads(Path(path, "config.json").read_text())
    files = sorted(Path(path).glob("*.safetensors"))
    if files:
        tensors = {name: t for f in files for name, t in load_file(f).items()}
    elif Path(path, "pytorch_model.bin").is_file():
        tensors = torch.load(Path(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"--speculative-model {path!r}: an EAGLE-3 config without weights (*.safetensors or "
                         "pytorch_model.bin)")
    renamed = {}
    for name, tensor in tensors.items():
        for prefix in ("model.", "layers.0."):
            if name.startswith(prefix):
                name = name[len(prefix):] if prefix == "model." else "midlayer." + name[len(prefix):]
        renamed[name] = tensor
    return config, renamed


def aux_layers(config: dict[str, Any], num_target_layers: int) -> list[int]:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else [2, num_target_layers // 2, num_target_layers - 3]


def check_eagle3(path: str, model_config: Any) -> int:
    """Refuse a draft this target cannot feed, before loading the target; the draft layer's parameters."""
    config, tensors = _read(path)
    hidden = model_config.hidden_size
    num_layers = model_config.num_hidden_layers
    layers = aux_layers(config, num_layers)
    if len(layers) != 3 or not all(isinstance(i, int) and 0 < i < num_layers for i in layers):
        raise ValueError(f"--speculative-model {path!r}: aux hidden-state layers {layers} for a model of "
                         f"{num_layers} layers; expected three of 1 to {num_layers - 1}")
    expected = {"fc.weight": (config.get("hidden_size"), 3 * hidden),
                "midlayer.self_attn.q_proj.weight": (None, 2 * hidden), "lm_head.weight": (None, hidden)}
    for name, (rows, cols) in expected.items():
        if name not in tensors:
            raise ValueError(f"--speculative-model {path!r}: no tensor {name!r}; not an EAGLE-3 draft as vLLM and "
                             "SGLang load it")
        shape = tuple(tensors[name].shape)
        if shape[1] != cols or (rows is not None and shape[0] != rows):
            raise ValueError(f"--speculative-model {path!r}: {name} is {list(shape)}, the model needs "
                             f"[{rows if rows is not None else '*'}, {cols}]; this draft was trained for another "
                             "model")
    if config.get("hidden_size") != hidden:
        raise ValueError(f"--speculative-model {path!r}: hidden_size {config.get('hidden_size')} != the model's "
                         f"{hidden}")
    draft_vocab = tensors["lm_head.weight"].shape[0]
    d2t = tensors.get("d2t")
    if (d2t is None and draft_vocab != model_config.vocab_size) or (d2t is not None and len(d2t) != draft_vocab):
        raise ValueError(f"--speculative-model {path!r}: a draft vocabulary of {draft_vocab} needs a d2t of that "
                         f"length (the model has {model_config.vocab_size} tokens)")
    if d2t is not None and int((torch.arange(draft_vocab) + d2t).max()) >= model_config.vocab_size:
        raise ValueError(f"--speculative-model {path!r}: d2t maps draft tokens past the model's vocabulary")
    return sum(t.numel() for name, t in tensors.items() if name.endswith("weight") and "embed" not in name)


class Eagle3Draft(nn.Module):
    def __init__(self, path: str, target: Any, model_config: Any, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        from engine.models.decoder import DecoderLayer
        inner = getattr(target, "model", None)
        if not hasattr(inner, "embed_tokens") or not all(isinstance(inner.layers[i], DecoderLayer)
                                                         for i in range(len(inner.layers))):
            raise ValueError(f"--speculative-model {path!r} is an EAGLE-3 draft, which reads the generic decoder's "
                             f"layers; {type(target).__name__} is not one (try --model-impl native)")
        config, tensors = _read(path)
        hidden = config["hidden_size"]
        num_heads, num_kv = config["num_attention_heads"], config.get("num_key_value_heads",
                                                                       config["num_attention_heads"])
        head_dim = config.get("head_dim") or hidden // num_heads
        eps = config.get("rms_norm_eps", 1e-6)
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.input_layernorm, self.hidden_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.post_attention_layernorm, self.norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(2 * hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, num_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, num_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        intermediate = config["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(hidden, intermediate, bias=False), nn.Linear(hidden, intermediate,
                                                                                              bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.lm_head = nn.Linear(hidden, tensors["lm_head.weight"].shape[0], bias=False)
        parameters = config.get("rope_parameters") or {}
        theta = config.get("rope_theta") or parameters.get("rope_theta", 10000.0)
        scaling = config.get("rope_scaling") or (parameters if parameters.get("rope_type", "default") != "default"
                                                  else None)
        max_position = max(config.get("max_position_embeddings", 0), model_config.max_position_embeddings)
        self.rotary = RotaryEmbedding(head_dim, max_position, theta, scaling)
        self.attn = Attention(num_heads, num_kv, head_dim, head_dim ** -0.5)
        self.num_heads, self.num_kv, self.head_dim = num_heads, num_kv, head_dim
        names = {"fc.weight": "fc.weight", "lm_head.weight": "lm_head.weight", "norm.weight": "norm.weight"}
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            names[f"{name}.weight"] = f"midlayer.{name}.weight"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{name}.weight"] = f"midlayer.self_attn.{name}.weight"
        for name in ("gate_proj", "up_proj", "down_proj"):
            names[f"{name}.weight"] = f"midlayer.mlp.{name}.weight"
        missing = [source for source in names.values() if source not in tensors]
        if missing:
            raise ValueError(f"--speculative-model {path!r}: EAGLE-3 tensors missing: {', '.join(missing)}")
        self.load_state_dict({name: tensors[source] for name, source in names.items()}, strict=False)
        d2t = tensors.get("d2t")
        self.register_buffer("draft_to_target", torch.arange(self.lm_head.out_features)
                             + (d2t.long() if d2t is not None else 0), persistent=False)
        self.embed = nn.Embedding.from_pretrained(tensors["embed_tokens.weight"]) \
            if "embed_tokens.weight" in tensors else None
        self.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.draft_to_target = self.draft_to_target.long()
        self.target_embed = target.model.embed_tokens
        self.features = HiddenRows()
        self._aux: dict[int, torch.Tensor] = {}
        self.aux_layers = aux_layers(config, model_config.num_hidden_layers)
        for i in set(self.aux_layers):   # the input of layer i: the previous layers' hidden states + residual
            target.model.layers[i].register_forward_pre_hook(self._capture(i))

    def _capture(self, index: int):
        def hook(_module: nn.Module, args: tuple) -> None:
            _positions, hidden, residual = args[:3]
            self._aux[index] = hidden if residual is None else hidden + residual
        return hook

    def graph_captured(self) -> dict[int, torch.Tensor]:
        """After a piecewise capture (engine/piecewise_graphs.py): the layer inputs its hooks took, the tensors
        whose addresses that size's replays rewrite (the hooks themselves do not run at replay)."""
        taps, self._aux = self._aux, {}
        return taps

    def graph_ran(self, taps: dict[int, torch.Tensor], num_tokens: int) -> None:
        """After a piecewise forward: the layer inputs of its real rows, for `observe`."""
        self._aux = {index: tensor[:num_tokens] for index, tensor in taps.items()}

    def bytes_per_block(self, block_size: int) -> int:
        return 2 * block_size * self.num_kv * self.head_dim * self.fc.weight.dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, backend: Any) -> None:
        weight = self.fc.weight
        self.kv_cache = torch.zeros(2, num_blocks, block_size, self.num_kv, self.head_dim, dtype=weight.dtype,
                                    device=weight.device)
        self.attn.k_cache, self.attn.v_cache, self.attn.impl = self.kv_cache[0], self.kv_cache[1], backend

    def observe(self, spans: list[SeqSpan], hidden: torch.Tensor, logits_rows: torch.Tensor, **_: Any) -> None:
        """After a target forward: every token's feature (fc of the three captured layer inputs), kept until
        its sequence drafts."""
        if set(self._aux) != set(self.aux_layers):
            return
        aux, self._aux = self._aux, {}
        features = self.fc(torch.cat([aux[i] for i in self.aux_layers], dim=-1))
        self.features.put_spans(spans, features, every_token=True)

    def layer(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
              meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocabulary, pre-norm hidden: the next step's feature)."""
        embeds = self.embed(input_ids) if self.embed is not None else self.target_embed(input_ids)
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            features = residual = self.hidden_norm(features)
        else:
            residual, features = features, self.hidden_norm(features)
        x = torch.cat([embeds, features], dim=-1)
        q = self.q_proj(x).reshape(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(-1, self.num_kv, self.head_dim)
        v = self.v_proj(x).reshape(-1, self.num_kv, self.head_dim)
        q, k = self.rotary(positions, q, k)
        x = self.o_proj(self.attn(q, k, v, meta))
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    @torch.inference_mode()
    def draft(self, rows: list[DraftRow], prepare: Any) -> list[list[int]]:
        """Each row's chain of drafts: the waiting positions first (one span per row, all rows in one
        forward), then one token per further draft; a row with no waiting feature drafts its last token
        repeated (poor, never wrong: the verifier decides)."""
        drafts = [[row.token_ids[row.num_computed]] * row.num_drafts for row in rows]
        active, spans, features = [], [], []
        for i, row in enumerate(rows):
            first = self.features.first(row.seq_id)
            pending = None if first is None else self.features.get(row.seq_id, first, row.num_computed)
            if pending is None:
                continue
            active.append(i)
            spans.append(SeqSpan(row.seq_id, row.token_ids[first + 1:row.num_computed + 1], first, row.block_table))
            features.append(pending)
            self.features.drop_before(row.seq_id, row.num_computed)
        for step in range(max((rows[i].num_drafts for i in active), default=0)):
            inputs = prepare(spans)
            normed, prenorm = self.layer(inputs.input_ids, inputs.positions, torch.cat(features), inputs.attention)
            best = self.draft_to_target[self.lm_head(normed[inputs.logits_rows]).argmax(dim=-1)].tolist()
            prenorm = prenorm[inputs.logits_rows]
            going, next_spans, next_features = [], [], []
            for n, i in enumerate(active):
                drafts[i][step] = best[n]
                if step + 1 < rows[i].num_drafts:
                    row = rows[i]
                    going.append(i)
                    next_spans.append(SeqSpan(row.seq_id, [best[n]], row.num_computed + step, row.block_table))
                    next_features.append(prenorm[n:n + 1])
            active, spans, features = going, next_spans, next_features
        return drafts

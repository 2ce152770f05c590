"""The transformers backend: any causal LM transformers builds from its config, on our scheduler and paged KV cache.

transformers builds `AutoModelForCausalLM` from config.json with its parameters on the meta device (buffers such
as RoPE frequencies are computed on the real one); our loader then fills them from the safetensors. The model's
attention modules call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`: we register `paged_attention`
there under ATTN_IMPLEMENTATION, and the step's AttentionMetadata reaches it as the forward kwarg `tgi_meta`
(transformers passes a forward's extra kwargs down to every attention call). The batch is one flattened row
[1, T] with explicit position_ids; transformers builds no mask for an implementation it does not know, so each
layer's paged attention (engine/attention/) applies causality, sliding windows and soft-caps itself. Layers with
attention sinks (gpt-oss) take this file's own torch path over the same cache.

A probe forward of two tokens after loading records every attention call (KV heads, head size, scale, window,
soft-cap, sinks) and gives each one an `Attention` that owns its slice of the cache. Models this cannot serve
fail in one line: attention that bypasses the interface, layers whose cache is not key/value, encoder-decoders.

Vision-language models (`AutoModelForImageTextToText`: LLaVA, LLaVA-NeXT, Idefics2/3, ...): only the language
model's attention is ours (the vision tower and other sub-models keep SDPA); `encode_images` runs the model's own
`get_image_features` on the processor's tensors, and `forward` takes those outputs placed at rows of the step
(engine/multimodal/encoder_cache.py) into the language model's input embeddings, as the model's own forward does.
Gemma 3's image tokens attend to each other both ways (BIDIRECTIONAL_IMAGE_MODELS): see
engine/attention/bidirectional.py.
M-RoPE models (Qwen2-VL) take [3, tokens] positions (engine/multimodal/mrope.py); Qwen3-VL's DeepStack features ride
beside the image embeddings and reach its first layers through the language model's own kwargs.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.attention.backend import causal_mask
from engine.distributed import layout
from engine.layers.attention import Attention, AttentionMetadata
from engine.model_config import ModelConfig
from engine.multimodal import mrope

ATTN_IMPLEMENTATION = "tgi_paged"
KV_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# image-text models whose image tokens attend to each other both ways, one run of image tokens at a time (transformers
# builds that mask from token_type_ids): the scheduler keeps each run in one prefill chunk, whose causal mask the
# attention widens (engine/attention/bidirectional.py)
BIDIRECTIONAL_IMAGE_MODELS = ("gemma3",)
_RECORDING = "tgi_probe"


def load_hf_config(path: str | Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def auto_class(hf_config: Any) -> Any:
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language model that has no causal-LM class
    or whose causal-LM class is its image-text class (Gemma 3's Gemma3ForConditionalGeneration)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    causal = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    image_text = AutoModelForImageTextToText._model_mapping.get(type(hf_config), None)
    if image_text is not None and causal in (None, image_text):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def image_token_id(hf_config: Any) -> int | None:
    """The image placeholder token of a vision-language model, None for a text model."""
    from transformers import AutoModelForImageTextToText

    if auto_class(hf_config) is not AutoModelForImageTextToText:
        return None
    token = getattr(hf_config, "image_token_id", None)
    return token if token is not None else getattr(hf_config, "image_token_index", None)


def unsupported_reason(hf_config: Any) -> str | None:
    """Why the backend cannot serve this model (checked before any weight loads), or None."""
    if getattr(hf_config, "is_encoder_decoder", False):
        return ("it is an encoder-decoder (the paged decoder path serves decoder-only models; `python -m engine` "
                "serves it on its encoder-decoder engine, engine/seq2seq/)")
    auto = auto_class(hf_config)
    model_cls = auto._model_mapping.get(type(hf_config), None)
    if model_cls is None:
        return f"transformers has no AutoModelForCausalLM class for model_type {hf_config.model_type!r}"
    if auto.__name__ != "AutoModelForCausalLM" and image_token_id(hf_config) is None:
        return "it is an image-text model without an image token id in its config"
    if _has_mrope(hf_config) and hf_config.model_type not in mrope.MODEL_TYPES:
        return (f"its M-RoPE positions (get_rope_index) follow {hf_config.model_type}'s own rules, which the engine "
                f"implements only for {', '.join(mrope.MODEL_TYPES)} (engine/multimodal/mrope.py)")
    text = hf_config.get_text_config()
    other = sorted(set(getattr(text, "layer_types", None) or ()) - KV_LAYER_TYPES)
    if other:
        return f"layers of type {', '.join(other)} keep a cache that is not key/value"
    judged = model_cls if auto.__name__ == "AutoModelForCausalLM" else _language_model_class(hf_config, model_cls)
    if not getattr(judged, "_supports_attention_backend", False):
        return (f"{judged.__name__}'s attention bypasses transformers' attention interface "
                "(it cannot use our paged attention)")
    if getattr(text, "attn_temperature_tuning", False) and 0 in (getattr(text, "no_rope_layers", None) or ()):
        return "its NoPE layers scale queries by positions counted from transformers' own cache"
    return None


def _has_mrope(hf_config: Any) -> bool:
    """Whether the model's positions come in sections computed from its image grids (Qwen2-VL's M-RoPE)."""
    from transformers import AutoModel

    return hasattr(AutoModel._model_mapping.get(type(hf_config), None), "get_rope_index")


def _language_model_class(hf_config: Any, model_cls: Any) -> Any:
    """The class whose attention the backend replaces in an image-text model (only the language model's attention
    is ours): its text model's class (DeepSeek-VL's top class declares no attention backend, its Llama does), or the
    top class when the model has no text model of its own."""
    from transformers import AutoModel

    text = hf_config.get_text_config()
    return model_cls if text is hf_config else AutoModel._model_mapping.get(type(text), model_cls)


def model_config(path: str | Path, raw: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a model served through transformers (no family knobs: transformers runs the layers)."""
    hf_config = load_hf_config(path)
    reason = unsupported_reason(hf_config)
    architectures = raw.get("architectures") or [raw.get("model_type")]
    if reason is not None:
        raise ValueError(f"{path}: {architectures[0]} cannot run on the transformers backend: {reason}")
    text = hf_config.get_text_config()
    heads = text.num_attention_heads
    max_positions = getattr(text, "max_position_embeddings", None) or 2048
    if getattr(text, "attention_chunk_size", None):  # within one chunk, chunked attention is causal attention
        max_positions = min(max_positions, text.attention_chunk_size)
    eos = raw.get("eos_token_id")
    return ModelConfig(
        architecture=architectures[0], model_type=hf_config.model_type, vocab_size=text.vocab_size,
        hidden_size=text.hidden_size, intermediate_size=getattr(text, "intermediate_size", None) or 0,
        num_hidden_layers=text.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        max_position_embeddings=max_positions, tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch."),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=list(eos) if isinstance(eos, list) else
        ([] if eos is None else [eos]), quantization_config=raw.get("quantization_config"),
        impl="transformers", source=str(path), image_token_id=image_token_id(hf_config),
        bidirectional_images=hf_config.model_type in BIDIRECTIONAL_IMAGE_MODELS)


def check_engine_options(num_shard: int, lora_adapters: list, quantize: str | None,
                         model_config: ModelConfig) -> None:
    """One-line refusals of what the backend does not do yet."""
    if model_config.impl != "transformers":
        return
    name = model_config.architecture
    if num_shard > 1:
        raise ValueError(f"{name} runs on the transformers backend, which has no tensor parallelism yet: "
                         "use --num-shard 1")
    if lora_adapters:
        raise ValueError(f"{name} runs on the transformers backend, which takes no LoRA adapters yet")
    if quantize or model_config.quantization_config:
        raise ValueError(f"{name} runs on the transformers backend, which serves unquantized checkpoints only")


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None, tgi_meta: AttentionMetadata | None = None,
                    tgi_probe: list | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [1, H, T, d], k/v [1, KV, T, d] -> ([1, T, H, d], None)."""
    num_tokens, num_heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, heads, d]
    layer = module.__dict__.get("tgi_attention")
    if layer is None:  # the probe (or a forward before it): one causal sequence, recorded
        if tgi_probe is not None:
            problem = None
            if v.shape[-1] != k.shape[-1] or k.shape[-1] != head_dim:
                problem = f"keys of {k.shape[-1]} and values of {v.shape[-1]} per head (one KV size needed)"
            elif attention_mask is not None:
                problem = "it builds its own attention mask, which paged attention cannot apply"
            tgi_probe.append((module, dict(num_heads=num_heads, num_kv_heads=k.shape[1], head_dim=head_dim,
                                           scale=scaling if scaling is not None else head_dim ** -0.5,
                                           sliding_window=sliding_window, logit_softcap=softcap), problem))
        layer = Attention(num_heads, k.shape[1], head_dim, scaling or head_dim ** -0.5, sliding_window,
                          logit_softcap=softcap)
        tgi_meta = None
    if s_aux is not None:
        out = sink_attention(layer, q, k, v, s_aux, tgi_meta)
    else:
        out = layer(q, k, v, tgi_meta)
    return out.view(1, num_tokens, num_heads, -1), None


def sink_attention(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   meta: AttentionMetadata | None) -> torch.Tensor:
    """Attention whose softmax also counts one learned logit per head (gpt-oss), per sequence over the cache."""
    if meta is None or layer.k_cache.numel() == 0:
        mask = causal_mask(q.shape[0], 0, q.shape[0], layer.sliding_window, q.device)
        return _sink_attend(layer, q, k, v, mask, sinks).reshape(q.shape[0], -1)
    layer.impl.store(layer, k, v, meta.slot_mapping)
    keys = layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    values = layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    out, start = q.new_empty(q.shape), 0
    for b, (num_queries, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        positions = torch.arange(seq_len, device=q.device)
        blocks = meta.block_tables[b, positions // meta.block_size].long()
        slots = blocks * meta.block_size + positions % meta.block_size
        mask = causal_mask(num_queries, seq_len - num_queries, seq_len, layer.sliding_window, q.device)
        rows = slice(start, start + num_queries)
        out[rows] = _sink_attend(layer, q[rows], keys.index_select(0, slots), values.index_select(0, slots), mask,
                                 sinks)
        start += num_queries
    return out.reshape(q.shape[0], -1)


def _sink_attend(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 sinks: torch.Tensor) -> torch.Tensor:
    """q [Q, H, d], k/v [K, KV, d], mask [Q, K] -> [Q, H, d]."""
    groups = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(groups, dim=1).transpose(0, 1), v.repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(-1, -2)).float() * layer.scale  # [H, Q, K]
    if layer.logit_softcap:
        scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v).transpose(0, 1)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters are created on the meta device (our loader materializes them), buffers where they belong."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a meta one is being tied to another: kept as it is
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class TransformersForCausalLM(nn.Module):
    """The engine's model interface (forward, compute_logits, attention_layers, checkpoint routing) over a
    transformers model. Tied parameters stay tied: the same tensor is materialized once."""

    packed_modules_mapping: dict[str, tuple[str, Any]] = {}
    supports_cuda_graphs = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        if layout().tp_size > 1 or layout().pp_size > 1:
            raise ValueError(f"{config.architecture} runs on the transformers backend, which has no tensor or "
                             "pipeline parallelism yet: use one rank")
        _register()
        self.config = config
        hf_config = load_hf_config(config.source)
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        auto = auto_class(hf_config)
        attn: Any = ATTN_IMPLEMENTATION
        if auto is not AutoModelForCausalLM:  # a vision tower (or resampler) keeps SDPA: only the text is paged
            attn = {name: "sdpa" for name in ("", *hf_config.sub_configs)} | {"text_config": ATTN_IMPLEMENTATION}
        with _parameters_on_meta():
            hf = auto.from_config(hf_config, attn_implementation=attn, dtype=dtype)
        materialized: dict[int, nn.Parameter] = {}
        for module in hf.modules():
            for name, param in module._parameters.items():
                if param is not None and param.is_meta:
                    if id(param) not in materialized:
                        materialized[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype,
                                                                           device=device), requires_grad=False)
                    module._parameters[name] = materialized[id(param)]
        self.hf = hf.eval()
        self.lm_head = hf.get_output_embeddings()
        trunk = [module for module in hf.children() if module is not self.lm_head]  # the body under the LM head
        self.base = trunk[0] if len(trunk) == 1 else hf.base_model
        self.is_multimodal = auto is not AutoModelForCausalLM
        if self.is_multimodal:  # the language model under the multimodal trunk: it takes placed embeddings
            self.base = getattr(self.base, "language_model", None) or getattr(self.base, "text_model")
        self.buffers_by_name = dict(hf.named_buffers())
        self.renamings: list | None = None
        self.layers: list[Attention] | None = None
        text = hf_config.get_text_config()
        self.logit_scale = getattr(text, "logit_scale", None)               # Cohere: multiplied
        self.logits_scaling = getattr(text, "logits_scaling", None)         # Granite: divided
        self.final_logit_softcap = getattr(text, "final_logit_softcapping", None)

    def route_checkpoint_tensor(self, name: str, loaded: Any) -> list[tuple[str, Any, Any]]:
        """Checkpoint names through transformers' own renamings (legacy names, base-model prefix)."""
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        if self.renamings is None:
            from transformers.conversion_mapping import get_model_conversion_mapping
            transforms = get_model_conversion_mapping(self.hf)
            self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
            self.converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
            self.known = {**dict.fromkeys(dict(self.hf.named_parameters(remove_duplicate=False)), True),
                          **dict.fromkeys(self.buffers_by_name, True)}
        target, converter = rename_source_key(name, self.renamings, self.converters, self.hf.base_model_prefix,
                                              self.known)
        if converter is not None:
            raise ValueError(f"{self.config.architecture}: checkpoint tensor {name!r} must be merged with others "
                             f"({converter}); the transformers backend loads one tensor per parameter")
        if target in self.buffers_by_name:  # a persistent buffer saved in the checkpoint
            self.buffers_by_name[target].copy_(torch.as_tensor(loaded[:]))
            return []
        return [(f"hf.{target}", None, loaded)]

    def skipped_checkpoint_tensors(self) -> tuple[str, ...]:
        return ("rotary_emb.inv_freq",)

    def attention_layers(self) -> list[Attention]:
        """One Attention per attention call of a forward, found by a two-token probe of the loaded model."""
        if self.layers is None:
            self.layers = self._probe()
        return self.layers

    @torch.inference_mode()
    def _probe(self) -> list[Attention]:
        calls: list = []
        device = next(self.hf.parameters()).device
        ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
        self.base(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False,
                  **{_RECORDING: calls})
        name = self.config.architecture
        if not calls:
            raise ValueError(f"{name}: no attention layer called transformers' attention interface; "
                             "its attention cannot run on the transformers backend")
        if len({id(module) for module, _, _ in calls}) < len(calls):
            raise ValueError(f"{name}: an attention module runs more than once per forward (shared layers); "
                             "the transformers backend keeps one KV cache per module")
        layers = []
        for module, shape, problem in calls:
            if problem is not None:
                raise ValueError(f"{name} cannot run on the transformers backend: {problem}")
            if (shape["num_kv_heads"], shape["head_dim"]) != (self.config.num_key_value_heads, self.config.head_dim):
                raise ValueError(f"{name}: attention layers with {shape['num_kv_heads']} KV heads of "
                                 f"{shape['head_dim']} (config: {self.config.num_key_value_heads} of "
                                 f"{self.config.head_dim}); the transformers backend needs one KV shape")
            layer = Attention(**shape)
            module.__dict__["tgi_attention"] = layer  # not a submodule: the HF module tree stays as built
            layers.append(layer)
        return layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None = None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`positions`: [tokens], or [3, tokens] for M-RoPE (engine/multimodal/mrope.py). `image_embeds`: (rows,
        vectors) that replace those rows' token embeddings (engine/multimodal)."""
        self.attention_layers()
        position_ids = positions[None] if positions.dim() == 1 else positions[:, None]  # [1, T] or [3, 1, T]
        if image_embeds is None:
            out = self.base(input_ids=input_ids[None], position_ids=position_ids, use_cache=False, tgi_meta=meta)
        else:
            rows, vectors = image_embeds
            vectors, *deepstack = vectors.split(self.config.hidden_size, dim=-1)
            extra = {}
            if deepstack:  # added to the hidden states at those rows after each of the first layers
                mask = torch.zeros(1, input_ids.shape[0], dtype=torch.bool, device=rows.device)
                extra = dict(visual_pos_masks=mask.index_fill_(1, rows, True), deepstack_visual_embeds=deepstack)
            embeds = self.base.get_input_embeddings()(input_ids)
            embeds = embeds.index_copy(0, rows, vectors.to(embeds.dtype))
            out = self.base(inputs_embeds=embeds[None], position_ids=position_ids, use_cache=False, tgi_meta=meta,
                            **extra)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def encode_images(self, encoder_inputs: dict[str, Any]) -> torch.Tensor:
        """The vision encoder (+ projector) on the processor's tensors: [image tokens, hidden], in token order.
        DeepStack models (Qwen3-VL) append each of their extra per-layer features as `hidden` more columns."""
        device = self.lm_head.weight.device
        dtype = self.lm_head.weight.dtype
        inputs = {k: v.to(device, dtype if v.is_floating_point() else None) for k, v in encoder_inputs.items()}
        out = self.hf.model.get_image_features(**inputs, return_dict=True)
        layers = [out.pooler_output, *(getattr(out, "deepstack_features", None) or ())]
        return torch.cat([torch.cat([f.reshape(-1, f.shape[-1]) for f in features]) for features in layers],
                         dim=-1).to(dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

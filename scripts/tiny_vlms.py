"""Tiny random vision-language models with their real processor classes (offline, for scripts/make_models.py).

Each recipe: the text model (a tiny Llama, Mistral, Qwen3 or Cohere2), a tiny vision tower, the family's processor
over the tiny BPE tokenizer with the family's image special tokens added. The Qwen-VL processors are built without
their video processor. Mistral 3 (PixtralProcessor), SmolVLM (which also needs num2words) and Command A Vision have
processors that need torchvision (TORCHVISION_VLMS).
"""
from __future__ import annotations

from pathlib import Path

_TEXT = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
             tie_word_embeddings=False)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
               patch_size=8)
_PINPOINTS = [[32, 32], [32, 64], [64, 32]]
_IDEFICS_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
_PIXTRAL_TOKENS = {"image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>",
                   "image_end_token": "<|vision_end|>"}
_AYA_TOKENS = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]
_GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
_QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])  # (time, height, width) of head_dim / 2
# name -> (model class, special tokens added, image token)
VLM_MODELS: dict[str, tuple[str, list[str], str]] = {
    "tiny-llava": ("LlavaForConditionalGeneration", ["<image>"], "<image>"),
    "tiny-llava-next": ("LlavaNextForConditionalGeneration", ["<image>"], "<image>"),
    "tiny-idefics3": ("Idefics3ForConditionalGeneration", _IDEFICS_TOKENS, "<image>"),
    "tiny-idefics2": ("Idefics2ForConditionalGeneration", _IDEFICS_TOKENS[:2] + _IDEFICS_TOKENS[3:], "<image>"),
    "tiny-vipllava": ("VipLlavaForConditionalGeneration", ["<image>"], "<image>"),
    "tiny-lightonocr": ("LightOnOcrForConditionalGeneration", list(_PIXTRAL_TOKENS.values()), "<|image_pad|>"),
    "tiny-aya-vision": ("AyaVisionForConditionalGeneration", _AYA_TOKENS, "<|IMG_PATCH|>"),
    "tiny-deepseek-vl": ("DeepseekVLForConditionalGeneration", ["<image_placeholder>"], "<image_placeholder>"),
    "tiny-gemma3-vision": ("Gemma3ForConditionalGeneration", list(_GEMMA3_TOKENS.values()), "<image_soft_token>"),
    "tiny-qwen2-vl": ("Qwen2VLForConditionalGeneration", _QWEN_VL_TOKENS, "<|image_pad|>"),
    "tiny-qwen2.5-vl": ("Qwen2_5_VLForConditionalGeneration", _QWEN_VL_TOKENS, "<|image_pad|>"),
    "tiny-qwen3-vl": ("Qwen3VLForConditionalGeneration", _QWEN_VL_TOKENS, "<|image_pad|>"),
    "tiny-mistral3": ("Mistral3ForConditionalGeneration", ["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "[IMG]"),
    "tiny-smolvlm": ("SmolVLMForConditionalGeneration", _IDEFICS_TOKENS, "<image>"),
    "tiny-command-a-vision": ("Cohere2VisionForConditionalGeneration", _AYA_TOKENS, "<|IMG_PATCH|>"),
}
TORCHVISION_VLMS = ["tiny-mistral3", "tiny-smolvlm", "tiny-command-a-vision"]


def torchvision_works() -> bool:
    """Whether torchvision imports here: PyPI's wheel is built against PyPI's (CUDA) torch of the same release and
    does not import beside a CPU torch wheel ('operator torchvision::nms does not exist')."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


def _config_and_processor(name: str, tok, image_id: int):
    import transformers as T

    text = T.LlamaConfig(**_TEXT, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    if name == "tiny-llava":
        config = T.LlavaConfig(vision_config=T.CLIPVisionConfig(**_VISION), text_config=text,
                               image_token_index=image_id)
        images = T.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        return config, T.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                        vision_feature_select_strategy="default", image_token="<image>",
                                        num_additional_image_tokens=1)
    if name == "tiny-llava-next":  # any-resolution tiles + a newline per row
        config = T.LlavaNextConfig(vision_config=T.CLIPVisionConfig(**_VISION), text_config=text,
                                   image_token_index=image_id, image_grid_pinpoints=_PINPOINTS)
        images = T.LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                           image_grid_pinpoints=_PINPOINTS)
        return config, T.LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                            vision_feature_select_strategy="default", image_token="<image>",
                                            num_additional_image_tokens=1)
    if name == "tiny-idefics3":  # pixel shuffle; SmolVLM's architecture
        config = T.Idefics3Config(vision_config=T.Idefics3VisionConfig(**_VISION), text_config=text,
                                  image_token_id=image_id, scale_factor=2)
        images = T.Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": 32},
                                          max_image_size={"longest_edge": 32})
        return config, T.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4)
    if name == "tiny-vipllava":  # LLaVA with features from several vision layers
        config = T.VipLlavaConfig(vision_config=T.CLIPVisionConfig(**_VISION), text_config=text,
                                  image_token_index=image_id, vision_feature_layer=[-2, -1], image_seq_length=16)
        images = T.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        return config, T.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                        vision_feature_select_strategy="default", image_token="<image>",
                                        num_additional_image_tokens=1)
    if name == "tiny-lightonocr":  # Pixtral's vision tower (2D RoPE, native aspect ratio) on a Qwen3 text model
        tok._set_model_specific_special_tokens(special_tokens=_PIXTRAL_TOKENS)
        qwen3 = T.Qwen3Config(**_TEXT, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        vision = T.PixtralVisionConfig(**{**_VISION, "head_dim": 16})
        config = T.LightOnOcrConfig(vision_config=vision, text_config=qwen3, image_token_id=image_id,
                                    spatial_merge_size=2, tie_word_embeddings=False)
        images = T.PixtralImageProcessor(size={"longest_edge": 32}, patch_size=8)
        return config, T.LightOnOcrProcessor(image_processor=images, tokenizer=tok, patch_size=8, spatial_merge_size=2)
    if name == "tiny-aya-vision":  # SigLIP + pixel shuffle on a Cohere2 text model (sliding-window layers)
        cohere2 = T.Cohere2Config(**{k: v for k, v in _TEXT.items() if k != "rms_norm_eps"}, vocab_size=len(tok),
                                  sliding_window=64, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
        config = T.AyaVisionConfig(vision_config=T.SiglipVisionConfig(**_VISION), text_config=cohere2,
                                   image_token_index=image_id, downsample_factor=2, tie_word_embeddings=False)
        images = T.GotOcr2ImageProcessor(size={"height": 32, "width": 32}, crop_to_patches=True, max_patches=2)
        return config, T.AyaVisionProcessor(image_processor=images, tokenizer=tok, patch_size=8, img_size=32,
                                            downsample_factor=2)
    if name == "tiny-deepseek-vl":  # SigLIP + an MLP aligner on a Llama text model, a fixed number of image tokens
        tok._set_model_specific_special_tokens(special_tokens={"image_token": "<image_placeholder>"})
        config = T.DeepseekVLConfig(vision_config=T.SiglipVisionConfig(**_VISION), text_config=text,
                                    image_token_id=image_id, tie_word_embeddings=False)
        images = T.DeepseekVLImageProcessorPil(size={"height": 32, "width": 32})  # the torch one needs torchvision
        return config, T.DeepseekVLProcessor(image_processor=images, tokenizer=tok, num_image_tokens=16)
    if name == "tiny-gemma3-vision":  # SigLIP + average pooling on a Gemma 3 text model; an image's tokens attend
        # to each other both ways, and its 4 tokens outnumber the sliding layers' window of 3
        tok._set_model_specific_special_tokens(special_tokens=_GEMMA3_TOKENS)
        ids = {k: tok.convert_tokens_to_ids(v) for k, v in _GEMMA3_TOKENS.items()}
        gemma3 = T.Gemma3TextConfig(**{k: v for k, v in _TEXT.items() if k != "tie_word_embeddings"},
                                    vocab_size=len(tok), sliding_window=3, query_pre_attn_scalar=16,
                                    layer_types=["sliding_attention", "full_attention"],
                                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id)
        config = T.Gemma3Config(vision_config=T.SiglipVisionConfig(**_VISION), text_config=gemma3,
                                mm_tokens_per_image=4, image_token_index=image_id, boi_token_index=ids["boi_token"],
                                eoi_token_index=ids["eoi_token"], initializer_range=0.1)
        images = T.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})  # the torch one needs torchvision
        return config, T.Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4)
    if name in ("tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"):
        return _qwen_vl(name, tok, image_id)
    if name in TORCHVISION_VLMS:
        return _torchvision_family(name, tok, text, image_id)
    # tiny-idefics2: a perceiver resampler on a Mistral text model
    mistral = T.MistralConfig(**_TEXT, vocab_size=len(tok), sliding_window=None, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = T.Idefics2Config(vision_config=dict(_VISION), text_config=mistral, image_token_id=image_id,
                              perceiver_config=dict(hidden_size=64, resampler_n_latents=4, resampler_depth=1,
                                                    resampler_n_heads=2, resampler_head_dim=8, num_key_value_heads=1))
    images = T.Idefics2ImageProcessor(do_image_splitting=False, size={"longest_edge": 32, "shortest_edge": 16})
    return config, T.Idefics2Processor(image_processor=images, tokenizer=tok, image_seq_len=4)


def _qwen_vl(name: str, tok, image_id: int):
    """M-RoPE text model, a native-resolution vision tower (2x2 patches merged per token), the image processor alone:
    the video processor needs torchvision."""
    import transformers as T

    tokens = dict(image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
                  vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>")
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in tokens.items()}
    text = dict(**{k: v for k, v in _TEXT.items() if k != "head_dim"}, vocab_size=len(tok), rope_parameters=_MROPE,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if name == "tiny-qwen2-vl":
        vision = T.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=8)
        config = T.Qwen2VLConfig(text_config=T.Qwen2VLTextConfig(**text), vision_config=vision, **ids)
        processor_cls = T.Qwen2VLProcessor
    elif name == "tiny-qwen2.5-vl":  # window attention in the vision tower but in its full-attention blocks
        vision = T.Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                          out_hidden_size=64, patch_size=8, window_size=32, fullatt_block_indexes=[1])
        config = T.Qwen2_5_VLConfig(text_config=T.Qwen2_5_VLTextConfig(**text), vision_config=vision, **ids)
        processor_cls = T.Qwen2_5_VLProcessor
    else:  # interleaved M-RoPE, q/k norms; DeepStack: vision layers 0 and 1 also feed the first two text layers
        rope = dict(_MROPE, mrope_section=[4, 2, 2], mrope_interleaved=True)
        text = {**{k: v for k, v in text.items() if k not in ("bos_token_id", "eos_token_id")}, "head_dim": 16,
                "rope_parameters": rope}
        vision = T.Qwen3VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                       patch_size=8, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
                                       initializer_range=0.2)
        config = T.Qwen3VLConfig(text_config=T.Qwen3VLTextConfig(**text), vision_config=vision, **ids)
        processor_cls = T.Qwen3VLProcessor
    config.tie_word_embeddings = False
    images = T.Qwen2VLImageProcessorPil(patch_size=8, merge_size=2,
                                        size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})

    class ImagesOnly(processor_cls):  # its own __init__ wants a video processor, which needs torchvision
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template, **kwargs)

    ImagesOnly.__name__ = processor_cls.__name__  # saved as the family's processor class, as checkpoints are
    return config, ImagesOnly(image_processor=images, tokenizer=tok)


def _torchvision_family(name: str, tok, text, image_id: int):
    import transformers as T

    if name == "tiny-mistral3":  # Pixtral's vision tower + patch merger on a Mistral text model
        mistral = T.MistralConfig(**_TEXT, vocab_size=len(tok), sliding_window=None, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        config = T.Mistral3Config(vision_config=T.PixtralVisionConfig(**{**_VISION, "head_dim": 16}),
                                  text_config=mistral, image_token_index=image_id, spatial_merge_size=2,
                                  tie_word_embeddings=False)
        images = T.PixtralImageProcessor(size={"longest_edge": 48}, patch_size=8)
        return config, T.PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=8, spatial_merge_size=2)
    if name == "tiny-smolvlm":  # Idefics3's architecture; its processor splits an image into tiles + a global one
        config = T.SmolVLMConfig(vision_config=T.SmolVLMVisionConfig(**_VISION), text_config=text,
                                 image_token_id=image_id, scale_factor=2)
        images = T.SmolVLMImageProcessor(do_image_splitting=True, size={"longest_edge": 64},
                                         max_image_size={"longest_edge": 32})
        videos = T.SmolVLMVideoProcessor(size={"longest_edge": 32}, max_image_size={"longest_edge": 32})
        return config, T.SmolVLMProcessor(image_processor=images, tokenizer=tok, video_processor=videos,
                                          image_seq_len=4)
    # tiny-command-a-vision: SigLIP + pixel shuffle on a Cohere2 text model, tiles by aspect ratio
    tok._set_model_specific_special_tokens(special_tokens={
        "image_token": "<|IMG_PATCH|>", "boi_token": "<|START_OF_IMG|>", "eoi_token": "<|END_OF_IMG|>",
        "img_line_break_token": "<|IMG_LINE_BREAK|>"})
    cohere2 = T.Cohere2Config(**{k: v for k, v in _TEXT.items() if k != "rms_norm_eps"}, vocab_size=len(tok),
                              sliding_window=64, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    config = T.Cohere2VisionConfig(vision_config=T.SiglipVisionConfig(**_VISION), text_config=cohere2,
                                   image_token_id=image_id, downsample_factor=2, alignment_intermediate_size=64,
                                   tie_word_embeddings=False)
    images = T.Cohere2VisionImageProcessor(size={"height": 32, "width": 32}, patch_size=2, max_patches=2)
    return config, T.Cohere2VisionProcessor(image_processor=images, tokenizer=tok)


def build_vlm(name: str, out: Path, train_tokenizer) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    model_cls, specials, image_token = VLM_MODELS[name]
    tok = train_tokenizer(out)
    tok.add_special_tokens({"additional_special_tokens": specials})
    config, processor = _config_and_processor(name, tok, tok.convert_tokens_to_ids(image_token))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    eos_ids = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")})
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos_ids, pad_token_id=tok.pad_token_id,
                     do_sample=False, max_new_tokens=32).save_pretrained(out)

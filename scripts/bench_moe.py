"""MoE speed on random Qwen3-MoE-shaped models: our experts against transformers' own MoE forward, in one run.

    python scripts/bench_moe.py                                   # tiny and mid, CPU, fp32
    python scripts/bench_moe.py --device cuda --dtype bfloat16 --sizes mid,large   # GPU (Triton kernel)

(a) One MoE layer (router + experts) on the same weights: transformers' Qwen3MoeSparseMoeBlock against
    engine.layers.fused_moe.FusedMoE (CPU: each expert once over its tokens; CUDA: the Triton grouped
    GEMM), for decode-sized and prefill-sized token counts; outputs are checked to agree first.
(b) The whole model: LLMEngine.generate against transformers' generate (one batch of equal-length
    prompts, greedy, ignore EOS), aggregate new tokens per second.
Ratios > 1 mean the engine is faster.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SIZES = {  # Qwen3-MoE shapes; "large" is one 30B-A3B layer's MoE width with fewer layers
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128),
    "mid": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=1024),
    "large": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                  head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                  intermediate_size=6144),
}


def build(size: str, folder: Path, dtype: torch.dtype):
    """A random Qwen3-MoE saved as a snapshot (tiny BPE tokenizer beside it); returns the HF model."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from make_models import train_tokenizer

    tok = train_tokenizer(folder)
    config = Qwen3MoeConfig(**SIZES[size], vocab_size=len(tok), norm_topk_prob=True, max_position_embeddings=4096,
                            initializer_range=0.05, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                            bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(folder)
    return model.to(dtype).eval()


def timed(fn, device: torch.device, repeats: int, min_seconds: float = 0.3) -> float:
    """Best wall time of at least `repeats` calls (and `min_seconds` of calls) after one warm-up: the
    minimum is what survives other processes sharing the cores."""
    fn()
    best, deadline, done = float("inf"), time.perf_counter() + min_seconds, 0
    while done < repeats or time.perf_counter() < deadline:
        done += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def bench_layer(hf_model, size: str, device: torch.device, dtype: torch.dtype, token_counts: list[int],
                repeats: int) -> None:
    from engine.layers import cpu_gemm, fused_moe

    cfg = SIZES[size]
    block = hf_model.model.layers[0].mlp
    router = block.gate.weight.data
    variants = {}
    for name in ("aten", "onednn"):
        if name == "onednn" and cpu_gemm.choose("auto", device, dtype) != "onednn":
            continue  # on CUDA: one variant, the Triton kernel
        layer = fused_moe.FusedMoE(cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"],
                                   cfg["moe_intermediate_size"], renormalize=True).to(device, dtype)
        layer.w13.data.copy_(block.experts.gate_up_proj.data)  # transformers 5 stacks [E, 2I, H], gate first
        layer.w2.data.copy_(block.experts.down_proj.data)
        if name == "onednn":  # as the engine does at load on CPU (--cpu-gemm auto)
            cpu_gemm.prepack_model(layer)
        variants[name] = layer
    calls = {name: layer for name, layer in variants.items()}
    if device.type == "cuda":  # A/B: the tiles chosen per shape against the one fixed launch used before them
        from engine.kernels import moe

        def fixed_tiles(layer=variants["aten"], choose=moe.tile_config):
            def call(x, logits):
                moe.tile_config = lambda *args: {"block_m": 16, "block_n": 64, "block_k": 32, "num_warps": 4,
                                                 "num_stages": 3}
                try:
                    return layer(x, logits)
                finally:
                    moe.tile_config = choose
            return call
        calls = {"per-shape tiles": variants["aten"], "fixed tiles": fixed_tiles()}
    print(f"\n(a) one MoE layer, {size}: {cfg['num_experts']} experts, top {cfg['num_experts_per_tok']}, "
          f"hidden {cfg['hidden_size']}, expert width {cfg['moe_intermediate_size']}; tok/s, ratio to transformers")
    print(f"{'tokens':>7} {'transformers':>13}" + "".join(f" {name:>16}" for name in calls))
    for tokens in token_counts:
        x = torch.randn(tokens, cfg["hidden_size"], device=device, dtype=dtype) * 0.5
        row = f"{tokens:>7}"
        with torch.inference_mode():
            want = block(x[None])[0]
            hf_s = timed(lambda: block(x[None]), device, repeats)
            row += f" {tokens / hf_s:>13,.0f}"
            for layer in calls.values():
                got = layer(x, x @ router.T)
                tolerance = 1e-4 if dtype == torch.float32 else 5e-2
                torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
                our_s = timed(lambda: layer(x, x @ router.T), device, repeats)
                row += f" {tokens / our_s:>9,.0f} {hf_s / our_s:>5.2f}x"
        print(row + f"   ({variants['aten'].backend})")


def bench_generate(hf_model, folder: Path, size: str, device: torch.device, dtype: torch.dtype, batch: int,
                   prompt_len: int, new_tokens: int) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, hf_model.config.vocab_size, (batch, prompt_len), generator=generator)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine_s = {}
    for gemm in ("aten", "auto") if device.type == "cpu" else ("auto",):
        config = EngineConfig(model_id=str(folder), device=device.type, dtype=str(dtype).removeprefix("torch."),
                              cpu_kv_cache_bytes=256 * 2**20, cpu_gemm=gemm)
        with LLMEngine(config) as engine:
            engine.generate(prompts[:2].tolist(), SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
            start = time.perf_counter()
            outs = engine.generate(prompts.tolist(), params)
            engine_s[engine.runner.linear_backend] = time.perf_counter() - start
        assert all(len(out.tokens) == new_tokens for out in outs)
    ids = prompts.to(device)
    with torch.inference_mode():
        hf_model.generate(ids[:2], max_new_tokens=2, do_sample=False, min_new_tokens=2)  # warm-up
        start = time.perf_counter()
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=hf_model.generation_config.pad_token_id)
        hf_s = time.perf_counter() - start
    total = batch * new_tokens
    print(f"\n(b) generation, {size}: {batch} prompts x {prompt_len} tokens, {new_tokens} new tokens each")
    print(f"    transformers generate {total / hf_s:8.1f} tok/s" + "".join(
        f"   engine ({name} linears) {total / seconds:8.1f} tok/s, {hf_s / seconds:.2f}x"
        for name, seconds in engine_s.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,mid", help=f"comma-separated: {', '.join(SIZES)}")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", default="1,16,256,2048", help="token counts for (a)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# bench_moe {now:%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device} {args.dtype}")
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-moe-{size}-") as tmp:
            hf_model = build(size, Path(tmp), dtype).to(device)
            bench_layer(hf_model, size, device, dtype, [int(t) for t in args.tokens.split(",")], args.repeats)
            bench_generate(hf_model, Path(tmp), size, device, dtype, args.batch, args.prompt_len, args.new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does a decoder compiled by Inductor beat the eager engine on CPU? (issue 20, Deliver 2)

    python scripts/bench_compile.py --threads 1                      # eager vs compiled, decode and prefill steps
    python scripts/bench_compile.py --threads 1 --linear aten        # linears left to Inductor (plain weights)
    python scripts/bench_compile.py --threads 1 --linear whole       # all layers in one graph, Inductor freezing
    python scripts/bench_compile.py --threads 1 --linear whole-onednn  # all layers in one graph, oneDNN ops
    python scripts/bench_compile.py --threads 1 --cpp-wrapper        # Inductor's C++ wrapper (less Python per call)
    python scripts/bench_compile.py --threads 1 --cache /tmp/fresh   # cold compile: an empty Inductor cache

One Llama-layout decoder layer (SmolLM2) is written as a function of its weights and compiled once with Inductor's
CPU backend; the same compiled graph runs all the layers (weights are inputs, not constants). The attention + KV
write is an opaque custom op (`bench_compile::attention`) around the engine's chosen backend; with `--linear
onednn` (default) the linears are opaque custom ops around the engine's prepacked oneDNN call
(engine/layers/cpu_gemm.py), with `--linear aten` they are F.linear for Inductor to lower; `--linear whole`
compiles all the layers as one module with `torch._inductor.config.freezing` (weights become constants that
Inductor prepacks for oneDNN/MKL itself), `--linear whole-onednn` as one module with the opaque oneDNN linears and
no freezing; in both the ops take the layer index. Norms, RoPE, SiLU-and-mul and residual adds are eager torch ops
for Inductor to fuse; the token dimension is dynamic (`dynamic=True`; `--static`: one graph per token count). The
embedding, final norm and LM head stay eager. The steps timed are the model runner's (forward + logits): a decode
step of 16 sequences at 128 and 1024 tokens of context, and a 1,024-token prefill; median CPU and wall ms of
`--repeat` x 5 steps, eager and compiled alternately in one process. The compile time is that of the first compiled
step (cold with an empty `--cache`, warm from the cache of an earlier run), and the logits of both paths are
compared (max |diff| and argmax).

A benchmark script only: the engine has no compiled path (docs/benchmarks.md, "Engine speed per workload").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE), str(HERE / "scripts")]

CURRENT: dict = {}  # the layer the compiled graph is running and the step's attention metadata


def register_ops():
    import torch

    from engine.layers import cpu_gemm

    @torch.library.custom_op("bench_compile::attention", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v) -> Tensor")
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv, d] -> [T, heads * d]; writes k/v into the current layer's cache."""
        return CURRENT["layer"].self_attn.attn(q, k, v, CURRENT["meta"])

    @attention.register_fake
    def _(q, k, v):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.custom_op("bench_compile::attention_at", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
    def attention_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """The attention of layer `layer` (the whole-model graph, where layers are not told apart at run time)."""
        return CURRENT["layers"][layer].self_attn.attn(q, k, v, CURRENT["meta"])

    @attention_at.register_fake
    def _(q, k, v, layer):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def module(which: int):
        layer = CURRENT["layer"]
        return getattr(layer.self_attn if which < 2 else layer.mlp, names[which])

    @torch.library.custom_op("bench_compile::linear", mutates_args=(),
                             schema="(Tensor x, int which, int out_features) -> Tensor")
    def linear(x: torch.Tensor, which: int, out_features: int) -> torch.Tensor:
        """The current layer's linear `which` (qkv, o, gate_up, down) through its prepacked oneDNN weight."""
        m = module(which)
        return cpu_gemm.linear(x, m.packed_weight, m.bias)

    @linear.register_fake
    def _(x, which, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.custom_op("bench_compile::linear_at", mutates_args=(),
                             schema="(Tensor x, int layer, int which, int out_features) -> Tensor")
    def linear_at(x: torch.Tensor, layer: int, which: int, out_features: int) -> torch.Tensor:
        """Linear `which` of layer `layer` through its prepacked oneDNN weight (the whole-model graph)."""
        owner = CURRENT["layers"][layer]
        m = getattr(owner.self_attn if which < 2 else owner.mlp, names[which])
        return cpu_gemm.linear(x, m.packed_weight, m.bias)

    @linear_at.register_fake
    def _(x, layer, which, out_features):
        return x.new_empty(x.shape[0], out_features)

    return attention, linear, attention_at, linear_at


def make_layer_fn(config, linear_kind: str, ops):
    import torch
    import torch.nn.functional as F

    attention, opaque_linear, attention_at, linear_at = ops
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    sizes = (heads * d + 2 * kv * d, config.hidden_size, 2 * config.intermediate_size, config.hidden_size)

    def lin(x, which, weights, layer=None):
        if linear_kind == "aten":
            return F.linear(x, weights[which])
        if layer is not None:
            return linear_at(x, layer, which, sizes[which])
        return opaque_linear(x, which, sizes[which])

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, x1), dim=-1) * sin

    def layer_fn(h, residual, cos, sin, w_in, w_post, weights, layer=None):
        x = h + residual
        h = F.rms_norm(x, w_in.shape, w_in, eps)
        q, k, v = lin(h, 0, weights, layer).split([heads * d, kv * d, kv * d], dim=-1)
        q = rope(q.reshape(-1, heads, d), cos, sin)
        k = rope(k.reshape(-1, kv, d), cos, sin)
        v = v.reshape(-1, kv, d)
        o = attention(q, k, v) if layer is None else attention_at(q, k, v, layer)
        x = lin(o, 1, weights, layer) + x
        h = F.rms_norm(x, w_post.shape, w_post, eps)
        gate, up = lin(h, 2, weights, layer).chunk(2, dim=-1)
        return lin(F.silu(gate) * up, 3, weights, layer), x

    return layer_fn


def whole_model(model, layer_fn, plain: dict, packed: bool):
    """All layers as one module whose weights Inductor may freeze (constant-fold and prepack for oneDNN)."""
    import torch
    from torch import nn

    inner = model.model

    class Whole(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.ParameterList()
            for i in inner.layer_range:
                layer = inner.layers[i]
                mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                          *(torch.empty(0) if packed else plain[id(m)] for m in mods)):
                    self.weights.append(nn.Parameter(w.detach(), requires_grad=False))

        def forward(self, h, residual, cos, sin):
            for n, i in enumerate(inner.layer_range):
                w = self.weights[6 * n:6 * n + 6]
                h, residual = layer_fn(h, residual, cos, sin, w[0], w[1], list(w[2:]), layer=i)
            return h, residual

    return Whole()


def install(model, compiled, linear_kind: str, plain: dict):
    """Replace the decoder's layer loop by the compiled layer function (this process only)."""
    import torch

    inner = model.model
    eager_run_layers = inner.run_layers
    def weights_of(layer):
        if linear_kind != "aten":  # onednn: the custom op finds the packed weight; whole: in the module
            return []
        mods = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        return [plain[id(m)] for m in mods]

    per_layer = {i: weights_of(inner.layers[i]) for i in inner.layer_range}

    def run_layers(positions, hidden_states, residual, meta):
        if meta is None:  # the warm-up forward without a cache: eager
            return eager_run_layers(positions, hidden_states, residual, meta)
        rotary = inner.layers[inner.layer_range[0]].self_attn.rotary
        cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
        if residual is None:
            residual = torch.zeros_like(hidden_states)
        CURRENT["meta"], CURRENT["layers"] = meta, inner.layers
        if linear_kind.startswith("whole"):
            hidden_states, residual = compiled(hidden_states, residual, cos, sin)
            CURRENT.clear()
            return hidden_states, residual
        for i in inner.layer_range:
            layer = inner.layers[i]
            CURRENT["layer"] = layer
            hidden_states, residual = compiled(hidden_states, residual, cos, sin, layer.input_layernorm.weight,
                                               layer.post_attention_layernorm.weight, per_layer[i])
        CURRENT.clear()
        return hidden_states, residual

    inner.run_layers = run_layers
    return lambda: setattr(inner, "run_layers", eager_run_layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--linear", choices=("onednn", "aten", "whole", "whole-onednn"), default="onednn",
                        help="whole: all layers in one graph, F.linear, Inductor's freezing (it prepacks the weights); "
                        "whole-onednn: all layers in one graph, the opaque oneDNN linears, no freezing")
    parser.add_argument("--cpp-wrapper", action="store_true")
    parser.add_argument("--static", action="store_true", help="no dynamic token dimension")
    parser.add_argument("--cache", type=Path, help="Inductor's cache dir (default: beside the engine's kernel cache)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler table of one compiled step of each")
    parser.add_argument("--only", default="d128,d1024,p1024", help="steps to time")
    args = parser.parse_args()

    from engine.kernels import cpp_build
    cache = args.cache or cpp_build.cache_dir().parent / "inductor"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # read when Inductor is imported

    import torch
    import torch._inductor.config as inductor_config

    from bench_engine import resolve_model_dir
    from engine.batch import SeqSpan
    from engine.config import EngineConfig
    from engine.layers import cpu_gemm
    from engine.model_config import ModelConfig
    from engine.model_runner import ModelRunner

    torch.set_num_threads(args.threads)
    inductor_config.cpp_wrapper = args.cpp_wrapper
    config = EngineConfig(model_id=str(resolve_model_dir(args.model_id)), device="cpu",
                          cpu_kv_cache_bytes=1024 ** 3, max_total_tokens=2048)
    model_config = ModelConfig.from_pretrained(config.model_id)
    mc = model_config
    if (mc.norm, mc.norm_layout, mc.position_embedding, mc.hidden_act, mc.mlp_gated, mc.qk_norm, mc.attention_bias,
            mc.partial_rotary_factor) != ("rms", "pre", "rope", "silu", True, False, False, 1.0):
        raise SystemExit(f"{mc.architecture}: this script writes out the Llama layout only (SmolLM2, Llama without biases)")
    runner = ModelRunner(config, model_config)
    model = runner._rank0.model
    plain = {}
    if args.linear in ("aten", "whole"):  # the plain weights back from the packed ones (prepack freed them)
        ins = (mc.hidden_size, mc.num_attention_heads * mc.head_dim, mc.hidden_size, mc.intermediate_size)
        for i in model.model.layer_range:
            layer = model.model.layers[i]
            mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for m, n in zip(mods, ins):
                plain[id(m)] = cpu_gemm.linear(  # I W^T = W^T
                    torch.eye(n), m.packed_weight, None).t().contiguous()
    ops = register_ops()
    layer_fn = make_layer_fn(model_config, "aten" if args.linear in ("aten", "whole") else "onednn", ops)
    if args.linear.startswith("whole"):
        inductor_config.freezing = args.linear == "whole"
        compiled = torch.compile(whole_model(model, layer_fn, plain, args.linear == "whole-onednn"),
                                 dynamic=not args.static)
    else:
        compiled = torch.compile(layer_fn, dynamic=not args.static)
    restore = None

    bs = runner.block_size
    steps = {}
    for context in (128, 1024):
        per_seq = -(-(context + 1) // bs)
        steps[f"d{context}"] = [SeqSpan(b, [100 + b], context, list(range(b * per_seq, (b + 1) * per_seq)))
                                for b in range(16)]
    steps["p1024"] = [SeqSpan(0, [(7 * i) % 1000 + 50 for i in range(1024)], 0, list(range(1024 // bs + 1)))]
    steps = {name: steps[name] for name in args.only.split(",")}

    def timed(spans):
        start, start_cpu = time.perf_counter(), time.process_time()
        logits, _ = runner.run(spans)
        return logits, time.process_time() - start_cpu, time.perf_counter() - start

    results = {}
    compile_s = {}
    for name, spans in steps.items():
        if restore:
            restore()
        eager_logits, _, _ = timed(spans)  # warm-up
        restore = install(model, compiled, args.linear, plain)
        compiled_logits, cpu, wall = timed(spans)  # compiles on the first call of each shape
        compile_s[name] = wall
        diff = (compiled_logits - eager_logits).abs().max().item()
        same = bool((compiled_logits.argmax(-1) == eager_logits.argmax(-1)).all())
        print(f"{name}: first compiled step {wall:.1f} s wall ({cpu:.1f} CPU s); logits max|diff| {diff:.2e}, "
              f"argmax equal: {same}", flush=True)
        counters = torch._dynamo.utils.counters
        print(f"  caches: {dict(counters['inductor'])} {dict(counters['aot_autograd'])}", flush=True)
        restore()
        times = {"eager": ([], []), "compiled": ([], [])}
        for _ in range(5 * args.repeat):
            for kind in ("eager", "compiled"):
                undo = install(model, compiled, args.linear, plain) if kind == "compiled" else None
                _, cpu, wall = timed(spans)
                if undo:
                    undo()
                times[kind][0].append(cpu)
                times[kind][1].append(wall)
        if args.profile:
            undo = install(model, compiled, args.linear, plain)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                timed(spans)
            undo()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
        results[name] = {kind: (1e3 * statistics.median(c), 1e3 * statistics.median(w))
                         for kind, (c, w) in times.items()}
        restore = None

    print(f"\n{args.threads} thread(s), linear {args.linear}, cpp_wrapper {args.cpp_wrapper}, "
          f"{'static' if args.static else 'dynamic'} shapes, Inductor cache {cache}")
    print("| step | eager CPU ms | compiled CPU ms | compiled / eager | eager wall ms | compiled wall ms "
          "| first compiled step s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        (ec, ew), (cc, cw) = r["eager"], r["compiled"]
        print(f"| {name} | {ec:.1f} | {cc:.1f} | {cc / ec:.2f}x | {ew:.1f} | {cw:.1f} | {compile_s[name]:.1f} |")
    runner.close()


if __name__ == "__main__":
    main()

"""Where a CPU decode step's wall time goes, by layer kind: linears, attention (the C++ kernel apart from its
Python wrapper and the KV write), norms, RoPE, activation, the LM head, and what is left between them.

    python scripts/profile_modules.py --batch 16 --context 128 [--threads 2] [--steps 30]

torch.profiler sees neither our ctypes kernels nor the time between ops, and `perf` does not split Python by
module. This wraps the `forward` of each leaf module of the engine's model (and the attention kernel's entry
points) with a wall clock, runs `--batch` prompts of `--context` tokens through an in-process `LLMEngine`
(bench_engine.py's engine and prompts), and times `--steps` pure decode steps after a few warm ones. Rows are
ms per step and calls per step; "model, outside the rows" is the model's forward less its timed leaves
(module calls, reshapes, the residual stream); "runner, outside the model and LM head" is the step's input
preparation and logits handling.
The clocks add ~0.3 us a call: read differences above ~0.1 ms a step. Where the fused CPU decode step
(engine/cpu_decode_step.py) serves the step, its one call is a row and the per-module rows stay empty;
`--enforce-eager` profiles the eager model.
"""
from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_engine  # noqa: E402

LEAVES = {  # module class -> row
    "QKVParallelLinear": "linear qkv", "MergedColumnParallelLinear": "linear gate_up",
    "RowParallelLinear": "linear o / down", "ColumnParallelLinear": "linear other",
    "ParallelLMHead": "LM head", "Attention": "attention (all)", "RMSNorm": "norm (+ residual add)",
    "GemmaRMSNorm": "norm (+ residual add)", "LayerNorm": "norm (+ residual add)", "RotaryEmbedding": "RoPE",
    "SiluAndMul": "activation", "GatedActivation": "activation",
}
FUSED = "fused decode step (all layers, C++)"


class Clocks:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, fn: Callable, row: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[row] += time.perf_counter() - start
                self.calls[row] += 1
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(engine: Any, clocks: Clocks) -> torch.nn.Module:
    """Wrap the leaf modules, the model, the runner and the CPU attention kernel's entry points."""
    from engine.attention import cpu_paged
    from engine.kernels import cpu_attention

    model = engine.runner._rank0.model
    for module in model.modules():
        row = LEAVES.get(type(module).__name__)
        if row is not None:
            module.forward = clocks.wrap(module.forward, row)
    inner = next(m for m in model.modules() if type(m).__name__ == "DecoderModel")
    inner.forward = clocks.wrap(inner.forward, "model")
    engine.runner.run = clocks.wrap(engine.runner.run, "runner")
    worker = engine.runner._rank0
    if worker.decode_step is not None:  # engine/cpu_decode_step.py: the layers in one C++ call, no module runs
        worker.decode_step.run = clocks.wrap(worker.decode_step.run, FUSED)
    cpu_attention.paged_attention = clocks.wrap(cpu_attention.paged_attention, "attention: kernel + its wrapper")
    library = cpu_attention.load()
    library.tgi_paged_attention = clocks.wrap(library.tgi_paged_attention, "attention: kernel alone")
    cpu_paged.CpuPagedBackend.store = staticmethod(clocks.wrap(cpu_paged.CpuPagedBackend.store,
                                                               "attention: KV write"))
    return model


def report(clocks: Clocks, steps: int, wall: float) -> None:
    per = {row: 1e3 * s / steps for row, s in clocks.seconds.items()}
    leaves = sum(v for row, v in per.items() if row in LEAVES.values() and row != "LM head")
    if "model" in per:
        per["model, outside the rows"] = per["model"] - leaves
    per["runner, outside the model and LM head"] = (per.get("runner", 0.0) - per.get("model", 0.0)
                                                    - per.get("LM head", 0.0) - per.get(FUSED, 0.0))
    print(f"| row | ms / step | calls / step |\n|---|---|---|\n| **step** | {1e3 * wall / steps:.2f} | 1 |")
    for row, ms in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"| {row} | {ms:.2f} | {clocks.calls[row] / steps:.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default="smollm2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="the eager model at every step (no fused CPU decode step): the per-module rows")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    bench_args = bench_engine.parse_args(["--model-id", args.model_id, "--prompt-len", str(args.context),
                                          "--new-tokens", str(args.steps + 8), "--device", "cpu"])
    model_dir, _ = bench_engine.prepare_model_dir(bench_args, device)
    engine = bench_engine.build_engine(model_dir, bench_args, device, "float32", args.batch, args.batch,
                                       enforce_eager=args.enforce_eager)
    from transformers import AutoTokenizer
    prompts = bench_engine.make_prompts(AutoTokenizer.from_pretrained(model_dir), args.batch, args.context,
                                        engine.runner.model_config.vocab_size)
    clocks = Clocks()
    instrument(engine, clocks)
    info = bench_engine.machine_info(device)
    bench_engine.print_machine(info)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, bench_engine.greedy(args.steps + 8))
    for _ in range(5):  # the prefill and a few warm decode steps
        engine.step()
    clocks.reset()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
        if engine.stats().batch_size != args.batch:
            raise SystemExit(f"a step ran {engine.stats().batch_size} sequences, not {args.batch}")
    wall = time.perf_counter() - start
    print(f"\nbatch {args.batch}, context {args.context}-{args.context + args.steps + 4}, "
          f"{torch.get_num_threads()} threads, {args.steps} decode steps\n")
    report(clocks, args.steps, wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())

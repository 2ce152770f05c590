"""Host overhead of a decode step: the engine's own work around a runner that answers at once.

    python scripts/bench_engine.py --host-overhead [--batch 256 --context 2048 --vocab 128256 --steps 40]

`InstantRunner` stands in for ModelRunner: it does the runner's host work (`validate_spans`,
`prepare_inputs`: token ids, positions, slot mapping, block tables) and returns rows of a random
[batch + 64, vocab] float32 logits tensor built once (a view that shifts by one row per step, so
the tokens change from step to step at no cost). Everything else in `LLMEngine.step` is real:
scheduler, block manager, sampler, detokenizer, stop matching, outputs.

Vocabulary: the logits have `--vocab` columns (128256, Llama 3); the tokenizer is SmolLM2's (49152 ids).
Prompts and generated tokens use its first 4096 ids (common BPE merges: real text pieces); the other
columns are padding scored 12 below them (as a model's padded embedding rows), so the sampler works on
the full width and the detokenizer decodes real tokens.

Phases, in microseconds of CPU time per step (medians over the steps):
  schedule    Scheduler.schedule (block tables grow, spans built)
  prepare     validate_spans + prepare_inputs (the runner's host work before the forward)
  sample      sampler.sample on the [batch, vocab] logits, on this CPU: that includes the vocabulary-wide
              tensor math a GPU runs on the device. "sample, host" is the same call on the first 4096
              columns only (same rows, same ids): the sampler's Python, dispatch and small-tensor work
  detokenize  IncrementalDetokenizer calls and stop-sequence matching left in the step: as in the server,
              sequences no text can end leave their text to the event loop (engine/deferred_text.py), so
              this is ~0 here unless --eager-text
  outputs     the rest of step(): appending tokens, finish checks, and the TokenInfo/RequestOutput of the rows
              the step does not leave to the event loop (all of them with --eager-text)
  delivered   what the step left to the event loop, done after the step as AsyncEngine's delivery does: the
              plain decode rows' outputs built (engine/deferred_outputs.py) and their text decoded (CPU time of
              the event loop's thread in the server, off the step's critical path on a GPU); "host, with
              delivery" adds it to the host overhead
The total is measured on steps without the phase timers (process_time around step()). Then as many steps
with timers on schedule, prepare and sample (process_time; one call each per step: the sample wrapper's own
work is taken off the step), and as many again with the detokenizer and stop-matcher calls timed
(perf_counter per call, summed: each call is a few microseconds, rarely preempted), on steps of their own so
that those wrappers' cost stays out of the other figures. `outputs` is what is left of the timed step.
Host overhead = timed step - sample + sample at 4096 columns (per step, then the median): what the step
costs the host when the vocabulary-wide math runs elsewhere. Both figures are
printed; the last line is the host one.

`--evict-mb N` reads an N MiB array inside the timed full-width sample call (so its time goes with that call's):
at `--vocab 4096 --evict-mb 125` the other phases run on caches evicted as by 256 x 128k float32 logits, which
tells what the 128k figure owes to this CPU doing the vocabulary-wide work a GPU host leaves to the device.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

NUM_SHIFTS = 64     # distinct logits views per sequence before they repeat
NARROW = 4096       # token ids in use; the sampler's host cost is measured at this width


class InstantRunner:
    """A ModelRunner without a model: the runner's host work, then logits at once."""

    def __init__(self, batch: int, vocab: int, real_vocab: int, num_kv_blocks: int, block_size: int,
                 max_position: int, seed: int = 0):
        from engine.attention.backend import AttentionBackend
        from engine.attention.block_tables import BlockTables
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.device = torch.device("cpu")
        self.attention_backend = "instant"
        self.max_position = max_position
        self.backend = AttentionBackend()   # the base class: no per-step precompute (as the GPU kernels)
        self.tables = BlockTables(self.device, num_blocks=num_kv_blocks)
        generator = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(batch + NUM_SHIFTS, vocab, generator=generator) * 2
        self.logits[:, real_vocab:] -= 12.0
        self.narrow = self.logits[:, :real_vocab].contiguous()
        self.num_steps = 0
        self.prepare_s = 0.0

    def run(self, spans: list[Any]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        from engine.model_inputs import prepare_inputs, validate_spans
        start = time.process_time()
        validate_spans(spans, self.block_size, self.num_kv_blocks, self.max_position)
        inputs = prepare_inputs(spans, self.block_size, self.device, self.backend, {None}, self.tables)
        self.prepare_s += time.process_time() - start
        rows = len(inputs.logits_rows)      # one per span here (prefill logprobs, "all", are not asked)
        if rows > len(self.logits) - NUM_SHIFTS:
            raise ValueError(f"{rows} rows of logits asked, the stand-in holds {len(self.logits) - NUM_SHIFTS}")
        shift = self.num_steps % NUM_SHIFTS
        self.num_steps += 1
        return self.logits[shift:shift + rows], {}

    def close(self) -> None:
        pass


@dataclass
class ModelShape:
    vocab_size: int
    max_position_embeddings: int


class PhaseTimers:
    """Wraps the engine's phase entry points with timers (installed only for the phase steps)."""

    def __init__(self, engine: Any, evict_mb: int = 0):
        import engine.llm_engine as llm_engine_module
        self.engine, self.module = engine, llm_engine_module
        self.evict = torch.ones(evict_mb * 2**18) if evict_mb else None    # float32: 2^18 a MiB
        self.schedule_s = self.sample_s = self.detok_s = self.sample_host_s = self.harness_s = 0.0
        self._schedule, self._sample = engine.scheduler.schedule, llm_engine_module.sample
        self._wrapped: list[tuple[Any, str, Any]] = []
        from engine.penalty_counts import PenaltyCounts
        self.narrow_counts = PenaltyCounts()   # the 4096-column calls keep their own counts (another width)

    def install(self, detokenize: bool = False) -> None:
        """Timers on schedule and sample (one call each per step); with `detokenize`, on the per-sequence
        detokenizer and stop-matcher calls too (their wrappers' own cost would land in `outputs`)."""
        engine, timers = self.engine, self

        def schedule() -> Any:
            start = time.process_time()
            try:
                return timers._schedule()
            finally:
                timers.schedule_s += time.process_time() - start

        def sample(logits: torch.Tensor, rows: Any, bitmask: Any = None, counts: Any = None, **hints: Any) -> Any:
            # the same rows at NARROW columns first (the generators' states are put back): the host part.
            # This wrapper's own work (the narrow view, the states) is `harness_s`, taken off the step's time
            entered = time.process_time()
            narrow = engine.runner.narrow[logits.storage_offset() // logits.shape[1]:][:len(logits)]
            states = [row.generator.get_state() if row.generator is not None else None for row in rows]
            start = time.process_time()
            timers._sample(narrow, rows, bitmask, counts=None if counts is None else timers.narrow_counts, **hints)
            host = time.process_time() - start
            for row, state in zip(rows, states):
                if state is not None:
                    row.generator.set_state(state)
            start = time.process_time()
            try:
                if timers.evict is not None:
                    timers.evict.numpy().max()      # read through: the caches hold this array, not the step's data
                return timers._sample(logits, rows, bitmask, counts=counts, **hints)
            finally:
                end = time.process_time()
                timers.sample_s += end - start
                timers.sample_host_s += host
                timers.harness_s += start - entered - host

        engine.scheduler.schedule = schedule
        self.module.sample = sample
        if not detokenize:
            return
        seq = next(iter(engine._seqs.values()))
        for obj, name in ((type(seq.detokenizer), "decode_next"), (type(seq.detokenizer), "flush"),
                          (type(seq.stop), "feed")):
            self._wrap(obj, name)

    def _wrap(self, cls: type, name: str) -> None:
        original, timers, clock = getattr(cls, name), self, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                timers.detok_s += clock() - start

        self._wrapped.append((cls, name, original))
        setattr(cls, name, timed)

    def remove(self) -> None:
        self.engine.scheduler.schedule = self._schedule
        self.module.sample = self._sample
        for cls, name, original in self._wrapped:
            setattr(cls, name, original)
        self._wrapped = []

    def reset(self) -> None:
        self.schedule_s = self.sample_s = self.detok_s = self.sample_host_s = self.harness_s = 0.0


def build(args: argparse.Namespace, tokenizer_dir: Any) -> Any:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.tokenizer import load_tokenizer

    if args.vocab < NARROW:
        raise SystemExit(f"error: --vocab must be at least {NARROW} (the token ids in use)")
    tokenizer = load_tokenizer(tokenizer_dir)
    block_size = 16
    max_total = args.context + args.steps * 2 + 64
    num_blocks = args.batch * (-(-max_total // block_size) + 1)
    runner = InstantRunner(args.batch, args.vocab, NARROW, num_blocks, block_size, max_total)
    config = EngineConfig(model_id="", max_total_tokens=max_total, max_input_tokens=args.context,
                          max_batch_prefill_tokens=args.batch * args.context, max_batch_size=args.batch)
    return LLMEngine(config, runner=runner, model_config=ModelShape(args.vocab, max_total), tokenizer=tokenizer)


def request_params(mode: str, i: int) -> Any:
    """greedy: TGI's default request (logprob of each token). mixed: every other row samples, seeded,
    with temperature, top-k, top-p and a repetition penalty."""
    from engine.sampling_params import SamplingParams
    if mode == "mixed" and i % 2:
        return SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                              seed=i, max_new_tokens=10**6, ignore_eos=True)
    return SamplingParams(max_new_tokens=10**6, ignore_eos=True)


def deliver(outputs: list[Any]) -> float:
    """What the server's event loop does with a step's outputs before any handler reads them: build the outputs of
    the rows the step only noted (engine/deferred_outputs.py) and decode the text the step left to it
    (engine/deferred_text.py), as AsyncEngine's delivery does. Its CPU seconds."""
    from engine.deferred_outputs import expand
    from engine.deferred_text import fill
    start = time.process_time()
    for out in expand(outputs):
        if out.pending is not None:
            fill(out)
    return time.process_time() - start


def measure(engine: Any, steps: int, evict_mb: int = 0) -> dict[str, Any]:
    """CPU microseconds per decode step: the plain total (and the delivery of its outputs); then, on as many steps
    each, the step with its schedule/prepare/sample timers, and the detokenizer's share (timed per call, on steps
    of their own)."""
    from engine.deferred_outputs import DeferredRows
    totals, delivered = [], []
    for _ in range(steps):
        start = time.process_time()
        outputs = engine.step()
        totals.append(time.process_time() - start)
        delivered.append(deliver(outputs))
        assert sum(len(out) if isinstance(out, DeferredRows) else 1 for out in outputs) \
            == engine.config.max_batch_size, "every sequence must decode in every step"
    phases: dict[str, list[float]] = {name: [] for name in ("schedule", "prepare", "sample", "detokenize",
                                                            "timed step", "sample, host", "host")}
    for detokenize in (False, True):
        timers = PhaseTimers(engine, evict_mb)
        timers.install(detokenize)
        try:
            for _ in range(steps):
                timers.reset()
                engine.runner.prepare_s = 0.0
                start = time.process_time()
                outputs = engine.step()
                total = time.process_time() - start - timers.sample_host_s - timers.harness_s
                detok_s = timers.detok_s
                deliver(outputs)            # its detokenizer calls are the loop's, not the step's
                if detokenize:
                    phases["detokenize"].append(detok_s)
                    continue
                phases["schedule"].append(timers.schedule_s)
                phases["prepare"].append(engine.runner.prepare_s)
                phases["sample"].append(timers.sample_s)
                phases["timed step"].append(total)
                phases["sample, host"].append(timers.sample_host_s)
                phases["host"].append(total - timers.sample_s + timers.sample_host_s)
        finally:
            timers.remove()
    us = {name: statistics.median(values) * 1e6 for name, values in phases.items()}
    us["outputs"] = us["timed step"] - sum(us[name] for name in ("schedule", "prepare", "sample", "detokenize"))
    us["total"] = statistics.median(totals) * 1e6
    us["delivered"] = statistics.median(delivered) * 1e6
    return us


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench_engine import make_prompts, resolve_model_dir
    tokenizer_dir = resolve_model_dir(args.model_id)
    engine = build(args, tokenizer_dir)
    # as the server: AsyncEngine leaves the text of sequences no text can end to its event loop
    engine.defer_text = not getattr(args, "eager_text", False)
    print(f"host overhead: batch {args.batch}, contexts of {args.context} tokens, vocab {args.vocab} (SmolLM2's "
          f"first {NARROW} token ids, the rest padding), sampling {args.sampling}, torch threads "
          f"{torch.get_num_threads()}; stand-in runner, CPU time per step", flush=True)
    prompts = make_prompts(engine.tokenizer, args.batch, args.context, NARROW)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, request_params(args.sampling, i))
    start = time.perf_counter()
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    print(f"prefill + {args.warmup} warm-up steps: {time.perf_counter() - start:.1f} s wall", flush=True)
    from engine import gc_tuning
    evict_mb = getattr(args, "evict_mb", 0)
    if evict_mb:
        print(f"{evict_mb} MiB read inside each timed full-width sample call (--evict-mb)", flush=True)
    with gc_tuning.tuned():     # as the server's launcher sets the collector before its step loop (=0: not)
        us = measure(engine, args.steps, evict_mb)
    engine.close()
    print(f"{'phase':<22}{'us/step':>10}")
    for name in ("schedule", "prepare", "sample", "detokenize", "outputs", "timed step"):
        print(f"{name:<22}{us[name]:>10.0f}")
    print(f"{'sample, host':<22}{us['sample, host']:>10.0f}   (the same call on {NARROW} columns)")
    print(f"{'total, untimed steps':<22}{us['total']:>10.0f}   (CPU time with the vocabulary-wide math on this CPU)")
    print(f"{'delivered':<22}{us['delivered']:>10.0f}   (outputs built and text decoded by the event loop, off the "
          f"step thread: {'--eager-text: none' if not engine.defer_text else 'deferred_outputs.py, deferred_text.py'})")
    print(f"{'host, with delivery':<22}{us['host'] + us['delivered']:>10.0f}")
    print(f"host overhead: {us['host']:.0f} us/step at batch {args.batch}")
    return {"host_overhead_us": us, "batch": args.batch, "context": args.context, "vocab": args.vocab,
            "sampling": args.sampling}

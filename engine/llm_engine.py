"""LLMEngine: requests in, incremental RequestOutputs out; ties scheduler, runner and sampler together."""
from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch

from engine import async_scheduling, prompt_logprobs
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.deferred_outputs import DeferredRows, expand
from engine.deferred_text import DeferredText
from engine.device_copy import list_to_device
from engine.detokenizer import IncrementalDetokenizer
from engine.multimodal.prompt import MultiModalPrompt
from engine.outputs import FinishReason, RequestOutput, TokenInfo
from engine.penalty_counts import PenaltyCounts
from engine.request_checks import check_request
from engine.sampler import SamplerOutput, pick_seed, plain_greedy, sample, use_cpu_kernels
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.spec_decode.methods import build_speculation, check_speculation
from engine.spec_decode.verifier import verify
from engine.stop import StopMatcher
from engine.structured.compiler import GrammarCompiler
from engine.structured.masks import MaskFiller, PendingMasks, draft_masks
from engine.tokenizer import TokenTexts, load_eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

# Default prompt tokens per step on CPU (TGI's max_input_tokens + 50 elsewhere). A CPU step is compute-bound,
# so a step of N prompts takes N times as long as one and every prompt of it waits for the last: smaller steps
# give the first tokens out sooner at the same total CPU (docs/benchmarks.md, "Prefill budget on CPU").
CPU_PREFILL_TOKENS = 1024
# On CPU a burst of prompts holding at least this many tokens is prefilled in two steps, half first (Scheduler's
# split_bursts): below it, a step's fixed cost (every weight read once) outweighs the half of the work it saves
CPU_BURST_TOKENS = 128


@dataclass(slots=True, frozen=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int


def resolve_limits(config: EngineConfig, max_position_embeddings: int, num_kv_blocks: int,
                   block_size: int, *, cpu: bool = False) -> Limits:
    """TGI's launcher defaults and checks, against what the KV cache holds; `cpu`: the prefill budget
    defaults to CPU_PREFILL_TOKENS at most."""
    kv_tokens = num_kv_blocks * block_size
    batch_total = config.max_batch_total_tokens or kv_tokens
    # a default never asks for more than the cache holds (TGI derives it from memory too)
    max_total = config.max_total_tokens or min(max_position_embeddings, 4096,
                                               batch_total // block_size * block_size)
    max_input = config.max_input_tokens or max_total - 1
    # chunked prefill: a budget below max_input_tokens is fine, above the batch total is useless
    prefill = config.max_batch_prefill_tokens or min(max_input + 50, batch_total,
                                                     CPU_PREFILL_TOKENS if cpu else batch_total)
    if not 0 < max_input < max_total:
        raise ValueError(f"max_input_tokens ({max_input}) must be >= 1 and < max_total_tokens ({max_total})")
    if batch_total > kv_tokens:
        raise ValueError(f"max_batch_total_tokens ({batch_total}) is more than the KV cache holds ({kv_tokens} = "
                         f"{num_kv_blocks} blocks x {block_size}); lower it or give the cache more memory")
    if -(-max_total // block_size) > batch_total // block_size:
        raise ValueError(f"max_total_tokens ({max_total}) must fit in max_batch_total_tokens ({batch_total}, "
                         f"{batch_total // block_size} blocks of {block_size}): one request alone must fit")
    if not 0 < prefill <= batch_total:
        raise ValueError(f"max_batch_prefill_tokens ({prefill}) must be >= 1 and <= max_batch_total_tokens "
                         f"({batch_total})")
    if max_total > max_position_embeddings:
        logger.warning("max_total_tokens=%d is above the model's max_position_embeddings=%d",
                       max_total, max_position_embeddings)
    return Limits(max_input, max_total, prefill, batch_total)


@dataclass(slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_preempted_total: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    batch_size: int             # spans in the last step
    attention_backend: str
    # counters since start (Prometheus counters, read at scrape time)
    num_prompt_tokens_total: int = 0            # tokens prefilled (prompts, and recomputes after preemption)
    num_generated_tokens_total: int = 0         # tokens sampled
    num_prefix_cache_queried_tokens: int = 0    # prompt tokens looked up in the prefix cache
    num_prefix_cache_hit_tokens: int = 0        # of those, found there
    num_speculative_proposed_total: int = 0     # draft tokens scored (--speculate)
    num_speculative_accepted_total: int = 0     # of those, accepted
    speculative_method: str = ""                # "ngram" | "layers" | "draft" | "medusa" | "eagle3" ("" = none)
    num_speculative_paused_total: int = 0       # decodes --speculate auto left undrafted (drafting did not pay)
    forward_steps: dict[str, int] = field(default_factory=dict)  # target forwards by path (engine/worker.py)
    num_steps_ahead_total: int = 0              # batches launched before the previous one's tokens were read


class LLMEngine:
    """One engine per model. `add_request` and `abort` are thread-safe and take effect at the start
    of the next `step()`; everything else belongs to the thread that calls `step()`.

    `abort` emits one final RequestOutput (finished, finish_reason "aborted", the text so far).
    When several endings coincide on one token: stop_sequence, then eos_token, then length.
    A runner failure fails the requests of that batch: their final output carries `error`. A runner that cannot
    run again (its `failure` is set: a tensor-parallel rank died or hung) makes `step()` raise instead.
    `runner`, `model_config` and `tokenizer` can be passed in (tests use a fake runner).
    """

    def __init__(self, config: EngineConfig, *, runner: Any = None, model_config: Any = None,
                 tokenizer: Any = None):
        self.config = config
        if model_config is None:
            from engine.model_config import ModelConfig
            model_config = ModelConfig.from_pretrained(config.model_id, config.model_impl)
        self.model_config = model_config
        self.tokenizer = tokenizer or load_tokenizer(config.model_id, config.revision, config.trust_remote_code)
        draft_config = check_speculation(config, model_config, self.tokenizer)
        self.eos_token_ids: set[int] = load_eos_token_ids(config.model_id, self.tokenizer) if config.model_id \
            else {self.tokenizer.eos_token_id} - {None}
        if runner is None:
            from engine.model_runner import ModelRunner
            runner = ModelRunner(config, model_config)
        self.runner = runner
        on_cpu = getattr(getattr(runner, "device", None), "type", None) == "cpu"   # stand-in runners have no device
        try:
            limits = resolve_limits(config, model_config.max_position_embeddings,
                                    runner.num_kv_blocks, runner.block_size, cpu=on_cpu)
        except ValueError:
            runner.close()
            raise
        self.limits: Limits = limits
        try:    # logprobs and greedy picks of CPU logits: "fused" (engine/kernels/cpu_log_softmax.py) or "torch (why)"
            self.sampler_backend = "torch" if getattr(getattr(runner, "device", None), "type", "cpu") != "cpu" \
                else use_cpu_kernels()
        except ValueError:
            runner.close()
            raise
        self.max_input_tokens = limits.max_input_tokens
        self.max_total_tokens = limits.max_total_tokens
        self.max_batch_prefill_tokens = limits.max_batch_prefill_tokens
        self.max_batch_total_tokens = limits.max_batch_total_tokens
        self.block_manager = BlockManager(limits.max_batch_total_tokens // runner.block_size, runner.block_size,
                                          enable_prefix_caching=config.prefix_caching,
                                          eager_blocks=getattr(runner, "kv_eager_blocks", None))
        try:
            self.speculation = build_speculation(config, runner, model_config, draft_config)
        except ValueError:
            runner.close()
            raise
        self.scheduler = Scheduler(self.block_manager, limits.max_batch_prefill_tokens, config.max_batch_size,
                                   num_speculative_tokens=config.speculate,
                                   propose=self.speculation.propose if self.speculation else None,
                                   split_bursts=CPU_BURST_TOKENS if on_cpu else None)
        self._num_draft_tokens_total = 0
        self._num_accepted_tokens_total = 0
        self.token_texts = TokenTexts(self.tokenizer)
        self.vocab_size = model_config.vocab_size
        self.adapter_names: list[str | None] = [name for name, _ in getattr(config, "lora_adapters", [])]
        if getattr(config, "enable_runtime_lora", False):   # free slots for adapters loaded later (lora/runtime.py)
            self.adapter_names += [None] * (config.max_loras - len(self.adapter_names))
        self.adapter_keys = list(range(1, len(self.adapter_names) + 1))    # per slot; lora/runtime.py renews them
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._mask_filler: MaskFiller | None = None
        self._lock = threading.Lock()
        self._pending: list[tuple[str, Any]] = []       # ("add", Sequence) | ("abort", request_id)
        self._live_ids: set[str] = set()
        self._seqs: dict[str, Sequence] = {}
        self._num_guided = 0                            # of those, with a grammar (no mask work in steps without)
        self._num_not_greedy = 0                        # of those, not `plain_greedy` (the sampler reads every row)
        self._num_logprobs = 0                          # of those, reporting logprobs
        self._seq_ids = count()
        self._penalty_counts = PenaltyCounts()         # penalties' token counts, kept between steps
        # True: sequences that no text can end get their text decoded where their outputs are delivered, not in
        # step() (engine/deferred_text.py; AsyncEngine turns it on and fills every output it delivers), and their
        # plain decode rows' outputs built there too (engine/deferred_outputs.py)
        self.defer_text = False
        # decode batches launched before the previous one's tokens reach the host (engine/async_scheduling.py)
        self.schedules_ahead = async_scheduling.resolve_mode(
            config.async_scheduling, getattr(runner, "device", None),
            getattr(runner, "takes_device_input_ids", False)) and self.speculation is None
        self._inflight: async_scheduling.InFlight | None = None
        self._num_steps_ahead_total = 0     # batches launched before their previous one was resolved
        self._batch_size = 0
        self._num_prompt_tokens_total = 0
        self._num_generated_tokens_total = 0
        self._closed = False
        logger.info("engine ready: %d KV blocks x %d tokens, limits %s", self.block_manager.num_blocks,
                    runner.block_size, limits)

    # requests (any thread)
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    images: MultiModalPrompt | None = None) -> None:
        """`images`: the prompt's images as the model's processor prepared them (engine/multimodal)."""
        self._validate(prompt_token_ids, params)
        if images is not None and self.model_config.image_token_id is None:
            raise ValueError(f"{self.model_config.architecture}: {self.model_config.text_only_reason()}")
        if images is not None and self.model_config.bidirectional_images:
            images = images.attending_both_ways(self.max_batch_prefill_tokens)
        num_prompt = len(prompt_token_ids)
        seq = Sequence(next(self._seq_ids), request_id, list(prompt_token_ids), params,
                       max_tokens=min(num_prompt + params.max_new_tokens, self.max_total_tokens))
        seq.seed = pick_seed(params)
        seq.images = images
        seq.adapter = self.adapter_names.index(params.adapter_id) + 1 if params.adapter_id is not None else 0
        seq.adapter_key = self.adapter_keys[seq.adapter - 1] if seq.adapter else 0
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, num_prompt, params.skip_special_tokens)
        seq.stop = StopMatcher(params.stop)
        if params.grammar is not None:
            seq.grammar = self.grammars.matcher(params.grammar)
        elif self.defer_text and not seq.stop.stop and self.speculation is None:
            seq.deferred = DeferredText(seq.detokenizer, seq.stop, seq.token_ids, num_prompt)
        if params.prefill_logprobs:
            seq.prefill_tokens = [TokenInfo(prompt_token_ids[0], self.token_texts.text(prompt_token_ids[0]),
                                            None, self.token_texts.is_special(prompt_token_ids[0]))]
        with self._lock:
            if request_id in self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._live_ids.add(request_id)
            self._pending.append(("add", seq))

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live_ids:
                self._pending.append(("abort", request_id))

    def adapter_in_use(self, index: int) -> bool:
        """Whether a live or pending request runs on adapter `index` (1-based)."""
        with self._lock:
            return any(seq.adapter == index for seq in self._seqs.values()) or \
                any(kind == "add" and item.adapter == index for kind, item in self._pending)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.config, max_input_tokens=self.max_input_tokens,
                      vocab_size=self.vocab_size)
        if params.adapter_id is not None and params.adapter_id not in self.adapter_names:
            known = ", ".join(n for n in self.adapter_names if n) or "none (start with --lora-adapters NAME=DIR)"
            raise ValueError(f"unknown LoRA adapter {params.adapter_id!r}; loaded adapters: {known}")

    # the step loop (one thread)
    def step(self) -> list[RequestOutput]:
        """Apply pending adds/aborts, run one scheduled batch, return what each request gained. With `defer_text`,
        one DeferredRows among them stands for the plain decode rows whose outputs the caller builds
        (engine/deferred_outputs.py: `expand`)."""
        outputs = self._apply_pending()
        if self._inflight is not None:
            return outputs + self._step_ahead()
        batch = self.scheduler.schedule()
        if any(span.images is not None for span in batch.spans):
            try:
                outputs += self._encode_images(batch)
            except Exception as e:  # noqa: BLE001 - as a failed step below
                return outputs + self._step_failed(batch, e)
        self._batch_size = len(batch)
        if not batch:
            return outputs
        masks = self._start_masks(batch) if self._num_guided else None
        try:
            if self.speculation is not None and self.speculation.fill is not None:
                self.speculation.fill(batch)
            grammar_drafts = {seq.seq_id: draft_masks(seq.grammar, seq.draft_token_ids, self.vocab_size)
                              for seq in batch.seqs if seq.grammar is not None and seq.draft_token_ids} \
                if self._num_guided and batch.num_draft_tokens else {}
            last_logits, all_logits = self.runner.run(batch.spans)
        except Exception as e:  # noqa: BLE001 - reported per request, the engine keeps serving
            return outputs + self._step_failed(batch, e)
        self.scheduler.on_run_done(batch)
        self._num_prompt_tokens_total += batch.num_prefill_tokens
        sampled: list[Sequence] = []
        rows: list[int] = []
        drafted: list[Sequence] = []
        if batch.num_decode_tokens == len(batch) and not batch.num_draft_tokens:
            sampled = batch.seqs    # decodes only: every span has a row of logits and samples from it
        else:
            row = 0
            for seq, span in zip(batch.seqs, batch.spans):
                if seq.draft_token_ids:
                    drafted.append(seq)
                elif span.logits == "all" and (scored := prompt_logprobs.start(seq, span.start_pos,
                                                                             all_logits[seq.seq_id])):
                    scored.finish(self.token_texts)
                if span.logits == "none":
                    continue
                if seq.num_computed_tokens == seq.num_tokens and not seq.draft_token_ids:
                    sampled.append(seq)
                    rows.append(row)
                row += 1
        if sampled:
            logits = last_logits if len(sampled) == len(last_logits) else \
                last_logits.index_select(0, list_to_device(rows, torch.int64, last_logits.device))
            bitmask = masks.for_rows(sampled) if masks is not None else None
            if not drafted and self._can_pick_ahead(batch):     # its tokens are resolved by the next step
                self._inflight = async_scheduling.pick(batch, sampled, logits, self._num_logprobs > 0,
                                                       self._penalty_counts, bitmask)
                return outputs
            self._num_generated_tokens_total += len(sampled)
            out = sample(logits, sampled, bitmask, counts=self._penalty_counts, all_greedy=not self._num_not_greedy,
                         any_logprobs=self._num_logprobs > 0)
            outputs += self._append_one_each(sampled, out)
        if drafted:
            outputs += self._append_verified(drafted, verify(drafted, [all_logits[s.seq_id] for s in drafted],
                                                             grammar_drafts))
        return outputs

    def _can_pick_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether this batch's tokens can be picked on the device and resolved in the next step: no drafts."""
        return self.schedules_ahead and not batch.num_draft_tokens

    def _step_ahead(self) -> list[RequestOutput]:
        """Launch batch N+1 from the batch in flight (N) when it can be built, then resolve N: append its tokens,
        end what they end, build its outputs, while the device runs N+1 (engine/async_scheduling.py). Penalties
        count the decodes' tokens in flight on the device. While a live request has a grammar, whose mask needs the
        token in flight on the host, N+1 is picked after N is resolved (its masks filled then, from the matchers N's
        tokens advanced)."""
        inflight, self._inflight = self._inflight, None
        ahead = async_scheduling.schedule_ahead(self.scheduler, inflight) if self._can_pick_ahead(inflight.batch) \
            else None
        launched, failure, pick_after, failed_images = None, None, self._num_guided > 0, []
        if ahead is not None:
            batch, rows = ahead
            try:
                if any(span.images is not None for span in batch.spans):
                    failed_images = self._encode_images(batch)  # only prompt chunks leave: the decodes stay first
                self._batch_size = len(batch)
                sampled, logits_rows = async_scheduling.sampled_rows(batch)
                if batch.seqs:
                    in_flight = async_scheduling.next_input_ids(inflight, rows)    # the first rows of `sampled`
                    last_logits, all_logits = self.runner.run(batch.spans, input_ids=in_flight)
                    scored = [scored for seq, span in zip(batch.seqs, batch.spans) if span.logits == "all"
                              and (scored := prompt_logprobs.start(seq, span.start_pos, all_logits[seq.seq_id]))]
                    if len(logits_rows) < len(last_logits):     # prompt-logprob chunks with prompt left to run
                        last_logits = last_logits.index_select(0, list_to_device(logits_rows, torch.int64,
                                                                                 last_logits.device))
                    if not pick_after:
                        launched = async_scheduling.pick(batch, sampled, last_logits, self._num_logprobs > 0,
                                                         self._penalty_counts, in_flight=in_flight)
                    self._num_steps_ahead_total += 1
                    self._num_prompt_tokens_total += batch.num_prefill_tokens
            except Exception as e:  # noqa: BLE001 - N's tokens are still delivered; N+1's requests fail below
                failure = e
        outputs = failed_images + self._resolve(inflight)
        if ahead is None or not batch.seqs:     # nothing launched: the encoder failed on every request of N+1
            return outputs
        live = ScheduledBatch([seq for seq in batch.seqs if not seq.is_finished],
                              [span for seq, span in zip(batch.seqs, batch.spans) if not seq.is_finished])
        if pick_after and failure is None:
            try:    # the histories and matchers now hold N's tokens, as the synchronous step's would; the rows N's
                # tokens ended are thrown away, unmasked
                masks = self._start_masks(live)
                launched = async_scheduling.pick(batch, sampled, last_logits, self._num_logprobs > 0,
                                                 self._penalty_counts, masks.for_rows(sampled) if masks else None)
            except Exception as e:  # noqa: BLE001 - as a failed launch
                failure = e
        if failure is not None:
            outputs += self._step_failed(live, failure)
        else:
            self.scheduler.on_run_done(live)    # after N's tokens are appended: the prefix cache reads them
            launched.prompt_logprobs = scored
            self._inflight = launched
        return outputs

    def _resolve(self, inflight: async_scheduling.InFlight) -> list[Any]:
        """Append a batch's prompt logprobs and picks to its sequences still running (an abort or a stop may have
        ended some)."""
        out = inflight.resolve()
        for scored in inflight.prompt_logprobs:
            if not scored.seq.is_finished:
                scored.finish(self.token_texts)
        seqs = inflight.sampled
        live = [j for j, seq in enumerate(seqs) if not seq.is_finished]
        if len(live) < len(seqs):
            out = SamplerOutput([out.token_ids[j] for j in live], [out.logprobs[j] for j in live],
                                [out.top_token_ids[j] for j in live], [out.top_logprobs[j] for j in live])
            seqs = [seqs[j] for j in live]
        self._num_generated_tokens_total += len(seqs)
        return self._append_one_each(seqs, out) if seqs else []

    def _append_verified(self, seqs: list[Sequence], outs: list[SamplerOutput]) -> list[RequestOutput]:
        outputs = []
        for seq, out in zip(seqs, outs):
            num_accepted = len(out.token_ids) - 1
            self._num_generated_tokens_total += len(out.token_ids)
            self._num_draft_tokens_total += len(seq.draft_token_ids)
            self._num_accepted_tokens_total += num_accepted
            self.speculation.record(seq, len(seq.draft_token_ids), num_accepted)
            outputs.append(self._append_run(seq, out, range(len(out.token_ids))))
            if not seq.is_finished:
                self.scheduler.commit_draft(seq, num_accepted)
        return outputs

    def _start_masks(self, batch: ScheduledBatch) -> PendingMasks | None:
        # the rows that sample this step under a grammar: their masks are filled while the forward runs
        guided = [seq for seq, span in zip(batch.seqs, batch.spans) if seq.grammar is not None
                  and span.logits != "none" and span.start_pos + len(span.token_ids) == seq.num_tokens]
        if not guided:
            return None
        if self._mask_filler is None:
            self._mask_filler = MaskFiller(self.vocab_size)
        return self._mask_filler.start(guided)

    def _apply_pending(self) -> list[RequestOutput]:
        with self._lock:
            pending, self._pending = self._pending, []
        outputs = []
        for kind, item in pending:
            if kind == "add":
                self._seqs[item.request_id] = item
                self._num_guided += item.grammar is not None
                self._num_not_greedy += not plain_greedy(item.params)
                self._num_logprobs += item.params.logprobs
                self.scheduler.add(item)
            elif (seq := self._seqs.get(item)) is not None:
                self.scheduler.finish(seq, "aborted")
                outputs.append(self._final_output(seq, [], "" if seq.deferred is not None else seq.stop.flush()))
        return outputs

    def _append_run(self, seq: Sequence, out: SamplerOutput, rows: Iterable[int]) -> RequestOutput:
        """Append `out`'s tokens at `rows` to `seq` in order, stopping at the first that ends it (a stop
        sequence, EOS, the grammar's end or the length limit): one output with every token kept.
        Runs once per sequence and step: locals instead of repeated attribute and property look-ups."""
        text, special_ids = self.token_texts.text, self.token_texts.special_ids
        token_ids, grammar, detokenizer, stop = seq.token_ids, seq.grammar, seq.detokenizer, seq.stop
        logprobs = out.logprobs if seq.params.logprobs else None
        deferred = seq.deferred is not None     # its text comes later (deferred_text.py); nothing it can stop on
        infos: list[TokenInfo] = []
        pieces: list[str] = []
        reason = None
        for j in rows:
            token_id = out.token_ids[j]
            token_ids.append(token_id)
            if grammar is not None:
                grammar.consume_token(token_id)
            top_ids = out.top_token_ids[j]
            top = [TokenInfo(t, text(t), lp, t in special_ids) for t, lp in zip(top_ids, out.top_logprobs[j])] \
                if top_ids else ()
            infos.append(TokenInfo(token_id, text(token_id), logprobs[j] if logprobs is not None else None,
                                   token_id in special_ids, top))
            stopped = False
            if not deferred:
                piece, stopped = stop.feed(detokenizer.decode_next(token_ids))
                pieces.append(piece)
            reason = self._finish_reason(seq, token_id, stopped)
            if reason is not None:
                break
        if reason is None:
            return self._output(seq, infos, pieces[0] if len(pieces) == 1 else "".join(pieces),
                                None if deferred else pieces)
        if reason != "stop_sequence" and not deferred:
            tail, _ = stop.feed(detokenizer.flush(token_ids))
            pieces[-1] += tail + stop.flush()
        self.scheduler.finish(seq, reason)
        return self._final_output(seq, infos, "".join(pieces), pieces=None if deferred else pieces)

    def _append_one_each(self, seqs: list[Sequence], out: SamplerOutput) -> list[Any]:
        """`_append_run` of row j of `out` to `seqs[j]`, for every j: the common case (no grammar, and a token
        that ends nothing) in one loop with everything looked up once; the rest through `_append_run`. With
        `defer_text`, the common rows of deferred sequences are only noted (one DeferredRows, last)."""
        text, special_ids, eos_ids = self.token_texts.text, self.token_texts.special_ids, self.eos_token_ids
        token_ids_out, logprobs, top_token_ids, top_logprobs = out.token_ids, out.logprobs, out.top_token_ids, \
            out.top_logprobs
        outputs: list[Any] = []
        # rows whose outputs the delivering thread builds (deferred_outputs.py): noted in three lists
        noted = DeferredRows(out, self.token_texts) if self.defer_text else None
        noted_seqs, noted_rows, noted_counts = (noted.seqs, noted.rows, noted.num_tokens) if noted is not None \
            else ([], [], [])
        for j, seq in enumerate(seqs):
            params, token_id = seq.params, token_ids_out[j]
            if seq.grammar is not None or (token_id in eos_ids and not params.ignore_eos):
                outputs.append(self._append_run(seq, out, (j,)))
                continue
            token_ids = seq.token_ids
            token_ids.append(token_id)
            num_prompt, num_tokens = seq.num_prompt_tokens, len(token_ids)
            if num_tokens - num_prompt >= params.max_new_tokens or num_tokens >= seq.max_tokens:
                token_ids.pop()     # the length limit: _append_run's ending (flush, finish)
                outputs.append(self._append_run(seq, out, (j,)))
                continue
            top_ids = top_token_ids[j]
            deferred = seq.deferred
            if noted is not None and deferred is not None and not top_ids and seq.prefill_tokens is None:
                noted_seqs.append(seq)
                noted_rows.append(j)
                noted_counts.append(num_tokens)
                continue
            top = [TokenInfo(t, text(t), lp, t in special_ids) for t, lp in zip(top_ids, top_logprobs[j])] \
                if top_ids else ()
            info = TokenInfo(token_id, text(token_id), logprobs[j] if params.logprobs else None,
                             token_id in special_ids, top)
            if deferred is None:
                piece, stopped = seq.stop.feed(seq.detokenizer.decode_next(token_ids))
                if stopped:
                    self.scheduler.finish(seq, "stop_sequence")
                    outputs.append(self._final_output(seq, [info], piece, pieces=[piece]))
                    continue
                pieces, pending = [piece], None
            else:                       # text decoded where the output is delivered (deferred_text.py)
                piece, pieces, pending = "", None, (deferred, num_tokens - 1, num_tokens, False)
            prefill, seq.prefill_tokens = seq.prefill_tokens, None
            # positional (keywords cost 2.5x here): request_id, tokens, text, finished, finish_reason,
            # generated_text, stop_text, num_prompt_tokens, num_generated_tokens, seed, prefill_tokens,
            # num_cached_tokens, error, token_texts, pending (tests/engine/test_llm_engine.py checks the order)
            outputs.append(RequestOutput(seq.request_id, [info], piece, False, None, None, "", num_prompt,
                                         num_tokens - num_prompt, seq.seed, prefill, seq.num_cached_tokens or 0,
                                         None, pieces, pending))
        if noted_seqs:
            outputs.append(noted)
        return outputs

    def _finish_reason(self, seq: Sequence, token_id: int, stopped: bool) -> FinishReason | None:
        if stopped:
            return "stop_sequence"
        params = seq.params
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return "eos_token"
        if seq.grammar is not None and seq.grammar.is_stopped():
            return "eos_token"      # the grammar is complete and allows nothing more: as if the model had ended
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= params.max_new_tokens or num_tokens >= seq.max_tokens:
            return "length"
        return None

    def _output(self, seq: Sequence, tokens: list[TokenInfo], text: str,
                pieces: list[str] | None = None) -> RequestOutput:
        prefill, seq.prefill_tokens = seq.prefill_tokens, None
        num_prompt, num_tokens = seq.num_prompt_tokens, len(seq.token_ids)
        output = RequestOutput(seq.request_id, tokens, text, num_prompt_tokens=num_prompt,
                               num_generated_tokens=num_tokens - num_prompt, seed=seq.seed, prefill_tokens=prefill,
                               num_cached_tokens=seq.num_cached_tokens or 0, token_texts=pieces)
        if seq.deferred is not None:
            output.pending = (seq.deferred, num_tokens - len(tokens), num_tokens, False)
        return output

    def _final_output(self, seq: Sequence, tokens: list[TokenInfo], text: str,
                      error: str | None = None, pieces: list[str] | None = None) -> RequestOutput:
        output = self._output(seq, tokens, text, pieces)
        output.finished, output.finish_reason, output.error = True, seq.finish_reason, error
        if output.pending is not None:
            output.pending = output.pending[:3] + (True,)   # its text and generated_text come with fill
        else:
            output.generated_text, output.stop_text = seq.stop.text, seq.stop.cut
        if error is not None:
            output.finish_reason = None
        if self._seqs.pop(seq.request_id, None) is not None:
            self._num_guided -= seq.grammar is not None
            self._num_not_greedy -= not plain_greedy(seq.params)
            self._num_logprobs -= seq.params.logprobs
        with self._lock:
            self._live_ids.discard(seq.request_id)
        return output

    def _encode_images(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The vision encoder for the batch's new images; a request whose images it fails on ends with that error
        and leaves the batch (before any of its K/V is written or cached), so the others run as if it never came."""
        failed = self.runner.encode_images(batch.spans) if hasattr(self.runner, "encode_images") else {}
        if not failed:
            return []
        outputs = []
        kept = [(seq, span) for seq, span in zip(batch.seqs, batch.spans) if seq.seq_id not in failed]
        for seq, span in zip(batch.seqs, batch.spans):
            if seq.seq_id in failed:
                batch.num_prefill_tokens -= len(span.token_ids)
                self.scheduler.finish(seq, "aborted")
                outputs.append(self._final_output(seq, [], "", error=failed[seq.seq_id]))
        batch.seqs, batch.spans = [seq for seq, _ in kept], [span for _, span in kept]
        return outputs

    def _step_failed(self, batch: ScheduledBatch, e: Exception) -> list[RequestOutput]:
        logger.exception("model step failed for %d sequences", len(batch))
        if getattr(self.runner, "failure", None):   # its ranks are gone or hung: no later step can run
            raise RuntimeError(f"the model runner failed: {self.runner.failure}") from e
        return self._fail_batch(batch, f"model step failed: {type(e).__name__}: {e}")

    def _fail_batch(self, batch: ScheduledBatch, error: str) -> list[RequestOutput]:
        outputs = []
        for seq in batch.seqs:
            self.scheduler.finish(seq, "aborted")
            outputs.append(self._final_output(seq, [], "", error=error))
        return outputs

    # offline use
    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 images: list[MultiModalPrompt | None] | None = None) -> list[RequestOutput]:
        """Run `prompts` to completion; one RequestOutput per prompt, in order, with every token.
        `images`: per prompt, its images as the model's processor prepared them (engine/multimodal), or None."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        tag = uuid.uuid4().hex[:8]
        request_ids = [f"generate-{tag}-{i}" for i in range(len(prompts))]
        tokens: dict[str, list[TokenInfo]] = {rid: [] for rid in request_ids}
        finals: dict[str, RequestOutput] = {}
        token_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p in zip(token_ids, params_list):
            self._validate(ids, p)      # all or nothing: no half-added batch on a bad prompt
        for rid, ids, p, mm in zip(request_ids, token_ids, params_list, images or [None] * len(prompts)):
            self.add_request(rid, ids, p, mm)
        while len(finals) < len(request_ids):
            outputs = expand(self.step())
            if not outputs and not self._batch_size and not self.scheduler.running:
                raise RuntimeError("the engine cannot schedule the waiting requests")  # a bug, not input
            for output in outputs:
                if output.request_id in tokens:
                    tokens[output.request_id] += output.tokens
                    if output.finished:
                        finals[output.request_id] = output
        results = []
        for rid in request_ids:
            final = finals[rid]
            final.tokens, final.text = tokens[rid], final.generated_text or ""
            results.append(final)
        return results

    def stats(self) -> EngineStats:
        bm, spec = self.block_manager, self.speculation
        return EngineStats(len(self.scheduler.waiting), len(self.scheduler.running),
                           self.scheduler.num_preempted_total, bm.num_free_blocks, bm.num_blocks,
                           bm.block_size, self._batch_size, getattr(self.runner, "attention_backend", "unknown"),
                           self._num_prompt_tokens_total, self._num_generated_tokens_total,
                           bm.num_queried_tokens, bm.num_hit_tokens,
                           self._num_draft_tokens_total, self._num_accepted_tokens_total,
                           spec.method if spec else "",
                           spec.adaptive.num_paused_total if spec and spec.adaptive else 0,
                           dict(getattr(self.runner, "forward_steps", {})), self._num_steps_ahead_total)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._mask_filler is not None:
                self._mask_filler.close()
            self.runner.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

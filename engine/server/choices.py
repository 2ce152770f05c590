"""OpenAI `n` and `best_of`: one validated prompt becomes the sequences to run, and their results the choices.

Copy j of a seeded request samples with seed + j, so the n choices differ from each other and the
same request gives the same choices again. Only the first copy computes prompt logprobs (which needs
every prompt position's logits, so it cannot read the prefix cache); the others find its KV blocks in
the prefix cache (Infer.generate_groups starts them once its prefill is done).
"""
from __future__ import annotations

from dataclasses import replace

from engine.server.errors import ValidationError
from engine.server.infer import Generation
from engine.server.protocol import MAX_SEED, PromptTokensDetails, Usage
from engine.server.validation import ValidRequest


def check_counts(num_prompts: int, n: int, best_of: int, max_sequences: int) -> None:
    """`best_of` >= `n`, and prompts x best_of sequences within the server's cap."""
    if best_of < n:
        raise ValidationError(f"`best_of` must be >= `n`. Given: best_of={best_of}, n={n}")
    if num_prompts * best_of > max_sequences:
        raise ValidationError(f"prompts x `best_of` (or `n`) must be <= {max_sequences} sequences per request. "
                              f"Given: {num_prompts} x {best_of}")


def fan_out(valid: ValidRequest, num_seqs: int, seed: int | None, prompt_logprobs: bool) -> list[ValidRequest]:
    copies = []
    for j in range(num_seqs):
        params = replace(valid.params, stop=list(valid.params.stop),
                         seed=None if seed is None else (seed + j) % (MAX_SEED + 1),
                         prefill_logprobs=prompt_logprobs and j == 0)
        copies.append(replace(valid, params=params, best_of=1, decoder_input_details=params.prefill_logprobs))
    return copies


def best(gens: list[Generation], n: int) -> list[Generation]:
    """The n sequences with the highest cumulative logprob (all of them, in order, when there are n)."""
    if len(gens) == n:
        return gens
    return sorted(gens, key=lambda g: g.cumulative_logprob, reverse=True)[:n]


def usage(groups: list[list[Generation]], returned: list[list[Generation]], count_completion: bool = True) -> Usage:
    """Each prompt counts once; completion tokens are the returned choices'. A prompt's cached tokens are
    the most any of its sequences read from the prefix cache (with n > 1, the later ones read the first's)."""
    prompt = sum(group[0].input_length for group in groups)
    completion = sum(g.generated_tokens for gens in returned for g in gens) if count_completion else 0
    cached = sum(max(g.num_cached_tokens for g in group) for group in groups)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

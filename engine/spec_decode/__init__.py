"""N-gram speculative decoding (TGI's `--speculate N`).

Owns the proposer (`ngram.py`: drafts from the sequence's own prompt and output), the acceptance
rule (`acceptance.py`: exact for greedy, rejection sampling for sampled rows) and the verifier
(`verifier.py`: the sampler's processing applied to every drafted position, then acceptance).
The scheduler turns a drafted decode row into a span of 1 + k tokens that the runner scores in the
same varlen forward as everything else; the scheduler and block manager roll back the rejected KV.
"""

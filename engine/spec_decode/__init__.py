"""Speculative decoding (TGI's `--speculate N`): draft tokens, verify them in one forward, keep the exact ones.

Owns the drafters (`ngram.py`: from the sequence's own prompt and output; `batch_drafter.py` batches the model
drafters: `layer_skip.py`, `--speculative-layers K`, the target's first K layers writing into its own KV cache,
and `draft_model.py`, `--speculative-model`, a smaller model with its own KV cache in the same blocks), the
drafters that read the target's hidden states (`heads.py` tells a `--speculative-model` directory's kind;
`head_drafter.py` calls rank 0's `medusa.py` heads or `eagle3.py` layer, fed by `hidden_rows.py`), which
one an engine uses (`methods.py`), `--speculate auto` (`adaptive.py`), the acceptance rule (`acceptance.py`:
exact for greedy, rejection sampling for sampled rows) and the verifier (`verifier.py`: the sampler's
processing applied to every drafted position, then acceptance). The scheduler turns a drafted decode row into a
span of 1 + k tokens that the runner scores in the same varlen forward as everything else; the scheduler and
block manager roll back the rejected KV.
"""

"""Multi-LoRA: PEFT adapters served beside the base model, several in one batch.

Owns: the `--lora-adapters` value (`names`, torch-free), reading and checking a PEFT adapter directory
against the base model before any weight is loaded (`adapter`), the per-layer stacked low-rank weights
of every adapter, sharded for tensor parallelism like their base layers (`stack`), the step's
token -> adapter map (`batch`), and the choice, once at start, between the Triton kernels
(engine/kernels/lora.py) and grouped torch matmuls (`backend`), and adapters loaded and unloaded while the
engine serves (`runtime`). The worker orders each step's spans by adapter, so each adapter's tokens are one slice.

Index 0 is the base model; adapter i (1-based, in flag order) is row i - 1 of the stacks. A linear layer
with adapters adds `scale * (x A^T) B^T` for each token's own adapter to its output (before the
all-reduce of a row-parallel layer), so one forward serves every adapter and the base model.
"""

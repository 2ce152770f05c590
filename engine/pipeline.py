"""Pipeline parallelism: one forward split into stages, each stage a node's worth of tensor-parallel ranks.

Why pipeline stages across nodes and tensor parallelism only within a node: tensor parallelism
all-reduces the hidden states twice per layer (after attention and after the MLP), so across nodes a
126-layer model would cross the inter-node link 252 times per step; a pipeline crosses it once per stage
boundary per step (the hidden states and the residual, [tokens, hidden] each). NVLink inside a node is
several times faster than the InfiniBand between nodes, so the frequent all-reduces stay on NVLink.
We have not measured multi-node runs here (one node, no GPU): this is the usual trade-off, not our figure.

No micro-batching: stages run one after another within a step, so with P stages each GPU idles
(P - 1) / P of the time. The pipeline is here for capacity (a model larger than one node's memory),
not for speed; splitting a batch into micro-batches to overlap the stages is left for later.

Each step every rank gets the same spans (engine/external_launch.py broadcasts them), builds the same
inputs, and runs its stage: the first embeds, the others receive (hidden, residual) from the same tensor
rank one stage up; the last applies the final norm and LM head and sends the logits to the driver
(rank 0, which samples). Every stage keeps the KV cache of its own layers only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.batch import SeqSpan
from engine.model_inputs import ModelInputs, prepare_inputs
from engine.parallel_layout import ParallelLayout


def run_stage(worker, spans: list[SeqSpan]) -> torch.Tensor | None:
    """This rank's part of one forward; float32 logits of the requested rows on rank 0, None elsewhere."""
    inputs = prepare_inputs(spans, worker.block_size, worker.device, worker.attention, worker.windows)
    return forward_stage(worker.model, worker.layout, inputs, worker.dtype, communicate=True)


def forward_stage(model, layout: ParallelLayout, inputs: ModelInputs, dtype: torch.dtype,
                  communicate: bool) -> torch.Tensor | None:
    """`communicate=False` runs the stage on zeros in place of its peers' tensors (the memory warm-up)."""
    decoder, vocab_size = model.model, model.config.vocab_size
    num_tokens = inputs.input_ids.numel()
    if layout.is_first_stage:
        hidden, residual = decoder.embed(inputs.input_ids, inputs.positions), None
    else:
        hidden = torch.zeros(num_tokens, model.config.hidden_size, dtype=dtype, device=inputs.input_ids.device)
        residual = torch.zeros_like(hidden)
        if communicate:
            dist.recv(hidden, layout.prev_rank)
            dist.recv(residual, layout.prev_rank)
    hidden, residual = decoder.run_layers(inputs.positions, hidden, residual, inputs.attention)
    num_rows = inputs.logits_rows.numel()
    if not layout.is_last_stage:
        if communicate:
            dist.send(hidden.contiguous(), layout.next_rank)
            dist.send(residual.contiguous(), layout.next_rank)
        if layout.rank == 0 and num_rows:
            logits = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=hidden.device)
            if communicate:
                dist.recv(logits, layout.logits_rank)
            return logits
        return hidden.new_zeros(0, vocab_size, dtype=torch.float32) if layout.rank == 0 else None
    hidden, _ = decoder.norm(hidden, residual)
    if not num_rows:
        return hidden.new_zeros(0, vocab_size, dtype=torch.float32) if layout.rank == 0 else None
    logits = model.compute_logits(hidden[inputs.logits_rows])
    if logits is None or layout.rank == 0:   # a tensor rank > 0, or the whole model on this stage
        return None if logits is None else logits.float()
    if communicate:
        dist.send(logits.float().contiguous(), 0)
    return None


"""The batched LoRA update: the Triton kernels and the grouped torch path against the float64 reference,
on randomized mixed batches (several adapters, base rows, odd sizes). Without CUDA the kernels run in
Triton's interpreter (fp32/fp16)."""
from __future__ import annotations

import pytest
import torch

from engine.batch import SeqSpan
from engine.kernels import triton_available
from engine.kernels.lora_reference import lora_reference
from engine.lora import backend
from engine.lora.batch import LoraBatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


def random_case(seed, dtype, *, num_adapters=3, rank=12, in_features=72, out_features=50):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist()
    adapters = torch.randint(0, num_adapters + 1, (len(lengths),), generator=gen).tolist()
    spans = [SeqSpan(i, [0] * n, 0, [], adapter=k) for i, (n, k) in enumerate(zip(lengths, adapters))]
    batch = LoraBatch()
    batch.set(spans, DEVICE)
    t = sum(lengths)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)
    indices = torch.tensor([k for n, k in zip(lengths, adapters) for _ in range(n)], dtype=torch.int32, device=DEVICE)
    return (rand(t, in_features), rand(t, out_features), rand(num_adapters, rank, in_features, scale=0.2),
            rand(num_adapters, out_features, rank, scale=0.2), batch, indices)


# CPU half matmuls are slow and lossy: the grouped path is checked in fp32 there
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.float16] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("seed", range(4))
def test_grouped_path_matches_the_reference(seed, dtype):
    x, y, a, b, batch, indices = random_case(seed, dtype)
    expected = lora_reference(x, y, a, b, indices)
    got = backend.grouped_apply(x, y.clone(), a, b, batch)
    assert (got.double() - expected).abs().max() <= TOL[dtype]
    if batch.token_indices is not None:
        assert torch.equal(batch.token_indices, indices)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed,rank,in_features,out_features", [(0, 12, 72, 50), (1, 1, 16, 17), (2, 48, 130, 200),
                                                               (3, 7, 64, 64)])
def test_triton_kernels_match_the_reference(seed, rank, in_features, out_features, dtype):
    from engine.kernels.lora import lora_apply

    x, y, a, b, _, indices = random_case(seed, dtype, rank=rank, in_features=in_features, out_features=out_features)
    expected = lora_reference(x, y, a, b, indices)
    got = lora_apply(x, y.clone(), a, b, indices)
    assert got.dtype == dtype
    assert (got.double() - expected).abs().max() <= TOL[dtype]
    base_rows = indices == 0
    assert torch.equal(got[base_rows], y[base_rows])  # base rows are left untouched


def test_the_choice_is_checked_and_reported():
    name, report = backend.choose(torch.device("cpu"), torch.float32)
    assert name == "grouped" and report == {"triton": "needs CUDA", "grouped": "ok"}
    broken = lambda x, y, a, b, batch: y  # noqa: E731 - adds nothing: must fail the self-check
    assert "max error" in backend.self_check(broken, torch.device("cpu"), torch.float32)


def test_a_backend_another_rank_refuses_is_not_used(monkeypatch):
    with pytest.raises(RuntimeError, match="another rank failed its check"):
        backend.choose(torch.device("cpu"), torch.float32, agree=lambda ok: False)


def test_prefill_sized_steps_hand_over_to_grouped_gemms(monkeypatch):
    calls = []
    monkeypatch.setattr(backend, "grouped_apply", lambda *args: calls.append(args) or args[1])
    batch = LoraBatch()
    batch.set([SeqSpan(0, [0] * backend.GROUPED_FROM_TOKENS, 0, [], adapter=1)], DEVICE)
    x = torch.zeros(backend.GROUPED_FROM_TOKENS, 8, device=DEVICE)
    backend.triton_apply(x, x.clone(), torch.zeros(1, 2, 8), torch.zeros(1, 8, 2), batch)
    assert len(calls) == 1  # no kernel launch: the Triton module is not even needed here


def test_spans_are_grouped_by_adapter_and_logits_rows_restored():
    from engine.lora.batch import order_by_adapter

    spans = [SeqSpan(0, [1, 2, 3], 0, [], "all", adapter=2), SeqSpan(1, [4], 0, [], "last", adapter=0),
             SeqSpan(2, [5, 6], 0, [], "none", adapter=1), SeqSpan(3, [7, 8], 0, [], "last", adapter=2),
             SeqSpan(4, [9], 0, [], "all", adapter=0)]
    ordered, restore = order_by_adapter(spans)
    assert [s.seq_id for s in ordered] == [1, 4, 2, 0, 3]
    # rows of the reordered run, tagged by (seq, row); restore must give them back in the original order
    run_rows = [(s.seq_id, j) for s in ordered
                for j in range(len(s.token_ids) if s.logits == "all" else int(s.logits == "last"))]
    assert [run_rows[r] for r in restore] == [(0, 0), (0, 1), (0, 2), (1, 0), (3, 0), (4, 0)]
    assert order_by_adapter(ordered[:2]) == (ordered[:2], None)
    batch = LoraBatch()
    batch.set(ordered, DEVICE)
    assert [(i, r) for i, r in batch.groups] == [(0, slice(2, 4)), (1, slice(4, 9))]  # one slice per adapter


@pytest.mark.parametrize("seed", range(4))
def test_the_graph_paths_match_the_reference_and_leave_base_rows_alone(seed):
    """Inside piecewise graphs: the masked GEMMs (any device) and the Triton kernels on the map alone."""
    x, y, a, b, _, indices = random_case(seed, torch.float32)
    expected = lora_reference(x, y, a, b, indices)
    paths = {"grouped": backend.masked_apply} | ({"triton": backend.indexed_apply} if triton_available() else {})
    assert set(backend.GRAPH_BACKENDS) == set(backend.BACKENDS)
    for name, apply in paths.items():
        got = apply(x, y.clone(), a, b, indices)
        assert (got.double() - expected).abs().max() <= TOL[torch.float32], name
        assert torch.equal(got[indices == 0], y[indices == 0]), name


def test_the_static_map_pads_with_the_base_model_and_restores_the_step_state():
    batch = LoraBatch()
    batch.allocate_graph_map(8, DEVICE)
    batch.graph_indices.fill_(7)                     # whatever an earlier step left
    batch.set([SeqSpan(0, [0, 0], 0, [], adapter=2), SeqSpan(1, [0], 0, [], adapter=0)], DEVICE)
    batch.stage(3, 6)
    assert batch.graph_indices.tolist() == [2, 2, 0, 0, 0, 0, 7, 7]
    step = batch.num_tokens, batch.token_indices, batch.groups
    with batch.graphed(6):
        assert batch.active and batch.in_graph and batch.num_tokens == 6
        assert batch.token_indices.data_ptr() == batch.graph_indices.data_ptr()
    assert (batch.num_tokens, batch.token_indices, batch.groups) == step and not batch.in_graph
    batch.clear()
    batch.stage(0, 4)                                # a step without adapters: all base
    assert batch.graph_indices.tolist()[:4] == [0, 0, 0, 0] and not batch.active

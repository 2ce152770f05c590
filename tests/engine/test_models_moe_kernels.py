"""MoE experts: the Triton grouped GEMM (Triton's interpreter on CPU, compiled on a GPU) and the CPU path
against plain per-pair references; router top-k normalisations."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from engine.kernels import moe  # noqa: E402
from engine.layers import fused_moe  # noqa: E402
from engine.layers.fused_moe import experts_torch, experts_triton, select_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routing(num_tokens, num_experts, top_k, seed=0, only=None):
    """Random top-k expert ids [T, k] (distinct per token); `only` squeezes every token onto those experts."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    if only is not None:
        logits[:, [e for e in range(num_experts) if e not in only]] -= 100.0
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return weights.to(DEVICE), ids.to(DEVICE)


def tensors(num_tokens, num_experts, hidden, inter, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=generator) / inter ** 0.5).to(DEVICE, dtype)
    return x, w13, w2


@pytest.mark.parametrize("num_tokens,num_experts,top_k,only", [
    (1, 4, 2, None),           # decode of one sequence
    (37, 6, 3, None),          # pairs not a multiple of the tile
    (20, 8, 2, [5, 6]),        # most experts get no token at all
    (16, 4, 1, [2]),           # every token on one expert: one long run, several tiles
])
def test_align_by_expert_tiles_hold_one_expert_each(num_tokens, num_experts, top_k, only):
    _, ids = routing(num_tokens, num_experts, top_k, only=only)
    sorted_pairs, block_experts = moe.align_by_expert(ids, num_experts, block_m=4)
    num_pairs = ids.numel()
    flat = ids.reshape(-1)
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    tiles = sorted_pairs.view(-1, 4)
    for tile, expert in zip(tiles, block_experts):
        pairs = tile[tile < num_pairs]
        if int(expert) < 0:
            assert pairs.numel() == 0
        else:
            assert (flat[pairs] == expert).all()
    assert set(block_experts[block_experts >= 0].tolist()) == set(flat.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,only", [(1, 4, 2, None), (37, 6, 3, None), (20, 8, 2, [5, 6])])
def test_grouped_gemm_matches_the_per_pair_reference(dtype, num_tokens, num_experts, top_k, only):
    weights, ids = routing(num_tokens, num_experts, top_k, only=only)
    x, w13, _ = tensors(num_tokens, num_experts, 32, 24, dtype)
    sorted_pairs, block_experts = moe.align_by_expert(ids, num_experts)
    got = moe.grouped_gemm(x, w13, sorted_pairs, block_experts, ids.numel(), top_k, scales=weights)
    want = moe.grouped_gemm_reference(x.float(), w13.float(), ids, top_k, scales=weights)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 40, 200])      # decode, mid, prefill: BLOCK_M 16, 32, 64
def test_the_tiles_chosen_per_shape_match_the_reference(dtype, num_tokens):
    num_experts, top_k, hidden, inter = 4, 2, 128, 128
    weights, ids = routing(num_tokens, num_experts, top_k)
    x, w13, _ = tensors(num_tokens, num_experts, hidden, inter, dtype)
    tiles = moe.tile_config(ids.numel(), num_experts, w13.shape[1], w13.shape[2], dtype)
    assert tiles["block_m"] == {1: 16, 40: 32, 200: 64}[num_tokens]
    sorted_pairs, block_experts = moe.align_by_expert(ids, num_experts, tiles.pop("block_m"))
    got = moe.grouped_gemm(x, w13, sorted_pairs, block_experts, ids.numel(), top_k, scales=weights, **tiles)
    want = moe.grouped_gemm_reference(x.float(), w13.float(), ids, top_k, scales=weights)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_tile_config_widens_with_rows_per_expert_and_keeps_float32_narrow():
    decode = moe.tile_config(8, 8, 28672, 4096, torch.bfloat16)
    prefill = moe.tile_config(8192, 8, 28672, 4096, torch.bfloat16)
    assert (decode["block_m"], decode["block_n"], decode["block_k"]) == (16, 64, 64)
    assert (prefill["block_m"], prefill["block_n"], prefill["num_warps"]) == (64, 128, 8)
    narrow = moe.tile_config(8192, 8, 28672, 4096, torch.float32)
    assert (narrow["block_n"], narrow["block_k"]) == (64, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_experts_match_the_torch_path(dtype):
    weights, ids = routing(29, 6, 2)
    x, w13, w2 = tensors(29, 6, 48, 40, dtype, seed=1)  # sizes off the tile grid on every axis
    act = nn.SiLU()
    got = experts_triton(x, w13, w2, weights, ids, act)
    want = experts_torch(x, w13, w2, weights, ids, act)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_torch_path_runs_each_used_expert_once_over_all_its_tokens(monkeypatch):
    weights, ids = routing(40, 8, 2, only=[0, 3, 7])
    x, w13, w2 = tensors(40, 8, 16, 8, torch.float32)
    rows_per_call = []
    linear = F.linear
    def counting_linear(a, w, *rest):
        rows_per_call.append(a.shape[0])
        return linear(a, w, *rest)

    monkeypatch.setattr(fused_moe.F, "linear", counting_linear)
    got = experts_torch(x, w13, w2, weights, ids, nn.SiLU())
    assert len(rows_per_call) == 2 * 3  # gate/up and down, once per expert that has tokens
    assert sum(rows_per_call) == 2 * ids.numel()
    expected = torch.zeros_like(x)
    for token in range(40):  # the definition, token by token
        for weight, expert in zip(weights[token], ids[token]):
            gate, up = (w13[expert] @ x[token]).chunk(2)
            expected[token] += weight * (w2[expert] @ (F.silu(gate) * up))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_router_normalisations():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 3.0, 0.1]])
    probs = torch.softmax(logits, -1)
    raw, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1], [2, 3]]
    torch.testing.assert_close(raw, probs.gather(1, ids))  # Qwen-MoE with norm_topk_prob false
    normed, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(normed, raw / raw.sum(-1, keepdim=True))  # Mixtral, norm_topk_prob true
    assert select_experts(logits.half(), 2, True)[0].dtype == torch.float32  # softmax in float32


@pytest.mark.gpu
def test_cuda_chooses_the_triton_kernel_after_its_self_check():
    assert fused_moe.choose_backend(torch.device("cuda"), torch.bfloat16) == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen2-moe"])
def test_moe_models_on_cuda_match_transformers(name):
    """The whole model with the compiled kernel (fp32, SDPA attention) against transformers on the CPU."""
    from fakes import test_model_path
    from test_model_runner import hf_logits, make_runner, random_sequences, run_schedule

    path = test_model_path(name)
    with make_runner(path, device="cuda", dtype="float32", attention_backend="sdpa", enforce_eager=True) as runner:
        sequences = random_sequences(runner.model_config.vocab_size, [26, 23, 22])
        seen = run_schedule(runner, sequences)
    assert fused_moe.choose_backend(torch.device("cuda"), torch.float32) == "triton"
    reference = hf_logits(path, sequences)
    for seq_id, positions in enumerate(seen):
        for pos, logits in positions.items():
            torch.testing.assert_close(logits.cpu(), reference[seq_id][pos], atol=1e-3, rtol=0)


def test_onednn_packed_experts_give_the_same_output():
    from engine.layers import cpu_gemm

    if cpu_gemm.choose("auto", torch.device("cpu"), torch.float32) != "onednn":
        pytest.skip("this torch build has no usable oneDNN linear")
    small, layer = fused_moe.FusedMoE(6, 2, 32, 24, renormalize=True), fused_moe.FusedMoE(6, 2, 256, 256, True)
    assert cpu_gemm.prepack_model(small) == 0  # below the size where oneDNN pays off
    generator = torch.Generator().manual_seed(3)
    layer.w13.data.normal_(0, 0.05, generator=generator)
    layer.w2.data.normal_(0, 0.05, generator=generator)
    x, router = torch.randn(21, 256, generator=generator), torch.randn(21, 6, generator=generator)
    with torch.inference_mode():
        plain = layer(x, router)
        assert cpu_gemm.prepack_model(layer) == 12 and layer.w13.numel() == 0  # stacks freed after packing
        torch.testing.assert_close(layer(x, router), plain, atol=1e-4, rtol=1e-4)

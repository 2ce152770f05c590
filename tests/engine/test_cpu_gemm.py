"""oneDNN linears on CPU: backend choice, and a prepacked model computing what F.linear computes."""
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from engine.layers import cpu_gemm  # noqa: E402
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding  # noqa: E402
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear  # noqa: E402

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(cpu_gemm.choose("auto", CPU, torch.float32) != "onednn",
                                  reason="this torch build has no usable oneDNN linear")


class TinyTied(nn.Module):
    """Embedding shared with the LM head, plus two untied linears with and without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(50, 16)
        self.up = MergedColumnParallelLinear(16, [24, 24])
        self.down = RowParallelLinear(48, 16, bias=True)
        self.head = ParallelLMHead(50, 16)
        self.head.weight = self.embed.weight
        generator = torch.Generator().manual_seed(0)
        for param in self.parameters():
            param.data.copy_(torch.randn(param.shape, generator=generator))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.up(self.embed(ids))))


def test_choice_follows_the_request_device_and_dtype():
    assert cpu_gemm.choose("aten", CPU, torch.float32) == "aten"
    assert cpu_gemm.choose("auto", torch.device("cuda"), torch.bfloat16) == "aten"
    assert cpu_gemm.choose("auto", CPU, torch.float16) == "aten"
    with pytest.raises(ValueError, match="unknown CPU GEMM backend 'mkl'"):
        cpu_gemm.choose("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="not usable here: dtype torch.float16"):
        cpu_gemm.choose("onednn", CPU, torch.float16)


@needs_onednn
def test_prepacked_model_matches_f_linear_and_keeps_shared_weights():
    model = TinyTied().eval()
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 49])
    with torch.inference_mode():
        want = model(ids)
        assert cpu_gemm.prepack_model(model) == 3
        got = model(ids)
        assert cpu_gemm.prepack_model(model) == 0  # already packed: nothing to do
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert model.embed.weight.shape == (50, 16)          # shared with the head: still there for lookups
    assert model.up.weight.numel() == 0 and model.down.weight.numel() == 0  # freed: the packed copy serves


@needs_onednn
def test_prepacked_linear_keeps_leading_dimensions():
    layer = MergedColumnParallelLinear(8, [4, 4])
    layer.weight.data.copy_(torch.randn(8, 8))
    x = torch.randn(2, 3, 8)
    want = layer(x)
    cpu_gemm.prepack_model(layer)
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    assert layer(x[:, :1].transpose(0, 1)).shape == (1, 2, 8)  # non-contiguous input

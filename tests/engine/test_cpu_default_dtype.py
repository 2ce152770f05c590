"""The CPU's default dtype: a bfloat16 checkpoint stays bfloat16 where the CPU computes in bfloat16 natively (as
vLLM's CPU backend), everything else, and bfloat16 where it would be emulated, is served in float32; --dtype wins."""
import pytest

torch = pytest.importorskip("torch")

from types import SimpleNamespace  # noqa: E402

from engine.worker import cpu_default_dtype, resolve_dtype  # noqa: E402

CPU = torch.device("cpu")


def ModelConfig(torch_dtype="float32"):  # noqa: N802 - the one field resolve_dtype reads
    return SimpleNamespace(torch_dtype=torch_dtype)


def native(monkeypatch, avx512_bf16, amx):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize("avx512_bf16,amx", [(True, False), (False, True), (True, True)])
def test_a_bfloat16_checkpoint_stays_bfloat16_where_the_cpu_has_bfloat16_arithmetic(monkeypatch, avx512_bf16, amx):
    native(monkeypatch, avx512_bf16, amx)
    assert cpu_default_dtype("bfloat16") == "bfloat16"
    assert resolve_dtype(None, ModelConfig(torch_dtype="bfloat16"), CPU) == torch.bfloat16


@pytest.mark.parametrize("checkpoint", ["float32", "float16", "float64", ""])
def test_other_checkpoints_are_served_in_float32(monkeypatch, checkpoint):
    native(monkeypatch, True, True)
    assert cpu_default_dtype(checkpoint) == "float32"


def test_bfloat16_is_not_chosen_where_it_would_be_emulated(monkeypatch):
    native(monkeypatch, False, False)
    assert resolve_dtype(None, ModelConfig(torch_dtype="bfloat16"), CPU) == torch.float32


def test_an_explicit_dtype_always_wins(monkeypatch):
    native(monkeypatch, True, False)
    assert resolve_dtype("float32", ModelConfig(torch_dtype="bfloat16"), CPU) == torch.float32
    native(monkeypatch, False, False)
    assert resolve_dtype("bfloat16", ModelConfig(torch_dtype="float32"), CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("bfloat8", ModelConfig(), CPU)

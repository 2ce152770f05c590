"""Choosing the quantization: what the checkpoint says, what --quantize says, and every refusal in one line
naming the format and what is supported. Also: the oneDNN prepack leaves quantized layers alone."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engine.layers import cpu_gemm, quantization  # noqa: E402
from engine.layers.quantization import QuantizationError, resolve  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                                 "weights": {"num_bits": 4, "type": "int",
                                                                             "symmetric": True, "strategy": "group",
                                                                             "group_size": 128}}}}


def ct_with(**changes):
    raw = json.loads(json.dumps(CT_W4A16))
    group = raw["config_groups"]["group_0"]
    for key, value in changes.items():
        (group if key in group or key == "input_activations" else raw)[key] = value
    return raw


@pytest.mark.parametrize("checkpoint,flag,name", [
    (None, None, None), (None, "none", None), (None, "fp8", "fp8"), (None, "bitsandbytes-nf4", "bitsandbytes-nf4"),
    (GPTQ, None, "gptq"), (GPTQ, "gptq", "gptq"), (CT_W4A16, None, "compressed-tensors"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM", "zero_point": True}, "awq", "awq"),
])
def test_the_checkpoint_or_the_flag_picks_the_method(checkpoint, flag, name):
    config = resolve(checkpoint, flag)
    assert (config.name if config else None) == name


@pytest.mark.parametrize("checkpoint,flag,message", [
    ({"quant_method": "exl2", "bits": 4.0}, None, "quantized with 'exl2', which this engine cannot serve; supported: "
                                                  "GPTQ (int4/int8), AWQ"),
    ({"quant_method": "hqq", "nbits": 4}, None, "quantized with 'hqq'"),
    ({"bits": 4}, None, "quantized with 'an unnamed method'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, None, "quantized with 'bitsandbytes'"),
    (None, "exl2", "--quantize exl2 is not supported; supported:"),
    (None, "marlin", "--quantize marlin is not supported"),
    (None, "awq", "--quantize awq needs a awq checkpoint, and this one has no quantization_config"),
    (GPTQ, "fp8", "--quantize fp8 does not apply to this gptq checkpoint"),
    (GPTQ, "awq", "--quantize awq does not apply to this gptq checkpoint"),
    ({**GPTQ, "bits": 3}, None, "GPTQ bits=3 is not supported; supported: bits 4 and 8"),
    ({**GPTQ, "checkpoint_format": "marlin"}, None, "GPTQ checkpoint_format='marlin' is not supported"),
    ({**GPTQ, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}, None, "modules_to_not_convert"),
    ({**GPTQ, "dynamic": {"-:.*down_proj": {}}}, None, "per-module `dynamic` overrides"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None, "AWQ version='gemv'"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, None, "AWQ bits=3 is not supported"),
    (ct_with(format="int-quantized", input_activations={"num_bits": 8, "type": "int", "strategy": "token",
                                                        "dynamic": True}),
     None, "compressed-tensors scheme format='int-quantized'"),
    (ct_with(input_activations={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
     None, "activations float8 tensor static is not supported"),
    (ct_with(ignore=["lm_head", "re:.*down_proj"]), None, "leave down_proj unquantized"),
    (ct_with(targets=["re:.*q_proj"]), None, "leave k_proj unquantized"),
    (ct_with(kv_cache_scheme={"num_bits": 8, "type": "float"}), None, "kv_cache_scheme"),
    (ct_with(quantization_status="frozen"), None, "quantization_status='frozen'"),
])
def test_unsupported_quantizations_fail_in_one_line(checkpoint, flag, message):
    with pytest.raises(QuantizationError) as error:
        resolve(checkpoint, flag)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_legacy_quantize_config_json_is_read(tmp_path, model_path):
    source = model_path("tiny-llama")
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 64, "desc_act": True}))
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.quantization_config["quant_method"] == "gptq"
    assert resolve(config.quantization_config, None).group_size == 64


def test_onednn_prepack_touches_only_unquantized_layers(model_path):
    from engine.models import model_class

    config = ModelConfig.from_pretrained(model_path("tiny-llama"))
    with quantization.building(resolve({**GPTQ, "group_size": 32}, None)):
        model = model_class(config)(config)
    qkv = model.model.layers[0].self_attn.qkv_proj
    before = qkv.qweight.clone()
    assert cpu_gemm.prepack_model(model) == 1  # the LM head
    assert not hasattr(qkv, "packed_weight") and torch.equal(qkv.qweight, before)


def test_the_launcher_refuses_an_exl2_checkpoint_in_one_line(tmp_path, model_path):
    source = model_path("tiny-llama")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "exl2", "bits": 4.0}
    for item in source.iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "engine", "--model-id", str(tmp_path), "--port", "0",
                             "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "quantized with 'exl2', which this engine cannot serve; supported:" in errors[0]
    assert "Traceback" not in result.stderr


def test_bitsandbytes_missing_or_unable_is_one_line_naming_the_package(monkeypatch):
    config = resolve(None, "bitsandbytes-nf4")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(QuantizationError, match="needs the `bitsandbytes` package") as error:
        config.check_device(torch.device("cpu"), torch.float32)
    assert "\n" not in str(error.value)


def test_bitsandbytes_that_fails_on_the_device_is_refused_at_start(monkeypatch):
    bnb = pytest.importorskip("bitsandbytes")
    config = resolve(None, "bitsandbytes-nf4")
    config.check_device(torch.device("cpu"), torch.float32)  # 0.46+ runs 4-bit on CPU

    def unsupported(*args, **kwargs):
        raise NotImplementedError("no kernel for this device\nsecond line")

    monkeypatch.setattr(bnb.functional, "quantize_4bit", unsupported)
    with pytest.raises(QuantizationError) as error:
        config.check_device(torch.device("cpu"), torch.float32)
    message = str(error.value)
    assert f"bitsandbytes {bnb.__version__} cannot run on cpu" in message and "no kernel for this device" in message
    assert "\n" not in message

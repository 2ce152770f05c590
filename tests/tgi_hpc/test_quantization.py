"""`serve` on quantized snapshots: the checkpoint's own quantization (config.json or an old GPTQ export's
quantize_config.json) or `--quantize` sizes the job by its weight bytes, passes through to the engine, and
every value the engine would refuse is refused here first, before anything reaches sbatch."""
from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest

from tgi_hpc.cli import main
from tgi_hpc.models import quantization
from tgi_hpc.models.quantization import SUPPORTED, check_quantize
from tgi_hpc.models.size import catalog_size_b, estimate_params_b
from tgi_hpc.models.store import model_dir

# Shapes as in the Hub's config.json: Mistral-Small-24B (2 GPUs on Mila in bf16) and Llama-3-70B (4 GPUs).
MODEL_24B = {"model_type": "mistral", "hidden_size": 5120, "num_hidden_layers": 40, "intermediate_size": 32768,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072,
             "torch_dtype": "bfloat16"}
MODEL_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16"}
# quantization_config blocks as the exporters write them (AutoGPTQ/GPTQModel, AutoAWQ, llm-compressor).
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True, "true_sequential": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                            "dynamic": False, "actorder": None, "observer": "minmax"}}}}
CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "ignore": ["lm_head"], "config_groups": {"group_0": {
              "targets": ["Linear"], "output_activations": None,
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                    "dynamic": True},
              "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                          "dynamic": False}}}}
LEGACY_GPTQ = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False, "sym": True,
               "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model"}


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A model store in tmp; Mila's profile read here (no SSH), with an sbatch that records any call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'sbatch-called'}\necho 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TGI_HPC_REMOTE", "0")
    monkeypatch.setenv("TGI_HPC_CONFIG_DIR", str(tmp_path / "config"))
    for name in ("TGI_HPC_CLUSTER", "TGI_HPC_ACCOUNT", "CC_CLUSTER", "TGI_HPC_SET"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "store"


def _stored(store: Path, model_id: str, config: dict, legacy: dict | None = None) -> None:
    folder = model_dir(store, model_id)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if legacy is not None:
        (folder / "quantize_config.json").write_text(json.dumps(legacy))


def _serve(capsys, store: Path, model_id: str, *args: str, dry_run: bool = True) -> tuple[int, str, str]:
    argv = ["serve", "--cluster", "mila", "--set", f"paths.models={store}",
            "--set", f"paths.jobs={store.parent / 'jobs'}", "--model", model_id, *args]
    code = main(argv + (["--dry-run"] if dry_run else []))
    out, err = capsys.readouterr()
    return code, out, err


def _gpus(script: str) -> int:
    shards = re.search(r"--num-shard (\d+)", script)
    assert shards, script
    return int(shards.group(1))


def test_the_toolkit_lists_the_formats_the_engine_serves():
    pytest.importorskip("torch")
    from engine.layers.quantization import config as engine

    assert quantization.FROM_CHECKPOINT == engine.FROM_CHECKPOINT
    assert quantization.AT_LOAD == engine.AT_LOAD
    assert quantization.SUPPORTED == engine.SUPPORTED


@pytest.mark.parametrize("flag", ["none", *SUPPORTED, "FP8", "Bitsandbytes-NF4"])
def test_every_value_serve_passes_is_one_the_launcher_accepts(capsys, store, flag):
    pytest.importorskip("torch")
    from engine.launcher import parse_args

    _stored(store, "org/small", MODEL_24B)
    code, script, err = _serve(capsys, store, "org/small", "--quantize", flag)
    if flag.lower() in quantization.FROM_CHECKPOINT:   # a float snapshot: refused, as the engine would
        assert code == 2 and "needs a" in err
        return
    assert code == 0, err
    passed = re.findall(r"--quantize (\S+)", script)
    assert passed == ([] if flag == "none" else [flag.lower()])
    assert parse_args(["--model-id", "m", *(["--quantize", *passed] if passed else [])], environ={})


CHECKPOINTS = [None, GPTQ, AWQ, CT_W4A16, CT_FP8, {"quant_method": "exl2", "bits": 4.0},
               {"quant_method": "fp8", "weight_block_size": [128, 128]}, {"bits": 4},
               {"quant_method": "bitsandbytes", "load_in_4bit": True}, {"quant_method": "GPTQ", "bits": 4}]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: (c or {}).get("quant_method", "none"))
@pytest.mark.parametrize("flag", [None, "none", *SUPPORTED, "exl2", "marlin", ""])
def test_the_toolkit_refuses_exactly_what_the_engine_refuses(checkpoint, flag):
    """Method and flag level: per-format details (bits=3, gemv...) stay the engine's, at start."""
    pytest.importorskip("torch")
    from engine.layers.quantization import QuantizationError, resolve

    config = {**MODEL_24B, **({"quantization_config": checkpoint} if checkpoint else {})}
    try:
        resolve(copy.deepcopy(checkpoint), flag)
        engine_refuses = False
    except QuantizationError:
        engine_refuses = True
    try:
        passed = check_quantize(flag, config)
        toolkit_refuses = False
    except Exception as error:  # noqa: BLE001 - which error is checked below
        assert type(error).__name__ == "UsageError", error
        toolkit_refuses = True
    assert toolkit_refuses == engine_refuses
    if not toolkit_refuses:
        assert passed == (None if flag in (None, "", "none") else flag)


@pytest.mark.parametrize("checkpoint, legacy", [(GPTQ, None), (AWQ, None), (CT_W4A16, None), (CT_FP8, None),
                                                (None, LEGACY_GPTQ)], ids=["gptq", "awq", "ct-w4a16", "ct-fp8",
                                                                           "quantize_config.json"])
def test_a_quantized_snapshot_gets_fewer_gpus_than_its_bf16_twin(capsys, store, checkpoint, legacy):
    _stored(store, "org/small-bf16", MODEL_24B)
    quantized = {**MODEL_24B, **({"quantization_config": checkpoint} if checkpoint else {})}
    _stored(store, "org/small-quant", quantized, legacy)
    code, bf16, err = _serve(capsys, store, "org/small-bf16")
    assert code == 0, err
    code, script, err = _serve(capsys, store, "org/small-quant")
    assert code == 0, err
    assert _gpus(script) < _gpus(bf16) == 2
    assert "--quantize" not in script          # the engine reads the checkpoint's own config
    assert "#SBATCH --partition=unkillable" in script and "#SBATCH --partition=unkillable" not in bf16


def test_a_70b_gptq_int4_is_sized_by_its_35_gb_not_140(capsys, store):
    _stored(store, "org/llama-70b", MODEL_70B)
    _stored(store, "org/llama-70b-gptq", {**MODEL_70B, "quantization_config": {**GPTQ, "desc_act": False}})
    assert 39 < 2 * catalog_size_b("org/llama-70b-gptq", {**MODEL_70B, "quantization_config": GPTQ}) < 41  # GB
    assert estimate_params_b("x", MODEL_70B) == pytest.approx(70.5, abs=0.2)
    gpus = [_gpus(_serve(capsys, store, name)[1]) for name in ("org/llama-70b", "org/llama-70b-gptq")]
    assert gpus == [4, 2]


@pytest.mark.parametrize("flag, expected", [("fp8", "fp8"), ("FP8", "fp8"), ("bitsandbytes-nf4", "bitsandbytes-nf4"),
                                            ("bitsandbytes", "bitsandbytes")])
def test_quantize_at_load_passes_through_and_shrinks_the_job(capsys, store, flag, expected):
    _stored(store, "org/small", MODEL_24B)
    code, script, err = _serve(capsys, store, "org/small", "--quantize", flag)
    assert code == 0, err
    assert f"--quantize {expected}" in script and _gpus(script) == 1
    code, plain, _ = _serve(capsys, store, "org/small", "--quantize", "none")
    assert code == 0 and "--quantize" not in plain and _gpus(plain) == 2


def test_naming_the_checkpoints_own_format_passes_it_through(capsys, store):
    _stored(store, "org/awq", {**MODEL_24B, "quantization_config": AWQ})
    code, script, err = _serve(capsys, store, "org/awq", "--quantize", "AWQ")
    assert code == 0, err
    assert "--quantize awq" in script and _gpus(script) == 1


def test_without_a_config_the_flag_is_checked_and_the_name_is_scaled(capsys, store):
    """A model not downloaded yet: only the value can be checked; the name-estimated size shrinks."""
    code, script, err = _serve(capsys, store, "org/Llama-3-70B-Instruct", "--quantize", "fp8")
    assert code == 0, err
    assert "--quantize fp8" in script and _gpus(script) == 2
    assert _gpus(_serve(capsys, store, "org/Llama-3-70B-Instruct")[1]) == 4


@pytest.mark.parametrize("value", ["exl2", "int4", "gptq;id", "fp16"])
def test_an_unknown_value_is_refused_with_the_list_before_sbatch(capsys, store, value):
    _stored(store, "org/small", MODEL_24B)
    code, out, err = _serve(capsys, store, "org/small", "--quantize", value, dry_run=False)
    assert code == 2 and out == ""
    assert all(name in err for name in SUPPORTED)
    assert not (store.parent / "sbatch-called").exists() and not (store.parent / "jobs").exists()


@pytest.mark.parametrize("checkpoint, legacy, flag, message", [
    (GPTQ, None, "fp8", "--quantize fp8 contradicts this gptq checkpoint"),
    (CT_FP8, None, "bitsandbytes-nf4", "--quantize bitsandbytes-nf4 contradicts this compressed-tensors checkpoint"),
    (None, LEGACY_GPTQ, "awq", "--quantize awq contradicts this gptq checkpoint"),
    (AWQ, None, "gptq", "--quantize gptq contradicts this awq checkpoint"),
    (None, None, "awq", "--quantize awq needs a awq checkpoint, and this one has no quantization_config"),
    ({"quant_method": "exl2", "bits": 4.0}, None, None, "quantized with 'exl2', which the engine cannot serve; "
                                                        "supported: gptq, awq"),
])
def test_a_contradiction_is_refused_in_one_line_before_sbatch(capsys, store, checkpoint, legacy, flag, message):
    config = {**MODEL_24B, **({"quantization_config": checkpoint} if checkpoint else {})}
    _stored(store, "org/m", config, legacy)
    code, out, err = _serve(capsys, store, "org/m", *(["--quantize", flag] if flag else []), dry_run=False)
    assert code == 2 and out == "" and message in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (store.parent / "sbatch-called").exists() and not (store.parent / "jobs").exists()


def test_config_json_wins_over_a_stale_quantize_config_json(capsys, store):
    """As in the engine: quantize_config.json counts only when config.json has no quantization_config."""
    _stored(store, "org/awq", {**MODEL_24B, "quantization_config": AWQ}, legacy=LEGACY_GPTQ)
    code, _, err = _serve(capsys, store, "org/awq", "--quantize", "gptq")
    assert code == 2 and "contradicts this awq checkpoint" in err


@pytest.mark.parametrize("bad", [
    {"quant_method": "gptq", "bits": "four", "group_size": None},
    {"quant_method": "compressed-tensors", "config_groups": ["not", "a", "dict"]},
    {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": "x"}}}},
])
def test_a_malformed_quantization_config_is_sized_as_float_and_left_to_the_engine(capsys, store, bad):
    _stored(store, "org/odd", {**MODEL_24B, "quantization_config": bad})
    code, script, err = _serve(capsys, store, "org/odd")
    assert code == 0, err
    assert _gpus(script) == 2


def test_a_hostile_quantize_config_json_is_ignored(capsys, store):
    _stored(store, "org/m", MODEL_24B, legacy=["not", "an", "object"])
    code, script, err = _serve(capsys, store, "org/m")
    assert code == 0 and _gpus(script) == 2, err


def test_engine_arg_cannot_bypass_the_check(capsys, store):
    _stored(store, "org/gptq", {**MODEL_24B, "quantization_config": GPTQ})
    code, _, err = _serve(capsys, store, "org/gptq", "--engine-arg", "--quantize=fp8")
    assert code == 2 and "tgi-hpc serve --quantize" in err


def test_from_a_laptop_the_snapshot_is_read_over_ssh_and_a_dry_run_stays_offline(capsys, store, tmp_path,
                                                                                  monkeypatch, sshd):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(sshd.known_hosts_line())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    _stored(store, "org/gptq", {**MODEL_24B, "quantization_config": GPTQ})
    # Mila's store lives under $SCRATCH: a $VAR path, expanded on the login node ($HOME/../..: any home's depth).
    remote_store = f"$HOME{'/..' * 32}{store}"
    argv = ["serve", "--cluster", "mila", "--remote", "--set", "login_host=login", "--set", f"paths.models={remote_store}",
            "--set", f"paths.jobs={tmp_path / 'jobs'}", "--model", "org/gptq", "--quantize", "fp8"]

    def ssh_config(port: int) -> None:
        (home / ".ssh" / "config").write_text(
            f"Host login\n  HostName 127.0.0.1\n  Port {port}\n  IdentityFile {sshd.client_key}\n")

    ssh_config(sshd.port)
    assert main(argv) == 2 and "contradicts this gptq checkpoint" in capsys.readouterr().err
    ssh_config(1)   # nothing listens there: a dry run must not even try
    assert main([*argv, "--dry-run"]) == 0 and "--quantize fp8" in capsys.readouterr().out
    assert not (tmp_path / "sbatch-called").exists()

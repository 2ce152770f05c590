"""Tiny quantized checkpoints in real formats, written from the format specs (not from engine code).

`build(kind, base_dir, out_dir)` quantizes every decoder linear layer of the float Llama at `base_dir`
with round-to-nearest, writes the checkpoint in the format of `kind` to out_dir/"quant", and the weights
the format's own dequantization formula gives back to out_dir/"reference" (a plain float checkpoint
transformers loads), so the engine on "quant" must give the logits transformers gives on "reference".

- GPTQ (AutoGPTQ `QuantLinear`): qweight int32 [K/(32/b), N], input row k at bits (k % (32/b)) * b;
  qzeros int32 [G, N/(32/b)], column n at bits (n % (32/b)) * b, holding zero - 1 in the original ("gptq")
  checkpoint format and zero in "gptq_v2"; scales fp16 [G, N]; g_idx int32 [K]; desc_act: the columns are
  quantized in a permuted order, so input k belongs to group (position of k in the order) // group_size.
- AWQ (AutoAWQ `WQLinear_GEMM`): qweight int32 [K, N/8] and qzeros int32 [G, N/8]: the 8 columns
  8c..8c+7 go to nibbles i = 0..7 in the order column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; scales fp16 [G, N].
- compressed-tensors formats are written by the `compressed-tensors` library itself (see test file).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    return [n[: -len(".weight")] for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS]


def rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool, order: torch.Tensor | None = None):
    """Round-to-nearest. Returns q [N, K] ints, scales [G, N] fp16, zeros [G, N] ints, g_idx [K]."""
    n, k = weight.shape
    size = k if group_size == -1 else group_size
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // size).to(torch.int32)
    groups = int(g_idx.max()) + 1
    maxq = 2 ** bits - 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = weight[:, g_idx == g]
        if sym:
            scale = cols.abs().amax(1).clamp(min=1e-8) / (maxq / 2)
            zero = torch.full((n,), (maxq + 1) // 2)
        else:
            low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale = ((high - low) / maxq).clamp(min=1e-8)
            zero = torch.round(-low / scale).clamp(0, maxq).long()
        scales[g], zeros[g] = scale, zero
    scales = scales.half()
    q = torch.round(weight / scales.float()[g_idx.long()].t()) + zeros[g_idx.long()].t()
    return q.clamp(0, maxq).long(), scales, zeros, g_idx


def pack_along_rows(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] ints -> [R / (32/bits), C] int32, row r at bits (r % per) * bits (or the interleaved `order`)."""
    per = 32 // bits
    out = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for i in range(per):
        source = order[i] if order else i
        out |= (values[source::per] & (2 ** bits - 1)) << (bits * i)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def pack_along_cols(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    return pack_along_rows(values.t(), bits, order).t().contiguous()


def gptq_tensors(weight, bits, group_size, sym, desc_act, v2, seed):
    order = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(seed)) if desc_act else None
    q, scales, zeros, g_idx = rtn(weight, bits, group_size, sym, order)
    stored_zeros = zeros if v2 else (zeros - 1) & (2 ** bits - 1)  # v1 keeps zero - 1, wrapped to the bits
    effective_zeros = stored_zeros + (0 if v2 else 1)
    tensors = {"qweight": pack_along_rows(q.t(), bits), "qzeros": pack_along_cols(stored_zeros, bits),
               "scales": scales, "g_idx": g_idx}
    dequantized = (q.t().float() - effective_zeros[g_idx.long()].float()) * scales.float()[g_idx.long()]
    return tensors, dequantized.t()


def awq_tensors(weight, group_size, seed):
    q, scales, zeros, g_idx = rtn(weight, 4, group_size, sym=False)
    tensors = {"qweight": pack_along_cols(q.t(), 4, AWQ_ORDER), "qzeros": pack_along_cols(zeros, 4, AWQ_ORDER),
               "scales": scales}
    dequantized = (q.t().float() - zeros[g_idx.long()].float()) * scales.float()[g_idx.long()]
    return tensors, dequantized.t()


def build(kind: str, options: dict, base_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """Write out_dir/quant (the format) and out_dir/reference (its dequantized float weights)."""
    quant, reference = out_dir / "quant", out_dir / "reference"
    for target in (quant, reference):
        shutil.copytree(base_dir, target)
    state = load_file(base_dir / "model.safetensors")
    quantized, dequantized = {}, dict(state)
    for name in linear_names(state):
        weight = state.pop(name + ".weight")
        # projections reading the same input (q/k/v, gate/up) share one act-order permutation, as GPTQ's
        # Hessian (from that input) orders them; options["seed"] lets a test break that
        shared = name if options.get("order_per_projection") else \
            name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        i = sum(map(ord, shared))
        if kind == "gptq":
            tensors, deq = gptq_tensors(weight, options["bits"], options["group_size"], options.get("sym", True),
                                        options.get("desc_act", False), options.get("v2", False), seed=i)
        else:
            tensors, deq = awq_tensors(weight, options["group_size"], seed=i)
        quantized.update({f"{name}.{key}": value for key, value in tensors.items()})
        if "bias" in options:  # some GPTQ exports write a bias for every layer, zeros where there was none
            quantized[f"{name}.bias"] = torch.full((weight.shape[0],), options["bias"], dtype=torch.float16)
        dequantized[name + ".weight"] = deq.contiguous()
    save_file({**state, **quantized}, quant / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quant / "config.json").read_text())
    if kind == "gptq":
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": options["bits"], "group_size": options["group_size"],
            "desc_act": options.get("desc_act", False), "sym": options.get("sym", True),
            "checkpoint_format": "gptq_v2" if options.get("v2") else "gptq", "damp_percent": 0.01}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": options["group_size"],
                                         "zero_point": True, "version": "gemm"}
    (quant / "config.json").write_text(json.dumps(config))
    return quant, reference


def build_compressed_tensors(weights: dict, activations: dict | None, base_dir: Path,
                             out_dir: Path) -> tuple[Path, Path]:
    """The float Llama at base_dir quantized and saved by the compressed-tensors library (min/max scales, as
    llm-compressor's RTN would), and out_dir/"reference" with the library's own fake-quantized weights."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    quant, reference = out_dir / "quant", out_dir / "reference"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=QuantizationArgs(**activations) if activations else None)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    dequantized = {}
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        args, weight = module.quantization_scheme.weights, module.weight.data
        if args.strategy == "group":
            grouped = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "channel":
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        else:
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        scale, zero = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        module.quantization_status = QuantizationStatus.FROZEN
        dequantized[name + ".weight"] = fake_quantize(weight, module.weight_scale.data,
                                                      getattr(module, "weight_zero_point", None), args).float()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(quant)
    compressor.update_config(str(quant))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, quant / name)
    shutil.copytree(base_dir, reference)
    state = load_file(base_dir / "model.safetensors")
    state.update(dequantized)
    save_file(state, reference / "model.safetensors", metadata={"format": "pt"})
    return quant, reference

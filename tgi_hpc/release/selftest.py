"""The release testing itself from inside, run by its own python: versions (`probe`) and a tiny generation (`check`).

Reached as `python -I -m tgi_hpc.release.selftest probe|check` (from tgi_hpc.release.verify); torch and the engine are imported only
inside the functions, so `probe` works without importing them.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path
from typing import Any

from tgi_hpc.release.kernels import parse_torch_cuda
from tgi_hpc.release.spec import COMPILE_COMMAND


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def probe() -> dict[str, Any]:
    """Versions, without importing torch (torch.version.cuda is read from torch/version.py)."""
    info = {"python": platform.python_version(), "prefix": sys.prefix, "tgi_hpc": _version("tgi-hpc"),
            "torch": _version("torch"), "transformers": _version("transformers"), "flash_attn": _version("flash-attn"),
            "cuda": None}
    try:
        info["cuda"] = parse_torch_cuda(Path(distribution("torch").locate_file("torch/version.py")).read_text())
    except (PackageNotFoundError, OSError):
        pass
    return info


def check(gpu: str) -> dict[str, Any]:
    """Import torch and generate on CPU (and on the GPU: gpu "yes", or "auto" when torch sees one)."""
    problems: list[str] = []
    warnings: list[str] = []
    rebuild = f"rebuild the release with `{COMPILE_COMMAND}`"
    info = probe()
    try:
        import torch
        info["cuda"] = torch.version.cuda
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"info": info, "problems": [f"import torch failed in the release: {type(e).__name__}: {e}; {rebuild}"],
                "warnings": []}
    try:
        info["cpu_generation"] = _generate("cpu")
    except Exception as e:  # noqa: BLE001
        problems.append(f"the engine could not generate on CPU: {type(e).__name__}: {e}; {rebuild}")
    has_gpu = torch.cuda.is_available()
    info["cuda_available"] = has_gpu
    if gpu == "yes" or (gpu == "auto" and has_gpu):
        problems += gpu_problems(info, has_gpu)
    elif info["cuda"] is None and os.path.exists("/dev/nvidiactl"):
        warnings.append("this node has a GPU but the release's torch is a CPU build: pin a CUDA torch to serve on GPU")
    return {"info": info, "problems": problems, "warnings": warnings}


def gpu_problems(info: dict[str, Any], has_gpu: bool) -> list[str]:
    """Inside the release: can torch (and flash-attn, if built) use this node's GPU? `info` is probe()'s."""
    if info["cuda"] is None:
        return [f"torch {info['torch']} in the release is a CPU build: rebuild with a CUDA torch "
                f"(`{COMPILE_COMMAND} --torch-spec ...`; DRAC's wheelhouse torch is a CUDA build)"]
    if not has_gpu:
        return [f"torch (CUDA {info['cuda']}) sees no GPU: run on a GPU node (--gres=gpu:1), check `nvidia-smi`, "
                f"and that the driver supports CUDA {info['cuda']}"]
    import torch
    major, minor = torch.cuda.get_device_capability()
    info["gpu"] = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    if f"sm_{major}{minor}" not in torch.cuda.get_arch_list() and not any(
            a.startswith(f"sm_{major}") for a in torch.cuda.get_arch_list()):
        return [f"torch {info['torch']} has no kernels for sm_{major}{minor} (it has {torch.cuda.get_arch_list()}): "
                "pin a torch build that supports this GPU"]
    problems = []
    try:
        info["gpu_generation"] = _generate("cuda")
    except Exception as e:  # noqa: BLE001
        problems.append(f"the engine could not generate on the GPU: {type(e).__name__}: {e}")
    if info["flash_attn"]:
        try:
            from flash_attn import flash_attn_func
            q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.float16)
            flash_attn_func(q, q, q, causal=True)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            problems.append(f"flash-attn {info['flash_attn']} does not run on this GPU (sm_{major}{minor}): "
                            f"{type(e).__name__}: {e}; rebuild with `{COMPILE_COMMAND} --with-kernels "
                            f"--cuda-archs {major}.{minor},...` including this GPU")
    return problems


def _generate(device: str) -> dict[str, Any]:
    """8 greedy tokens from a tiny random Llama written to a temp dir; the first must match transformers'."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tgi-hpc-tiny-") as tmp:
        model, tokenizer = _write_tiny_model(Path(tmp))
        config = EngineConfig(model_id=tmp, device=device, max_total_tokens=64, cpu_kv_cache_bytes=4 * 1024**2,
                              gpu_memory_utilization=0.1, enforce_eager=True)
        with LLMEngine(config) as llm:
            out = llm.generate(["w1 w2 w3"], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    if out.error or out.num_generated_tokens != 8:
        raise RuntimeError(f"generated {out.num_generated_tokens} of 8 tokens (error: {out.error})")
    if device == "cpu":
        import torch
        with torch.no_grad():
            expected = int(model(torch.tensor([tokenizer.encode("w1 w2 w3")])).logits[0, -1].argmax())
        if out.tokens[0].id != expected:
            raise RuntimeError(f"the engine's first greedy token {out.tokens[0].id} differs from transformers' "
                               f"{expected} on the same weights")
    return {"tokens": out.num_generated_tokens, "text": out.generated_text,
            "seconds": round(time.monotonic() - start, 2)}


def _write_tiny_model(folder: Path) -> tuple[Any, Any]:
    """A 64-word WordLevel tokenizer and a 1-layer random Llama: no network, no cache, < 1 s."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    return model, tokenizer


def _main(argv: list[str]) -> int:
    if argv[:1] == ["probe"]:
        result = probe()
    elif argv[:1] == ["check"]:
        result = check(argv[1] if len(argv) > 1 else "auto")
    else:
        print("usage: python -m tgi_hpc.release.selftest probe|check [yes|no|auto]", file=sys.stderr)
        return 2
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

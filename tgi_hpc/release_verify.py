"""Verify an engine release (complete, in place, executable, able to generate) and repair what a copy breaks.

`verify_release` runs on the login node or in a job. The engine checks run in a subprocess with the
release's own python (`python -I -m tgi_hpc.release_verify check`), so they test exactly what a serve job
gets: this module is installed in every release too, and imports nothing beyond the stdlib and
tgi_hpc.release until the check itself imports torch and the engine.
"""
from __future__ import annotations

import json
import os
import platform
import re
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path
from typing import Any

from tgi_hpc.errors import ReleaseError
from tgi_hpc.release import LOCK, WHEELHOUSE, parse_torch_cuda, read_manifest, sha256_file, write_manifest

FIX_COMMAND = "tgi-hpc release verify --fix"
COMPILE_COMMAND = "tgi-hpc compile"
_CHECK_TIMEOUT_S = 900


@dataclass
class VerifyReport:
    """ok is True when `problems` is empty; each problem says what to run to fix it."""

    release_dir: Path
    ok: bool
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def format(self) -> str:
        lines = [f"release {self.release_dir}: {'OK' if self.ok else 'BROKEN'}"]
        lines += [f"  {k}: {v}" for k, v in self.details.items()]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def verify_release(release_dir: Path, *, gpu: bool | None = None, run_engine: bool = True,
                   timeout: int = _CHECK_TIMEOUT_S) -> VerifyReport:
    """Check the release at `release_dir` (a release or RELEASES/current).

    gpu: True = a GPU must work, False = CPU checks only, None = check the GPU if torch sees one.
    run_engine=False skips the subprocess (import + tiny generation): the file checks only.
    """
    path = Path(release_dir).expanduser()
    if not path.exists():
        return VerifyReport(path, False, [f"no release at {path}: build one with "
                                          f"`{COMPILE_COMMAND} --release-dir {path.parent}`"])
    root = path.resolve()
    report = VerifyReport(root, False, details={"release_dir": str(root)})
    try:
        manifest = read_manifest(root)
    except ReleaseError as e:
        manifest, report.problems = None, [str(e)]
    if manifest is None and not report.problems:
        report.problems.append(f"{root} is incomplete (no release.json): its build did not finish; rerun "
                               f"`{COMPILE_COMMAND} --release-dir {root.parent}` with the same options, it resumes")
    if manifest is not None:
        report.details.update(name=manifest.name, torch=manifest.torch, cuda=manifest.cuda,
                              transformers=manifest.transformers, kernels=manifest.kernels,
                              cuda_archs=manifest.cuda_archs, created_at=manifest.created_at)
        report.warnings += _wheelhouse_warnings(root, manifest)
    python_problem = _python_problem(root)
    report.problems += [python_problem] if python_problem else []
    report.problems += _location_problems(root, manifest)
    missing = _missing_exec_bits(root)
    if missing:
        report.problems.append(f"{len(missing)} files lost their executable bit (e.g. {missing[0]}), as a copy "
                               f"with Globus or without permissions does: run `{FIX_COMMAND} {root}`")
    if run_engine and python_problem is None:
        _run_check(root, manifest, gpu, timeout, report)
    report.ok = not report.problems
    return report


def fix_permissions(release_dir: Path) -> list[Path]:
    """Give back the exec bit (where a read bit is) to bin/* and shared libraries; returns what changed."""
    fixed = _missing_exec_bits(Path(release_dir), libraries=True)
    for path in fixed:
        mode = path.stat().st_mode
        path.chmod(mode | ((mode & 0o444) >> 2))
    return fixed


def relocate_release(release_dir: Path) -> list[Path]:
    """Point a moved release's bin/ scripts, activate files and pyvenv.cfg at where it is now."""
    root = Path(release_dir).resolve()
    manifest = read_manifest(root)
    old = _recorded_location(root, manifest)
    if old is None or old == str(root):
        return []
    changed = []
    for path in [*sorted((root / "bin").iterdir()), root / "pyvenv.cfg"]:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 1 << 20:
            continue
        data = path.read_bytes()
        if old.encode() in data:
            path.write_bytes(_relocated(data, old.encode(), str(root).encode()))
            changed.append(path)
    if manifest is not None:
        manifest.location = str(root)
        write_manifest(root, manifest)
    return changed


def _relocated(data: bytes, old: bytes, new: bytes) -> bytes:
    first, sep, rest = data.partition(b"\n")
    if not first.startswith(b"#!" + old + b"/"):
        return data.replace(old, new)
    interpreter = new + first[2 + len(old):]
    if b" " in interpreter or len(interpreter) > 125:
        # the kernel splits a shebang at spaces and cuts it at 127 bytes: let sh exec python, as pip does
        first = b"#!/bin/sh\n'''exec' \"" + interpreter + b"\" \"$0\" \"$@\"\n' '''"
    else:
        first = b"#!" + interpreter
    return first + sep + rest.replace(old, new)


def restore_python_links(release_dir: Path) -> list[Path]:
    """Recreate bin/python* from pyvenv.cfg when a copy dropped the symlinks (Globus does not copy them)."""
    root = Path(release_dir)
    cfg = _pyvenv_cfg(root)
    version = ".".join(cfg.get("version", cfg.get("version_info", "")).split(".")[:2])
    base = Path(cfg.get("home", "/nonexistent")) / f"python{version}"
    target = base if base.exists() else Path(cfg.get("executable", base))
    made = []
    for name, link in ((f"python{version}", target), ("python3", Path(f"python{version}")),
                       ("python", Path(f"python{version}"))):
        path = root / "bin" / name
        if version and not path.exists() and not path.is_symlink():
            path.symlink_to(link)
            made.append(path)
    return made


def repair_release(release_dir: Path) -> list[Path]:
    """What `--fix` does: python links back, exec bits back, then the paths of a moved release rewritten."""
    return restore_python_links(release_dir) + fix_permissions(release_dir) + relocate_release(release_dir)


# --- checks from outside --------------------------------------------------------------------------------

def _python_problem(root: Path) -> str | None:
    python = root / "bin" / "python"
    if python.exists():
        return None
    if not python.is_symlink():
        if (root / "pyvenv.cfg").is_file():
            return (f"{python} is missing (a copy that drops symlinks, like Globus, does that): run "
                    f"`{FIX_COMMAND} {root}` to recreate it from pyvenv.cfg")
        return f"{python} is missing: {root} is not a virtual environment; rebuild with `{COMPILE_COMMAND}`"
    home = _pyvenv_cfg(root).get("home", "?")
    return (f"{python} points to {os.readlink(python)}, which does not exist here: load the Python the release "
            f"was built with (pyvenv.cfg home = {home}; e.g. `module load python/3.11`) before activating it, "
            f"or rebuild the release on this cluster with `{COMPILE_COMMAND}`")


def _location_problems(root: Path, manifest: Any) -> list[str]:
    old = _recorded_location(root, manifest)
    if old is None or old == str(root) or (Path(old).exists() and Path(old).resolve() == root):
        return []
    return [f"the release was built at {old} but is now at {root}: bin/activate and the script shebangs still "
            f"point to {old}, so `source {root}/bin/activate` would not use it; run `{FIX_COMMAND} {root}` "
            f"(rewrites them), or rebuild it offline from its own wheelhouse: `{COMPILE_COMMAND} --offline "
            f"--wheelhouse {root}/wheelhouse --release-dir {root.parent}`"]


def _recorded_location(root: Path, manifest: Any) -> str | None:
    if manifest is not None:
        return manifest.location
    try:  # no manifest: the path venv wrote into bin/activate
        activate = (root / "bin" / "activate").read_text()
        m = re.search(r"^\s*(?:export\s+)?VIRTUAL_ENV=[\"']?([^\"'\n$]+)", activate, re.M)
    except OSError:
        return None
    return m[1] if m else None


def _pyvenv_cfg(root: Path) -> dict[str, str]:
    try:
        lines = (root / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition("=") for line in lines) if v}


def _missing_exec_bits(root: Path, *, libraries: bool = False) -> list[Path]:
    """Programs (a #! script or an ELF binary in a bin/ folder) without their exec bit; with `libraries`,
    shared libraries too (they load without it, but Globus strips it from them as well)."""
    missing = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in {"wheelhouse", "__pycache__", ".cache"}]
        in_bin = os.path.basename(dirpath) == "bin"
        for name in filenames:
            is_library = name.endswith(".so") or ".so." in name
            if not (in_bin or (libraries and is_library)):
                continue
            path = Path(dirpath, name)
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_mode & stat.S_IXUSR:
                continue
            if (libraries and is_library) or _is_program(path):
                missing.append(path)
    return sorted(missing)


def _is_program(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(b"#!") or head == b"\x7fELF"


def _wheelhouse_warnings(root: Path, manifest: Any) -> list[str]:
    warnings = []
    missing = [name for name in manifest.wheelhouse if not (root / WHEELHOUSE / name).is_file()]
    if missing:
        warnings.append(f"{len(missing)} wheels of the manifest are missing from {root / WHEELHOUSE} (e.g. "
                        f"{missing[0]}): an offline rebuild from it is no longer possible")
    lock = root / LOCK
    if not lock.is_file() or sha256_file(lock) != manifest.lock_sha256:
        warnings.append(f"{lock} is missing or changed since the build (manifest lock_sha256 differs)")
    return warnings


def _run_check(root: Path, manifest: Any, gpu: bool | None, timeout: int, report: VerifyReport) -> None:
    mode = {True: "yes", False: "no", None: "auto"}[gpu]
    argv = [str(root / "bin" / "python"), "-I", "-m", "tgi_hpc.release_verify", "check", mode]
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TRANSFORMERS_VERBOSITY="error")
    with tempfile.TemporaryDirectory(prefix="tgi-hpc-verify-") as cwd:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            report.problems.append(f"the release's python could not run the check: {e}")
            return
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report.problems.append(f"the release's python failed before reporting (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-1500:]}\nrebuild the release with `{COMPILE_COMMAND}`")
        return
    report.details.update(result["info"])
    report.problems += result["problems"]
    report.warnings += result["warnings"]
    if manifest is not None:
        for key in ("torch", "transformers"):
            found = result["info"].get(key)
            if found and found != getattr(manifest, key):
                report.problems.append(f"{key} {found} is installed but the manifest says {getattr(manifest, key)}: "
                                       f"something was installed into the release after its build; rebuild it "
                                       f"with `{COMPILE_COMMAND}` into a new directory")


# --- checks from inside the release (python -I -m tgi_hpc.release_verify probe|check) --------------------

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
        print("usage: python -m tgi_hpc.release_verify probe|check [yes|no|auto]", file=sys.stderr)
        return 2
    print(json.dumps(result, default=str))
    return 0


__all__ = ["VerifyReport", "verify_release", "fix_permissions", "relocate_release", "restore_python_links",
           "repair_release"]

if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

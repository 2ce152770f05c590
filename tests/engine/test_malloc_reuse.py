"""engine/malloc_reuse.py: a CPU prefill's freed buffers are reused, not faulted in again at every step."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fakes import test_model_path

ROOT = Path(__file__).resolve().parents[2]

# SmolLM2's 512-token prefill, three times to settle, then minor page faults over three more. The model runner
# applies malloc_reuse on CPU (or leaves glibc's defaults under TGI_HPC_MALLOC_REUSE=0)
SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch
    from engine import malloc_reuse
    from engine.batch import SeqSpan
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.model_runner import ModelRunner
    torch.set_num_threads(2)
    config = EngineConfig(model_id=sys.argv[1], device="cpu", cpu_kv_cache_bytes=64 << 20)
    runner = ModelRunner(config, ModelConfig.from_pretrained(config.model_id))
    span = SeqSpan(0, list(range(100, 612)), 0, list(range(512 // runner.block_size)))
    for _ in range(3):
        runner.run([span])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        runner.run([span])
    print(malloc_reuse.apply(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    runner.close()
""")


def prefill_faults(model: str, reuse: str) -> tuple[bool, int]:
    env = {**os.environ, "TGI_HPC_MALLOC_REUSE": reuse, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, model], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    applied, faults = out.stdout.split()[-2:]
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_prefill_buffers_are_reused_without_page_faults():
    model = str(test_model_path("smollm2"))
    applied, faults = prefill_faults(model, "1")
    off_applied, off_faults = prefill_faults(model, "0")
    assert applied and not off_applied
    # glibc's defaults: ~125k faults a 1,024-token prefill here (500 MiB zeroed by the kernel each step)
    assert off_faults > 10_000, "glibc's defaults no longer fault here: the module may be pointless"
    assert faults < off_faults // 50, (faults, off_faults)


def test_apply_is_decided_once_and_can_be_turned_off(monkeypatch):
    from engine import malloc_reuse
    monkeypatch.setattr(malloc_reuse, "_applied", None)
    monkeypatch.setenv(malloc_reuse.ENV, "0")
    assert malloc_reuse.apply() is False
    monkeypatch.setenv(malloc_reuse.ENV, "1")
    assert malloc_reuse.apply() is False     # decided once per process

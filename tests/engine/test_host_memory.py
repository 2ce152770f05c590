"""The CPU KV budget follows the job's memory: cgroup (v1 and v2), Slurm's variables, the machine."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.host_memory import KV_SHARE, MIN_KV_BYTES, MemoryLimit, cpu_kv_budget, memory_limit

GIB = 1 << 30


def machine(tmp_path, total_gib=64, available_gib=60, cgroup_lines="0::/job_1/step_0\n"):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {total_gib * GIB // 1024} kB\nMemFree: 1 kB\n"
                                  f"MemAvailable: {available_gib * GIB // 1024} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    return proc, tmp_path / "cgroup"


def test_no_limit_but_the_machine(tmp_path):
    proc, root = machine(tmp_path)
    got = memory_limit({}, proc, root)
    assert got == MemoryLimit(64 * GIB, "the machine's memory", 60 * GIB)


def test_a_cgroup_v2_limit_up_the_tree_and_its_usage(tmp_path):
    proc, root = machine(tmp_path)
    (root / "job_1" / "step_0").mkdir(parents=True)
    (root / "job_1" / "step_0" / "memory.max").write_text("max\n")
    (root / "job_1" / "memory.max").write_text(f"{16 * GIB}\n")
    (root / "job_1" / "memory.current").write_text(f"{4 * GIB}\n")
    got = memory_limit({}, proc, root)
    assert got.limit == 16 * GIB and "cgroup" in got.source and got.available == 12 * GIB


def test_a_cgroup_v1_memory_controller(tmp_path):
    proc, root = machine(tmp_path, cgroup_lines="5:cpu:/x\n4:memory:/slurm/uid_1/job_7\n0::/\n")
    folder = root / "memory" / "slurm" / "uid_1" / "job_7"
    folder.mkdir(parents=True)
    (folder / "memory.limit_in_bytes").write_text(f"{8 * GIB}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    got = memory_limit({}, proc, root)
    assert (got.limit, got.available) == (8 * GIB, 7 * GIB)


@pytest.mark.parametrize("environ, expected", [
    ({"SLURM_MEM_PER_NODE": "20480"}, 20 * GIB),
    ({"SLURM_MEM_PER_CPU": "4096", "SLURM_CPUS_ON_NODE": "3"}, 12 * GIB),
    ({"SLURM_MEM_PER_NODE": "0", "SLURM_MEM_PER_CPU": "x"}, 64 * GIB),  # 0 = the whole node; junk is ignored
])
def test_slurm_job_memory(tmp_path, environ, expected):
    proc, root = machine(tmp_path)
    got = memory_limit(environ, proc, root)
    assert got.limit == expected and got.available == min(60 * GIB, expected)


def test_unreadable_proc_gives_the_floor(tmp_path):
    got = memory_limit({}, tmp_path / "none", tmp_path / "none")
    assert got.limit == 0
    assert cpu_kv_budget(1000, 10**9, memory=got) == MIN_KV_BYTES
    assert cpu_kv_budget(1000, 1000, memory=got) == 10**6  # never more than the engine can hold


def test_the_budget_is_a_share_of_what_is_available_split_over_ranks(caplog):
    memory = MemoryLimit(32 * GIB, "SLURM_MEM_PER_NODE", 20 * GIB)
    with caplog.at_level(logging.INFO, logger="engine.host_memory"):
        assert cpu_kv_budget(1 << 10, 1 << 40, memory=memory) == int(20 * GIB * KV_SHARE)
    assert "SLURM_MEM_PER_NODE" in caplog.text and "--kv-cache-bytes" in caplog.text
    assert cpu_kv_budget(1 << 10, 1 << 40, 2, memory) == int(20 * GIB * KV_SHARE / 2)
    # engines sharing the node (offline batch --workers 4: --cuda-memory-fraction 0.25) together keep to the share
    assert cpu_kv_budget(1 << 10, 1 << 40, 1, memory, fraction=0.25) == int(20 * GIB * KV_SHARE * 0.25)


def test_never_more_than_the_engine_can_hold():
    memory = MemoryLimit(512 * GIB, "the machine's memory", 500 * GIB)
    assert cpu_kv_budget(46080, 128 * 4096, memory=memory) == 46080 * 128 * 4096


@pytest.mark.parametrize("available, max_total_tokens", [(40 << 20, 512), (1 << 40, 256)])
def test_the_engine_sizes_its_cache_from_the_machine(model_path, monkeypatch, available, max_total_tokens):
    """No --kv-cache-bytes: the worker asks host_memory; the cache holds what 128 requests could use."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    monkeypatch.setattr("engine.host_memory.memory_limit", lambda: MemoryLimit(2 * available, "test", available))
    engine = LLMEngine(EngineConfig(model_id=str(model_path("tiny-llama")), device="cpu", block_size=4,
                                    max_total_tokens=max_total_tokens))
    try:
        per_block = 2 * 2 * 4 * 2 * 16 * 4  # k and v, 2 layers, 4 tokens, 2 kv heads, head_dim 16, fp32
        budget = min(max(available * KV_SHARE, MIN_KV_BYTES), per_block // 4 * 128 * max_total_tokens)
        assert engine.block_manager.num_blocks == int(budget // per_block)
    finally:
        engine.close()

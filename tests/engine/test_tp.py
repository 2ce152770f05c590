"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's logits; dead workers fail fast, no orphans."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engine.batch import SeqSpan  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def make_runner(path, num_shard, **overrides):
    settings = dict(model_id=str(path), device="cpu", block_size=4, cpu_kv_cache_bytes=2**20,
                    num_shard=num_shard, master_port=0)
    return ModelRunner(EngineConfig(**{**settings, **overrides}), ModelConfig.from_pretrained(path))


def schedule_logits(runner):
    """Prefill, chunked prefill and mixed decode; every returned logits row, concatenated."""
    a, b = [list(range(3, 23)), list(range(40, 58))]
    tables = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 12, 11, 10]]
    rows = []
    for spans in (
        [SeqSpan(0, a[:14], 0, tables[0], "all"), SeqSpan(1, b[:6], 0, tables[1], "none")],
        [SeqSpan(0, a[14:15], 14, tables[0]), SeqSpan(1, b[6:15], 6, tables[1], "all")],
        [SeqSpan(0, a[15:16], 15, tables[0]), SeqSpan(1, b[15:16], 15, tables[1])],
    ):
        last, all_logits = runner.run(spans)
        rows += [last, *all_logits.values()]
    return torch.cat(rows)


def build_single_kv_head_llama(tmp_path):
    """A Llama with 1 kv head (replicated over 2 shards), sharded into several safetensors files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                         initializer_range=0.1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="50KB")
    return tmp_path


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-qwen2", "tiny-qwen3", "single-kv-head"])
def test_two_shards_give_the_same_logits_as_one(model_path, tmp_path, name):
    path = build_single_kv_head_llama(tmp_path) if name == "single-kv-head" else model_path(name)
    with make_runner(path, 1) as runner:
        expected = schedule_logits(runner)
    with make_runner(path, 2) as runner:
        workers = runner.worker_pids
        assert len(workers) == 1 and runner.num_kv_blocks > 0
        got = schedule_logits(runner)
    assert got.shape == expected.shape == (28, ModelConfig.from_pretrained(path).vocab_size)  # 15 + 11 + 2 rows
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert not _alive(workers[0])


def test_head_counts_that_do_not_split_are_refused(model_path):
    path = model_path("smollm2")  # 9 heads, 3 kv heads
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        make_runner(path, 2)


def test_killed_worker_makes_run_fail_fast_and_close_cleans_up(model_path):
    runner = make_runner(model_path("tiny-llama"), 2)
    try:
        runner.run([SeqSpan(0, [1, 2, 3], 0, [0])])
        (pid,) = runner.worker_pids
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1"):
            for _ in range(50):  # the kill lands asynchronously; the first run after it must fail
                runner.run([SeqSpan(0, [4], 3, [0])])
                time.sleep(0.1)
        assert time.monotonic() - started < 10
        with pytest.raises(RuntimeError):
            runner.run([SeqSpan(0, [4], 3, [0])])  # stays failed
    finally:
        runner.close()
    runner.close()
    assert not _alive(pid)


def test_workers_exit_when_the_engine_process_is_killed(model_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from engine.config import EngineConfig
        from engine.model_config import ModelConfig
        from engine.model_runner import ModelRunner
        if __name__ == "__main__":
            path = {str(model_path("tiny-llama"))!r}
            config = EngineConfig(model_id=path, device="cpu", num_shard=2, master_port=0, cpu_kv_cache_bytes=2**20)
            runner = ModelRunner(config, ModelConfig.from_pretrained(path))
            print(runner.worker_pids[0], flush=True)
            time.sleep(600)
    """)
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(engine.stdout.readline())
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "worker outlived its engine process"


def _alive(pid):
    """True while `pid` runs (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False

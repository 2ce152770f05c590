"""Ranks started by an external launcher, as srun starts them on several nodes: each rank is its own process
with its own (RANK, WORLD_SIZE, LOCAL_RANK=0) as if alone on its node, gloo between them. Pipeline
parallelism (and pipeline x tensor) gives the single-process engine's greedy tokens; a dead rank ends all."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engine.config import EngineConfig  # noqa: E402
from engine.distributed import find_free_port  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.parallel_layout import ParallelLayout, from_env, stage_layers  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 5, 9, 14, 3, 7, 21, 8, 30, 2, 11, 4, 6], [17, 4, 2], [9, 9, 40, 3, 5, 12, 26]]
SETTINGS = dict(device="cpu", block_size=4, cpu_kv_cache_bytes=2**24, max_batch_prefill_tokens=8,
                max_total_tokens=40, cuda_graphs=[])
ENGINE_FLAGS = ["--device", "cpu", "--block-size", "4", "--kv-cache-bytes", str(2**24),
                "--max-batch-prefill-tokens", "8", "--max-total-tokens", "40", "--cuda-graphs", "0", "--cpu-threads", "1"]

DRIVER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    from engine.launcher import _driven_engine
    from engine.config import EngineConfig
    from engine.parallel_layout import from_env
    from engine.sampling_params import SamplingParams
    import torch
    torch.set_num_threads(1)
    config = EngineConfig(**json.loads(sys.argv[1]))
    layout = from_env(os.environ, config.num_shard, config.pipeline_parallel_size)
    if sys.argv[2] == "logits":   # the runner alone, over test_tp's schedule ("all", "none", chunked spans)
        sys.path.insert(0, {tests!r})
        from test_tp import schedule_logits
        from engine.external_launch import DistributedRunner
        from engine.model_config import ModelConfig
        with DistributedRunner(config, ModelConfig.from_pretrained(config.model_id), layout) as runner:
            torch.save(schedule_logits(runner), sys.argv[3])
        sys.exit(0)
    with _driven_engine(config, layout) as engine:
        outputs = engine.generate(json.loads(sys.argv[2]), SamplingParams(max_new_tokens=8, ignore_eos=True))
    print(json.dumps([[t.id for t in out.tokens] for out in outputs]), flush=True)
""")


def rank_env(rank, world, port):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def follower(path, rank, world, port, tp, pp, *flags):
    """`python -m engine` as srun would start it for `rank`; its log is a temporary file (a pipe could fill)."""
    argv = [sys.executable, "-m", "engine", "--model-id", str(path), "--num-shard", str(tp),
            "--pipeline-parallel-size", str(pp), *ENGINE_FLAGS, *flags]
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(argv, env=rank_env(rank, world, port), stdout=subprocess.DEVNULL, stderr=log)
    process.log = log
    return process


def log_of(process):
    process.log.seek(0)
    return process.log.read()[-3000:]


def single_process_tokens(path):
    with LLMEngine(EngineConfig(model_id=str(path), **SETTINGS)) as engine:
        outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    return [[t.id for t in out.tokens] for out in outputs]


def launched_tokens(path, tp, pp, *driver_args):
    """Rank 0 runs DRIVER (greedy tokens, or with "logits" the runner's logits); the others `python -m engine`."""
    world, port = tp * pp, find_free_port()
    config = dict(model_id=str(path), num_shard=tp, pipeline_parallel_size=pp, master_port=port, **SETTINGS)
    others = [follower(path, rank, world, port, tp, pp) for rank in range(1, world)]
    script = DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests" / "engine"))
    try:
        driver = subprocess.run([sys.executable, "-c", script, json.dumps(config), *(driver_args or [json.dumps(PROMPTS)])],
                                env=rank_env(0, world, port), capture_output=True, text=True, timeout=600)
        assert driver.returncode == 0, driver.stderr[-3000:]
        for process in others:
            assert process.wait(timeout=60) == 0, log_of(process)  # told to stop: a clean exit
    finally:
        for process in others:
            process.kill()
    return None if driver_args else json.loads(driver.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])  # gpt2: tied LM head on the last stage, learned positions
def test_two_stages_give_the_single_process_tokens(model_path, name):
    path = model_path(name)
    assert launched_tokens(path, tp=1, pp=2) == single_process_tokens(path)


@pytest.mark.parametrize("tp, pp", [(1, 2), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_pipeline_logits_equal_one_process_on_all_none_and_chunked_spans(model_path, tmp_path, tp, pp):
    from test_tp import make_runner, schedule_logits

    path = model_path("tiny-llama")
    with make_runner(path, 1, cpu_kv_cache_bytes=2**24) as runner:
        expected = schedule_logits(runner)
    launched_tokens(path, tp, pp, "logits", str(tmp_path / "logits.pt"))
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, pp", [("smollm2", 1, 2), ("tiny-llama", 2, 2), ("tiny-olmo2", 1, 2),
                                          ("tiny-qwen3-moe", 2, 2)])
def test_pipeline_and_tensor_ranks_give_the_single_process_tokens(model_path, name, tp, pp):
    path = model_path(name)
    assert launched_tokens(path, tp=tp, pp=pp) == single_process_tokens(path)


def _start_all(path, tmp_path, world=2):
    """Every rank through the real launcher; rank 0 serves HTTP and writes the ready file."""
    port, ready = find_free_port(), tmp_path / "ready.json"
    ranks = [follower(path, rank, world, port, 1, world, "--rank-timeout", "5",
                      *(["--port", "0", "--hostname", "127.0.0.1", "--ready-file", str(ready)] if rank == 0 else []))
             for rank in range(world)]
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert time.monotonic() < deadline and all(r.poll() is None for r in ranks), \
            "\n".join(log_of(r) for r in ranks)
        time.sleep(0.2)
    return ranks, json.loads(ready.read_text())


@pytest.mark.parametrize("victim", [0, 1])
def test_a_dead_rank_ends_every_other_rank(model_path, tmp_path, victim):
    ranks, ready = _start_all(model_path("tiny-llama"), tmp_path)
    try:
        assert ready["pid"] == ranks[0].pid  # only rank 0 serves and publishes the endpoint
        os.kill(ranks[victim].pid, signal.SIGKILL)
        survivor = ranks[1 - victim]
        started = time.monotonic()
        status = survivor.wait(timeout=60)
        assert status != 0, "a rank whose peer died must fail, so srun --kill-on-bad-exit ends the step"
        assert time.monotonic() - started < 30
    finally:
        for process in ranks:
            process.kill()
            process.wait()


def test_stage_layers_split_evenly_first_stages_take_the_rest():
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(stage_layers(30, 2, s)) for s in range(2)] == [list(range(15)), list(range(15, 30))]
    with pytest.raises(ValueError, match="2 layers cannot be split over 4"):
        stage_layers(2, 4, 0)


def test_layout_numbers_ranks_stage_major():
    layout = ParallelLayout(rank=5, tp_size=4, pp_size=2, local_rank=1)
    assert (layout.stage, layout.tp_rank, layout.prev_rank, layout.logits_rank) == (1, 1, 1, 4)
    assert layout.is_last_stage and not layout.is_first_stage and layout.stage_ranks(1) == [4, 5, 6, 7]


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2"}, (6, 2)),
    ({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "1", "SLURM_LOCALID": "1"}, (5, 1)),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (3, 3)),
])
def test_ranks_come_from_srun_or_torchrun(env, expected):
    layout = from_env(env, tp_size=4, pp_size=2)
    assert (layout.rank, layout.local_rank) == expected


@pytest.mark.parametrize("env, tp, pp, message", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, 4, 2, "SLURM_NTASKS=4 processes, but --num-shard 4 x"),
    ({}, 1, 2, "needs one process per GPU started by srun or torchrun"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, 1, 2, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, 1, 2, "rank 2 is outside the 2 ranks"),
])
def test_inconsistent_launch_environments_are_refused(env, tp, pp, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        from_env(env, tp, pp)


def test_a_single_task_keeps_the_spawning_engine():
    assert from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, tp_size=2, pp_size=1) is None


def test_peer_watch_stop_waits_for_its_thread():
    """A watch thread left in a store call at interpreter exit can abort the process ("terminate called without an
    active exception", seen on rank 0 at exit under load): stop() returns only once the thread is gone, even while a
    peer it watches never beats."""
    from engine.distributed import create_store
    from engine.external_launch import PeerWatch
    master = create_store("127.0.0.1", 0, 2, is_master=True, timeout_s=5)
    config = EngineConfig(master_addr="127.0.0.1", master_port=master.port, rank_timeout_s=30.0)
    dead = []
    watch = PeerWatch(config, ParallelLayout(0, 2), dead.append)
    time.sleep(0.2)                     # inside its loop: a beat, then waiting for the next
    assert watch._thread.is_alive()
    watch.stop()
    assert not watch._thread.is_alive() and not dead

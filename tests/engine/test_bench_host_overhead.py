"""`bench_engine.py --host-overhead` at a tiny shape: it runs the real engine step around the stand-in runner,
every sequence decodes every step, and it reports each phase and the last line the issue asks for."""
import re
import sys

import pytest

pytest.importorskip("torch")
from fakes import SCRIPTS, test_model_path  # noqa: E402


def run_bench(capsys, *args: str) -> list[str]:
    """`bench_engine.py --host-overhead` at batch 4 over 40-token contexts, 3 steps; its output lines."""
    test_model_path("smollm2")                    # puts scripts/ on sys.path and builds the snapshot once
    assert str(SCRIPTS) in sys.path
    import bench_engine
    import torch
    threads = torch.get_num_threads()              # the benchmark sets 1 thread: leave the session as it was
    try:
        code = bench_engine.main(["--host-overhead", "--batch", "4", "--context", "40", "--steps", "3",
                                  "--warmup", "1", *args])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return capsys.readouterr().out.strip().splitlines()


def test_host_overhead_reports_phases_and_the_last_line(capsys):
    lines = run_bench(capsys, "--vocab", "5000", "--sampling", "mixed")
    for phase in ("schedule", "prepare", "sample", "detokenize", "outputs", "sample, host"):
        assert any(re.match(rf"{phase}\s+\d+", line) for line in lines), phase
    assert re.fullmatch(r"host overhead: \d+ us/step at batch 4", lines[-1])
    assert int(lines[-1].split()[2]) > 0


def test_evict_reads_inside_the_full_width_sample_and_still_reports(capsys):
    """--evict-mb: the read goes with the full-width sample call, whose time the host figure takes off."""
    lines = run_bench(capsys, "--vocab", "4096", "--evict-mb", "64")
    assert "64 MiB read inside each timed full-width sample call (--evict-mb)" in lines
    sample = next(int(line.split()[1]) for line in lines if re.match(r"sample\s+\d+", line))
    host = int(lines[-1].split()[2])
    assert sample > host > 0       # 64 MiB read per call (milliseconds), left out of the host figure


def test_stand_in_runner_returns_a_fresh_view_per_step():
    test_model_path("smollm2")
    from engine.batch import SeqSpan
    from host_overhead import InstantRunner
    runner = InstantRunner(batch=2, vocab=5000, real_vocab=4096, num_kv_blocks=8, block_size=4, max_position=64)
    spans = [SeqSpan(0, [1], 4, [0, 1]), SeqSpan(1, [2], 4, [2, 3]), SeqSpan(2, [1, 2], 0, [4], "none")]
    first, _ = runner.run(spans)
    second, _ = runner.run(spans)
    assert first.shape == (2, 5000) and not torch_equal(first, second)
    assert bool((first[:, 4096:].max() < first[:, :4096].max(dim=-1).values).all())
    with pytest.raises(ValueError, match="block id out of range"):
        runner.run([SeqSpan(0, [1], 4, [0, 99])])


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)

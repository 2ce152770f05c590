"""`scripts/bench_cpu_gemv.py` runs both of its comparisons at a tiny shape and prints one table row per row count."""
import re

import pytest

pytest.importorskip("torch")
from fakes import test_model_path  # noqa: E402


@pytest.mark.parametrize("extra", [[], ["--bfloat16"]])
def test_bench_cpu_gemv_prints_a_row_per_row_count(capsys, extra):
    test_model_path("tiny-llama")                 # puts scripts/ on sys.path and builds the snapshot once
    import bench_cpu_gemv
    import torch
    threads = torch.get_num_threads()
    try:
        assert bench_cpu_gemv.main(["--model-id", "tiny-llama", "--rows", "1,3", "--threads", "1", *extra]) == 0
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    header = "bfloat16 panels" if extra else "oneDNN"
    assert any(header in line for line in lines)
    assert [line.split("|")[1].strip() for line in lines if re.match(r"\| \d+ \|", line)] == ["1", "3"]

"""`tgi-hpc bench JOB` against a real engine served on the local cluster: the load goes through at two
concurrencies, the prefill and decode tables print, --json has the percentiles, and the results are saved
beside the job's log."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.releases import venv_release
from support.tgi_cli import TgiCli

pytestmark = pytest.mark.slow


def test_bench_a_served_model(local_cluster, model_path, tmp_path):
    tgi = TgiCli.for_cluster(local_cluster, tmp_path / "jobs")
    served = json.loads(tgi("serve", "--model", str(model_path("tiny-llama")), "--release", str(venv_release()),
                            "--max-total-tokens", "256", "--engine-arg", "--kv-cache-bytes=32MiB", "--wait",
                            "--timeout", "180", "--json", timeout=240).stdout)
    job = served["job_id"]
    try:
        result = json.loads(tgi("bench", job, "--concurrency", "1", "--concurrency", "2", "--requests", "4", "--new-tokens", "8",
                                "--warmup", "1", "--sequence-length", "20", "--json").stdout)
        assert result["sequence_length"] == 20
        assert [r["concurrency"] for r in result["runs"]] == [1, 2]
        for run in result["runs"]:
            assert (run["requests"], run["completed"], run["failed"]) == (4, 4, 0)
            assert 4 <= run["generated_tokens"] <= 32 and run["tokens_per_s"] > 0 and run["prompt_tokens"] == 4 * 20
            assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p50"] and run["prefill_tok_s"]["p50"] > 0
        saved = Path(result["saved"])
        assert saved.parent == tmp_path / "jobs" and json.loads(saved.read_text())["runs"] == result["runs"]
        table = tgi("bench", job, "--batch-size", "1", "--runs", "2", "--new-tokens", "4").stdout   # the workshop's names
        assert table.index("Prefill") < table.index("Decode") < table.index("Throughput"), table
        assert re.search(r"^\| prefill +\| +1 \| TTFT ms +\|( +\d+\.\d \|){6}$", table, re.M), table
        assert re.search(r"^\| decode +\| +1 \| TPOT ms +\|( +(\d+\.\d|-) \|){6}$", table, re.M), table
        assert "2/2 requests at concurrency 1" in table
    finally:
        tgi("stop", job, check=False)

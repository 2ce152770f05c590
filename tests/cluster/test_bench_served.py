"""`tgi-hpc bench JOB` against a real engine served on the local cluster: the load goes through, the tables
print, --json has the percentiles, and the results are saved beside the job's log."""
from __future__ import annotations

import json
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
        result = json.loads(tgi("bench", job, "--concurrency", "2", "--requests", "4", "--new-tokens", "8",
                                "--json").stdout)
        assert (result["requests"], result["completed"], result["failed"]) == (4, 4, 0)
        assert 4 <= result["generated_tokens"] <= 32 and result["tokens_per_s"] > 0
        assert 0 < result["ttft_s"]["p50"] <= result["e2e_s"]["p50"]
        saved = Path(result["saved"])
        assert saved.parent == tmp_path / "jobs" and json.loads(saved.read_text())["completed"] == 4
        table = tgi("bench", job, "--concurrency", "1", "--requests", "1", "--new-tokens", "4").stdout
        assert "TTFT" in table and "TPOT" in table and "1/1 requests" in table
    finally:
        tgi("stop", job, check=False)

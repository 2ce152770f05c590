"""scripts/gpu_check.sh on this CPU (--dry-run): stages run, their report lands in --out after each one,
and a stage cut off by the call's budget still leaves a report that says so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def test_a_dry_run_writes_the_report_and_the_logs_into_out(tmp_path):
    result = gpu_check("--dry-run", "--call", "kernels", "--only", "env,selfcheck", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["call"] == "kernels" and report["ok"] is True
    assert list(report["stages"]) == ["env", "selfcheck"]
    assert "torch" in report["stages"]["env"]["log_tail"]
    assert report["figures"]["selfcheck-auto"]   # the attention choice, as JSON
    assert "| selfcheck | ok |" in (tmp_path / "gpu_check.md").read_text()
    with tarfile.open(tmp_path / "logs.tar.gz") as logs:
        assert {"./env.log", "./selfcheck.log", "./stages.tsv"} <= set(logs.getnames())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md", "logs.tar.gz"]


def test_a_stage_cut_off_by_the_budget_is_reported_as_timed_out(tmp_path):
    # the benchmark's interpreter hangs (a wrapper that sleeps instead of running bench_engine.py); a 20 s call
    # budget leaves that stage about 5 s (gpu_check.sh keeps 15 s back), after which it must be cut off and
    # reported, not left running
    real = sys.executable
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\n[ "$1" = scripts/bench_engine.py ] && exec sleep 120\nexec {real} "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(python)}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--call", "bench",
                             "--only", "bench-8b", "--budget", "20", "--out", str(out)],
                            capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["stages"]["bench-8b"]["status"] == "timed out" and report["ok"] is False
    assert not (out / "running.log").exists()


@pytest.mark.parametrize("args", [["--call", "everything"], ["--frobnicate"]])
def test_bad_arguments_are_refused(args, tmp_path):
    result = gpu_check(*args, "--out", str(tmp_path))
    assert result.returncode == 2 and "gpu_check.sh:" in result.stderr

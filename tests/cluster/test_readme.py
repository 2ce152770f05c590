"""CONTRIBUTING.md's "try it on the local cluster" lines, pasted into bash as a newcomer would, and the
commands tgi-hpc prints in its hints, pasted back."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _readme_block(title: str) -> list[str]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split(f"## {title}", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()


def _env(local_cluster) -> dict[str, str]:
    env = {k: v for k, v in local_cluster.env.items() if k != "TGI_HPC_CLUSTER"}
    env.update(VIRTUAL_ENV=sys.prefix, PATH=f"{Path(sys.executable).parent}:{env.get('PATH', os.defpath)}",
               PYTHONUNBUFFERED="1")
    return env


def test_the_readme_local_cluster_lines_work_when_pasted(local_cluster):
    lines = _readme_block("Try it on the local cluster")
    assert lines[0].startswith("bash scripts/setup.sh")   # the one-time set-up the suite has already done
    script = "set -euo pipefail\n" + "\n".join(lines[1:]) + "\n"
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=_env(local_cluster), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "READY" in out.stderr and re.search(r"stopped \d+", out.stdout), out.stdout + out.stderr
    assert "MODEL" in out.stdout and "smollm2" in out.stdout       # the status table names the model


def test_the_commands_a_timeout_hint_prints_work_when_pasted(local_cluster, model_path, tmp_path):
    env = _env(local_cluster)
    base = ["--cluster", str(local_cluster.profile), "--set", f"paths.jobs={tmp_path / 'jobs'}"]
    out = subprocess.run([sys.executable, "-m", "tgi_hpc", "serve", *base, "--model", str(model_path("smollm2")),
                          "--release", sys.prefix, "--wait", "--timeout", "1"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 7, out.stderr
    hinted = re.findall(r"`(tgi-hpc [^`]+)`", out.stderr)
    assert {h.split()[1] for h in hinted} >= {"status", "stop", "logs"}, out.stderr
    for command in sorted(hinted, key=lambda c: c.split()[1] == "logs"):   # stop before following the log
        argv = shlex.split(command)            # verbatim: the hint carries --cluster/--set itself
        done = subprocess.run([sys.executable, "-m", "tgi_hpc", *argv[1:]], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (command, done.stdout, done.stderr)

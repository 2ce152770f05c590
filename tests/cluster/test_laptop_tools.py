"""`metrics` and `chat` from a "laptop" (Slurm only over sshd, through a ProxyJump hop): through a tunnel of their
own, then through the laptop's background tunnel; the real engine (SmolLM2) in a local Slurm job."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.releases import venv_release
from support.terminal import Terminal
from test_laptop import laptop  # noqa: F401  (the fixture: a HOME, ssh config and environment of its own)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_metrics_and_chat_from_the_laptop(laptop, local_cluster, model_path):  # noqa: F811
    tgi, _, home, _ = laptop
    out = tgi("serve", "--model", str(model_path("smollm2")), "--release", str(venv_release()), "--partition", "long",
              "--max-total-tokens", "2048", "--json")
    assert out.returncode == 0, out.stderr
    job_id = json.loads(out.stdout)["job_id"]
    try:
        # no tunnel yet: metrics opens one for itself (waiting for READY first), and closes it
        sample = json.loads(tgi("metrics", job_id, "--json", "--interval", "0.5", "--timeout", "180",
                                timeout=240).stdout)
        own = sample["url"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", own) and sample["replicas"] == [job_id]
        assert sample["token_source"] == "counters" and sample["counters"]["requests"] >= 1

        # with a background tunnel, both go through it
        background = tgi("tunnel", job_id, "--background", "--local-port", "0", timeout=240)
        assert background.returncode == 0, background.stderr
        url = re.search(r"ready at (http://127\.0\.0\.1:\d+)", background.stdout).group(1)
        assert json.loads(tgi("metrics", job_id, "--json", "--interval", "0.5").stdout)["url"] == url

        argv = [sys.executable, "-m", "tgi_hpc", "chat", job_id, "--cluster", str(local_cluster.profile),
                "--set", f"paths.jobs={laptop[3]}", "--set", f"remote_python={sys.executable}", "--max-tokens", "5"]
        term = Terminal(argv, tgi.env)
        try:
            term.expect(rf"chat with job {job_id} .* at {re.escape(url)};.*\n> $", timeout=120)
            start = term.send("Hello!\n")
            term.expect(r"Hello!\r?\n(.+?)\r?\n> $", start=start)
            term.send("/exit\n")
            assert term.proc.wait(30) == 0
        finally:
            term.close()
    finally:
        stopped = subprocess.run([sys.executable, "-m", "tgi_hpc", "tunnel", "stop"], env=tgi.env, capture_output=True,
                                 text=True, timeout=60)
        tgi("stop", job_id)
        local_cluster.cancel(job_id)
    assert stopped.returncode == 0 and f"stopped tunnels: {job_id}" in stopped.stdout, stopped.stderr

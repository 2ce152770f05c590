"""The README's quickstart, pasted and run on the local cluster as a newcomer would run it on Mila: its
commands (the model swapped for an offline tiny snapshot, the release for the engine's stand-in) and the output the
README shows, compared line by line once job ids, nodes, ports and paths are mapped to the README's."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.releases import standin_release

ROOT = Path(__file__).resolve().parents[2]
README_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
README_JOBS = "/network/scratch/a/alice/tgi-hpc/jobs"
README_JOB, README_NODE, README_ADDRESS = "4148", "cn-g017", "cn-g017:14148"


def quickstart() -> tuple[list[tuple[list[str], list[str]]], int]:
    """(commands, the output the README shows after them) per bash block, and the section's last line number."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Quickstart")
    section = text[start: text.index("\n## ", start + 1)]
    blocks = re.findall(r"```(bash)?\n(.*?)```", section, re.S)
    steps = []
    for kind, body in blocks:
        lines = body.strip("\n").split("\n")
        if kind:
            steps.append((_join_continuations(lines), []))
        else:
            steps[-1][1].extend(lines)
    return steps, text[:start].count("\n") + section.count("\n") + 1


def _join_continuations(lines: list[str]) -> list[str]:
    joined, current = [], ""
    for line in lines:
        current += line[:-1] if line.endswith("\\") else line
        if not line.endswith("\\"):
            joined.append(current)
            current = ""
    return joined


def test_the_quickstart_is_on_the_first_screen():
    steps, last_line = quickstart()
    assert last_line <= 62, f"the quickstart ends on line {last_line}: the first screen is about 60 lines"
    commands = [c.split()[1] for cmds, _ in steps for c in cmds if c.startswith("tgi-hpc")]
    assert commands == ["compile", "list", "download", "serve", "chat", "stop"]
    assert any(c.startswith("curl ") for cmds, _ in steps for c in cmds)


# Steps the local cluster cannot take here: a venv and pip (the suite's own venv stands in), a release build
# (minutes; tests/tgi_hpc/test_release.py and test_install_origin.py build them), a Hub download.
SKIPPED = ("python3 -m venv", "pip install", "tgi-hpc compile", "tgi-hpc download")


@pytest.mark.slow
def test_the_quickstart_runs_and_prints_what_the_readme_shows(local_cluster, model_path, tmp_path):
    steps, _ = quickstart()
    model, jobs = str(model_path("tiny-llama")), tmp_path / "jobs"
    release = standin_release(tmp_path / "release")     # the engine's stand-in: what is checked here is the CLI
    env = {k: v for k, v in local_cluster.env.items() if not k.startswith("TGI_HPC_")}
    env.update(TGI_HPC_CLUSTER=str(local_cluster.profile), TGI_HPC_SET=f"paths.jobs={jobs}", PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}:{env.get('PATH', os.defpath)}", PYTHONUNBUFFERED="1")
    actual: dict[str, str] = {}          # the run's own values, learnt from serve's output
    try:
        for commands, shown in steps:
            printed = []
            for command in commands:
                if command.startswith(SKIPPED):
                    continue
                command = _to_local(command.split("  #")[0], model, str(jobs), release, actual)
                done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=300,
                                      input="/exit\n", cwd=tmp_path)
                assert done.returncode == 0, (command, done.stdout, done.stderr)
                printed += (done.stderr + done.stdout).splitlines()
                if command.startswith("tgi-hpc serve"):
                    _learn(done.stdout, actual)
            _assert_shows(shown, [_to_readme(line, model, str(jobs), actual) for line in printed])
    finally:
        if "job" in actual:
            subprocess.run([sys.executable, "-m", "tgi_hpc", "stop", actual["job"]], env=env, capture_output=True)


def _to_local(command: str, model: str, jobs: str, release: Path, actual: dict[str, str]) -> str:
    command = command.replace(README_MODEL, model).replace(README_JOBS, jobs)
    if command.startswith("tgi-hpc serve"):
        command += f" --release {release}"
    if "job" in actual:
        command = command.replace(README_ADDRESS, actual["address"]).replace(README_JOB, actual["job"])
    return command


def _learn(stdout: str, actual: dict[str, str]) -> None:
    found = re.search(r"job (\d+) submitted.*READY at http://(\S+) on (\S+)", stdout, re.S)
    assert found, stdout
    actual.update(job=found.group(1), address=found.group(2), node=found.group(3))


def _to_readme(line: str, model: str, jobs: str, actual: dict[str, str]) -> str:
    line = line.replace(jobs, README_JOBS).replace(model, README_MODEL)
    line = re.sub(r'"generated_text": ?".*?"', '"generated_text":"..."', line)   # the stand-in spaces its JSON
    if "job" in actual:
        line = line.replace(actual["address"], README_ADDRESS).replace(actual["node"], README_NODE)
        line = re.sub(rf"\b{actual['job']}\b", README_JOB, line)
    return line


def _assert_shows(shown: list[str], printed: list[str]) -> None:
    """Every line the README shows is printed, in that order; PENDING and STARTING only where a poll saw
    them (a job that starts and is ready between two polls goes straight to READY)."""
    at = 0
    for line in shown:
        try:
            at = printed.index(line, at) + 1
        except ValueError:
            if line.endswith(": PENDING") or ": STARTING on " in line:   # a state between two polls
                continue
            raise AssertionError(f"the README shows {line!r}, the run printed:\n" + "\n".join(printed)) from None

"""The real CLI, end to end in-process (CliRunner) or as a subprocess where imports matter."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_help_lists_every_command(run):
    code, out, _ = run("--help")
    assert code == 0
    for command in ("serve", "status", "logs", "stop", "download", "models", "compile", "release", "profiles"):
        assert command in out


def test_cli_never_imports_torch_even_for_a_dry_run():
    code = ("import sys; from tgi_hpc.cli import main; "
            "rc = main(['serve', '--cluster', 'mila', '--model', 'meta-llama/Llama-3.1-8B-Instruct', '--dry-run']); "
            "heavy = [m for m in ('torch', 'transformers', 'engine', 'httpx', 'paramiko') if m in sys.modules]; "
            "print(rc, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("0 []"), out


def test_dry_run_prints_the_script_and_json(run):
    code, out, _ = run("serve", "--cluster", "mila", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpus", "2", "--dry-run")
    assert code == 0 and out.startswith("#!/bin/bash") and "--num-shard 2" in out
    code, out, _ = run("serve", "--cluster", "mila", "--model", "a/b", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["script"].startswith("#!/bin/bash")


def test_misspelled_override_names_the_key(run):
    code, _, err = run("serve", "--cluster", "mila", "--model", "a/b", "--dry-run", "--set", "slurm.acount=x")
    assert code == 3
    assert "slurm.acount" in err and "account" in err


def test_drac_without_account_says_how_to_set_it(run):
    code, _, err = run("serve", "--cluster", "narval", "--model", "a/b", "--dry-run")
    assert code == 3 and "--set slurm.account=" in err and "TGI_HPC_ACCOUNT" in err


def test_account_from_env_twin(run, monkeypatch):
    monkeypatch.setenv("TGI_HPC_ACCOUNT", "def-envpi")
    code, out, _ = run("serve", "--cluster", "narval", "--model", "a/b", "--dry-run")
    assert code == 0 and "#SBATCH --account=def-envpi" in out


def test_cluster_env_twin(run, monkeypatch):
    monkeypatch.setenv("TGI_HPC_CLUSTER", "mila")
    code, out, _ = run("serve", "--model", "a/b", "--dry-run")
    assert code == 0 and "profile mila" in out


def test_serve_fails_before_submitting_when_the_model_is_absent(run, tmp_path):
    code, _, err = run("serve", "--cluster", "local", "--set", f"paths.models={tmp_path}",
                       "--set", f"paths.jobs={tmp_path / 'jobs'}", "--model", "org/absent")
    assert code == 8
    assert "tgi-hpc download --model org/absent" in err
    assert not (tmp_path / "jobs").exists() or not list((tmp_path / "jobs").glob("*.sbatch"))


def test_hostile_model_id_is_a_clear_error(run):
    code, _, err = run("serve", "--cluster", "mila", "--model", "x/$(touch /tmp/pwned)", "--dry-run")
    assert code == 2 and "invalid model id" in err


def test_stop_needs_ids_or_all(run):
    code, _, err = run("stop", "--cluster", "local")
    assert code == 2 and "--all" in err


def test_profiles_list_and_show(run):
    code, out, _ = run("profiles")
    assert code == 0 and {"local", "mila", "computecanada"} <= set(out.split())
    code, out, _ = run("profiles", "show", "narval", "--json")
    data = json.loads(out)
    assert code == 0 and data["cluster"] == "narval" and data["slurm"]["account_required"] is True


def test_completion_script(run):
    code, out, _ = run("completion", "bash")
    assert code == 0 and "_TGI_HPC_COMPLETE" in out


def test_unknown_option_is_a_usage_error(run):
    code, _, err = run("serve", "--modle", "a/b")
    assert code == 2 and "--modle" in err


def test_quantize_passes_through_and_an_unknown_value_is_refused(run):
    """More (stored snapshots, contradictions, sizing) in test_quantization.py."""
    code, out, _ = run("serve", "--cluster", "mila", "--model", "a/b", "--dry-run", "--quantize", "bitsandbytes-nf4")
    assert code == 0 and "--quantize bitsandbytes-nf4" in out
    code, _, err = run("serve", "--cluster", "mila", "--model", "a/b", "--dry-run", "--quantize", "exl2")
    assert code == 2 and "'exl2' is not one of" in err and "'compressed-tensors'" in err and "'fp8'" in err


def test_stopping_an_unknown_job_says_so(run, tmp_path):
    code, _, err = run("stop", "--cluster", "local", "--set", f"paths.jobs={tmp_path}", "424242")
    assert code == 5 and "no such job: 424242" in err


def test_global_options_work_before_the_command_too(run):
    code, out, _ = run("--cluster", "narval", "--set", "slurm.account=def-root", "--json",
                       "serve", "--model", "a/b", "--dry-run", "--set", "slurm.defaults.serve.time=2:00:00")
    script = json.loads(out)["script"]
    assert code == 0 and "#SBATCH --account=def-root" in script and "#SBATCH --time=2:00:00" in script


def test_status_of_an_unknown_job_fails(run, tmp_path):
    code, out, err = run("status", "--cluster", "local", "--set", f"paths.jobs={tmp_path}", "424242", "--json")
    assert code == 5 and json.loads(out)[0]["state"] == "UNKNOWN" and "no such job: 424242" in err


def test_logs_follow_json_is_json_lines_until_the_job_ends(run, tmp_path, model_path):
    import threading
    import time

    from support.releases import standin_release

    base = ["--cluster", "local", "--set", f"paths.jobs={tmp_path / 'jobs'}"]
    code, out, _ = run("serve", *base, "--model", str(model_path("tiny-llama")),
                       "--release", str(standin_release(tmp_path / "rel")), "--wait", "--timeout", "60", "--json")
    job_id = json.loads(out)["job_id"]
    from tgi_hpc.slurm import jobs
    from tgi_hpc.slurm.cluster import open_cluster

    cluster = open_cluster("local", [f"paths.jobs={tmp_path / 'jobs'}"])
    threading.Timer(2.0, lambda: jobs.stop(cluster, [job_id])).start()   # not the CLI: it would print to stdout
    started = time.monotonic()
    code, out, _ = run("logs", *base, job_id, "-f", "--json")
    chunks = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and time.monotonic() - started < 30
    assert "stand-in engine" in "".join(c["log"] for c in chunks) and {c["job_id"] for c in chunks} == {job_id}

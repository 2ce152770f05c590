"""Cluster facts and rules from the docs, checked where a user meets them: `serve`/`compile`/`download --dry-run`."""
from __future__ import annotations

import json
import subprocess

import pytest

from tgi_hpc.cli import main
from tgi_hpc.errors import UsageError
from tgi_hpc.profiles.loader import load_profile, profile_dirs
from tgi_hpc.profiles.rules import parse_time
from tgi_hpc.profiles.yaml_file import read_yaml

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ACCOUNTS = {"computecanada": "def-x", "paice": "aip-x"}


def _account(cluster: str | None) -> list[str]:
    profile = "paice" if cluster in ("tamia", "killarney", "vulcan") else "computecanada" if cluster != "mila" else None
    return ["--set", f"slurm.account={ACCOUNTS[profile]}"] if profile else []


def _every_cluster() -> list[tuple[str, str | None]]:
    """(profile, cluster) for every shipped profile and each of its live clusters, read from the YAML."""
    out = []
    for path in sorted(p for d in profile_dirs() for p in d.glob("*.yaml")):
        clusters = read_yaml(path).get("clusters") or {}
        live = [c for c, over in clusters.items() if not (isinstance(over, dict) and over.get("retired"))]
        out += [(path.stem, c) for c in live] or [(path.stem, None)]
    return out


def _cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def _no_user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_HPC_CONFIG_DIR", str(tmp_path / "config"))
    for name in ("TGI_HPC_CLUSTER", "TGI_HPC_ACCOUNT", "CC_CLUSTER", "TGI_HPC_SET"):
        monkeypatch.delenv(name, raising=False)


def test_the_walk_finds_both_clouds_of_clusters():
    found = {c for _, c in _every_cluster()}
    assert {"fir", "nibi", "rorqual", "narval", "trillium", "rocky", "tamia", "killarney", "vulcan"} <= found
    assert ("mila", None) in _every_cluster() and "beluga" not in found and "mist" not in found


@pytest.mark.parametrize("profile, cluster", _every_cluster())
@pytest.mark.parametrize("model", [MODEL, "Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"])
def test_serve_dry_run_renders_valid_bash_on_every_cluster(capsys, profile, cluster, model):
    account = ACCOUNTS.get(profile)
    argv = ["serve", "--cluster", cluster or profile, "--model", model, "--dry-run", "--keep-alive"]
    code, out, err = _cli(capsys, *argv, *(["--set", f"slurm.account={account}"] if account else []))
    assert code == 0, err
    result = subprocess.run(["bash", "-n"], input=out, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert out.startswith("#!/bin/bash") and "#SBATCH --no-requeue" in out and "service watch" in out
    assert f"--served-model-name {model}" in out            # /v1/models says the model id, not a temp path
    assert "export TRITON_CACHE_DIR=\"${SLURM_TMPDIR}\"/triton-cache" in out   # node-local, per job


@pytest.mark.parametrize("cluster", ["narval", "vulcan"])
def test_a_72b_model_beyond_one_node_spans_two_nodes_as_the_readme_promises(capsys, cluster):
    # One node (4 x 40 GB A100, 4 x 48 GB L40S) is over the 65% rule for 144 GB of weights, and the dry run has
    # only the name: sized from the weights, it spans two nodes instead of being refused.
    code, out, err = _cli(capsys, "serve", "--cluster", cluster, "--model", "Qwen/Qwen2.5-72B-Instruct", "--dry-run",
                          *_account(cluster))
    assert code == 0, err
    assert "#SBATCH --nodes=2" in out and "#SBATCH --ntasks-per-node=4" in out
    assert "(size from the name)" in out


@pytest.mark.parametrize("kind", ["serve", "download", "compile"])
def test_rocky_renders_valid_scripts(capsys, kind):
    argv = {"serve": ["serve", "--model", MODEL], "download": ["download", "--model", MODEL, "--job"],
            "compile": ["compile", "--job"]}[kind]
    code, out, err = _cli(capsys, *argv, "--cluster", "rocky", "--dry-run", "--set", "slurm.account=def-x")
    assert code == 0, err
    script = out
    assert script.startswith("#!/bin/bash") and "#SBATCH --account=def-x" in script
    assert subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True).returncode == 0
    if kind == "serve":
        assert "#SBATCH --gres=gpu:h200:1" in out and 'HF_HUB_OFFLINE' in out
    else:
        assert "#SBATCH --gres" not in script


def test_rocky_follows_its_page():
    rocky = load_profile("rocky")
    assert (rocky.login_host, rocky.slurm.gpu_request, rocky.slurm.gpu_types) == ("rocky", "gres", ["h200"])
    assert rocky.slurm.gpu_memory_gb["h200"] == 141 and rocky.multinode.gpus_per_node == 8
    assert not rocky.network.compute_nodes_internet and rocky.paths.scratch_purge_days == 60
    assert parse_time(rocky.rules.time.max) == 7 * 86400


def test_mist_is_retired_and_points_at_trillium(capsys):
    code, _, err = _cli(capsys, "serve", "--cluster", "mist", "--model", MODEL, "--dry-run")
    assert code == 3 and "retired" in err and "--cluster trillium" in err


def test_slurm_time_strings_parse_as_sbatch_reads_them():
    assert [parse_time(t) for t in ("30", "30:00", "1:00:00", "1-0", "1-12", "1-12:30", "7-00:00:00")] == [
        1800, 1800, 3600, 86400, 129600, 131400, 604800]
    with pytest.raises(UsageError):
        parse_time("1h")


@pytest.mark.parametrize("cluster, time_, page", [
    ("fir", "30:00", "https://docs.alliancecan.ca/wiki/Fir#Site-specific_policies"),
    ("fir", "8-00:00:00", "https://docs.alliancecan.ca/wiki/Fir#Site-specific_policies"),
    ("narval", "45:00", "https://docs.alliancecan.ca/wiki/Narval/en#Site-specific_policies"),
    ("rorqual", "7-00:00:01", "https://docs.alliancecan.ca/wiki/Rorqual/en#Site-specific_policies"),
    ("nibi", "8-0", "https://docs.alliancecan.ca/wiki/Job_scheduling_policies#Time_limits"),
    ("nibi", "30:00", "https://docs.alliancecan.ca/wiki/Running_jobs#Cluster_particularities"),
    ("rocky", "7-00:00:01", "https://docs.alliancecan.ca/wiki/Rocky#Site-specific_policies"),
    ("trillium", "10:00", "https://docs.alliancecan.ca/wiki/Trillium_Quickstart"),
    ("trillium", "1-00:00:01", "https://docs.alliancecan.ca/wiki/Trillium_Quickstart"),
    ("tamia", "30:00", "https://docs.alliancecan.ca/wiki/TamIA/en#Site-specific_policies"),
    ("tamia", "25:00:00", "https://docs.alliancecan.ca/wiki/TamIA/en#Site-specific_policies"),
    ("vulcan", "8-00:00:00", "https://docs.alliancecan.ca/wiki/Vulcan/en#Site-specific_policies"),
])
def test_a_time_the_cluster_refuses_is_refused_before_submitting_with_its_page(capsys, cluster, time_, page):
    code, out, err = _cli(capsys, "serve", "--cluster", cluster, "--model", MODEL, "--time", time_, "--dry-run",
                          *_account(cluster))
    assert code == 2 and out == "" and page in err and f"--time {time_}" in err


@pytest.mark.parametrize("cluster, time_", [("fir", "1:00:00"), ("fir", "7-00:00:00"), ("trillium", "15:00"),
                                            ("nibi", "1:00:00"), ("killarney", "30-00:00:00")])
def test_times_inside_the_rules_pass(capsys, cluster, time_):
    account = "aip-x" if cluster == "killarney" else "def-x"
    code, _, err = _cli(capsys, "serve", "--cluster", cluster, "--model", MODEL, "--time", time_, "--dry-run",
                        "--set", f"slurm.account={account}")
    assert code == 0, err


def test_a_tamia_serve_job_asks_for_whole_nodes(capsys):
    code, out, err = _cli(capsys, "serve", "--cluster", "tamia", "--model", MODEL, "--dry-run",
                          "--set", "slurm.account=aip-x")
    assert code == 0, err
    assert "#SBATCH --gpus=h100:4" in out and "--num-shard 4" in out
    assert "#SBATCH --mem" not in out and "#SBATCH --cpus-per-task" not in out
    code, out, err = _cli(capsys, "serve", "--cluster", "tamia", "--model", MODEL, "--gpus", "1", "--dry-run",
                          "--set", "slurm.account=aip-x")
    assert code == 2 and "exactly 4 GPUs" in err and "https://docs.alliancecan.ca/wiki/TamIA/en" in err
    code, out, err = _cli(capsys, "serve", "--cluster", "tamia", "--model", MODEL, "--gpus", "8", "--dry-run",
                          "--set", "slurm.account=aip-x", "--set", "clusters.tamia.catalog=[]",
                          "--set", "slurm.defaults.serve.gpu_type=h200")
    assert code == 0 and "#SBATCH --gpus=h200:8" in out, err


@pytest.mark.parametrize("cluster", ["tamia", "killarney", "vulcan"])
def test_paice_jobs_need_an_aip_account_and_say_which(capsys, cluster):
    code, _, err = _cli(capsys, "serve", "--cluster", cluster, "--model", MODEL, "--dry-run")
    assert code == 3 and "aip-yourpi" in err
    code, _, err = _cli(capsys, "serve", "--cluster", cluster, "--model", MODEL, "--dry-run",
                        "--set", "slurm.account=def-someone")
    assert code == 2 and "aip-" in err and "PAICE_Allocations_and_compute_scheduling" in err


def test_paice_internet_and_login_hosts_follow_their_pages():
    tamia, killarney, vulcan = (load_profile(c) for c in ("tamia", "killarney", "vulcan"))
    assert (tamia.login_host, killarney.login_host, vulcan.login_host) == ("tamia", "killarney", "vulcan")
    assert not tamia.network.compute_nodes_internet and not vulcan.network.compute_nodes_internet
    assert killarney.network.compute_nodes_internet
    assert tamia.environment.env["HF_HUB_OFFLINE"] == "1" and vulcan.environment.env["HF_HUB_OFFLINE"] == "1"
    assert tamia.slurm.gpu_types == ["h100", "h200"]


def test_a_trillium_compile_job_targets_the_cpu_login(capsys):
    code, out, err = _cli(capsys, "compile", "--cluster", "trillium", "--job", "--dry-run", "--json",
                          "--set", "slurm.account=def-x")
    assert code == 0, err
    result = json.loads(out)
    assert result["details"]["submit_host"] == "trillium"
    assert "#SBATCH --gpus" not in result["script"] and "#SBATCH --mem" not in result["script"]
    assert "--with-kernels" not in result["script"]   # no flash-attn build unless asked (Triton ships with torch)
    code, out, err = _cli(capsys, "serve", "--cluster", "trillium", "--model", MODEL, "--dry-run",
                          "--set", "slurm.account=def-x")
    assert code == 0 and "#SBATCH --gpus-per-node=1" in out


def test_the_cpu_login_gets_its_own_connection_from_a_laptop(monkeypatch):
    from tgi_hpc.profiles.schema import Resources
    from tgi_hpc.slurm import cluster as cluster_mod

    opened = []

    class FakeRunner:
        def __init__(self, alias, access_rules=()):
            opened.append(alias)

        def close(self):
            pass

    monkeypatch.setattr(cluster_mod, "_ssh_runner", FakeRunner)
    cluster = cluster_mod.open_cluster("trillium", ["slurm.account=def-x"], remote=True, strict_paths=False)
    assert opened == ["trillium-gpu"]
    cpu = cluster.for_job(Resources(gpus=0))
    assert opened == ["trillium-gpu", "trillium"] and cpu.job_dir == cluster.job_dir
    assert cluster.for_job(Resources(gpus=1)) is cluster


def test_drac_releases_live_off_scratch_with_an_explicit_python():
    for cluster in ("fir", "nibi", "rorqual", "narval", "trillium"):
        profile = load_profile(cluster)
        assert profile.paths.releases == "$HOME/tgi-hpc/releases"
        assert [m for m in profile.environment.modules if m.startswith("python/")] == ["python/3.13"]


def test_scratch_purge_differs_by_cluster():
    days = {c: load_profile(c).paths.scratch_purge_days for c in ("fir", "narval", "rorqual", "nibi", "trillium")}
    assert days == {"fir": 60, "narval": 60, "rorqual": 60, "nibi": None, "trillium": None}
    assert load_profile("mila").paths.scratch_purge_days == 90


def test_retired_clusters_point_at_their_successor_with_the_real_option(capsys):
    code, _, err = _cli(capsys, "serve", "--cluster", "beluga", "--model", MODEL, "--dry-run")
    assert code == 3 and "--cluster rorqual" in err and "-p " not in err


def test_mila_h100s_are_short_unkillable_only_and_the_partition_caps_hold(capsys):
    base = ["serve", "--cluster", "mila", "--model", MODEL, "--dry-run", "--set", "catalog=[]"]
    code, out, err = _cli(capsys, *base, "-p", "short-unkillable", "--time", "3:00:00",
                          "--set", "slurm.defaults.serve.gpu_type=h100")
    assert code == 0 and "#SBATCH --gres=gpu:h100:1" in out, err
    code, _, err = _cli(capsys, *base, "-p", "short-unkillable", "--time", "4:00:00")
    assert code == 2 and "partition short-unkillable" in err and "mila/partitions" in err
    code, _, err = _cli(capsys, *base, "-p", "main", "--set", "slurm.defaults.serve.gpu_type=h100")
    assert code == 2 and "has no h100 GPUs" in err
    code, _, err = _cli(capsys, *base, "-p", "unkillable", "--gpus", "2")
    assert code == 2 and "at most 1 GPUs" in err


def test_mila_one_gpu_sizes_are_unkillable_and_more_gpus_fall_back_to_main(capsys):
    code, out, err = _cli(capsys, "serve", "--cluster", "mila", "--model", MODEL, "--dry-run")
    assert code == 0 and "#SBATCH --partition=unkillable" in out, err
    code, out, err = _cli(capsys, "serve", "--cluster", "mila", "--model", MODEL, "--gpus", "2", "--dry-run")
    assert code == 0 and "#SBATCH --partition=main" in out and "--num-shard 2" in out, err
    code, out, err = _cli(capsys, "serve", "--cluster", "mila", "--model", "Qwen/Qwen2.5-32B-Instruct", "--dry-run")
    assert code == 0 and '#SBATCH --constraint="ampere&80gb"' in out and "a100l" not in out, err

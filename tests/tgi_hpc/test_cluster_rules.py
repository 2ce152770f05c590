"""Cluster facts and rules from the docs, checked where a user meets them: `serve`/`compile`/`download --dry-run`."""
from __future__ import annotations

import fnmatch
import json
import re
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
        def __init__(self, alias, access_rules=(), accept_host_key=False):
            opened.append(alias)
            self.accept_new_host_key = accept_host_key

        def close(self):
            pass

    monkeypatch.setattr(cluster_mod, "_ssh_runner", FakeRunner)
    cluster = cluster_mod.open_cluster("trillium", ["slurm.account=def-x"], remote=True, strict_paths=False)
    assert opened == ["trillium-gpu"]
    cpu = cluster.for_job(Resources(gpus=0))
    assert opened == ["trillium-gpu", "trillium"] and cpu.job_dir == cluster.job_dir
    assert cluster.for_job(Resources(gpus=1)) is cluster
    assert not cpu.runner.accept_new_host_key
    trusting = cluster_mod.open_cluster("trillium", ["slurm.account=def-x"], remote=True, strict_paths=False,
                                        accept_host_key=True)   # --accept-host-key reaches the CPU login too
    assert trusting.runner.accept_new_host_key and trusting.for_job(Resources(gpus=0)).runner.accept_new_host_key


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


# --- GPU types, counts and MIG: each refusal cites its page -----------------------------------------

UGS_TYPES = "https://docs.alliancecan.ca/wiki/Using_GPUs_with_Slurm#Available_GPUs"
QUICKSTART = "https://docs.alliancecan.ca/wiki/Trillium_Quickstart"


def test_paice_gpu_types_follow_the_available_gpus_table():
    types = {c: load_profile(c).slurm.gpu_types for c in ("killarney", "vulcan", "tamia")}
    assert types == {"killarney": ["l40s", "h100"], "vulcan": ["l40s"], "tamia": ["h100", "h200"]}
    for cluster in types:
        assert load_profile(cluster).rules.gpu_type.source == UGS_TYPES


@pytest.mark.parametrize("cluster", ["killarney", "vulcan", "tamia"])
def test_a_gpu_request_without_a_type_is_refused_on_the_paice_clusters(capsys, cluster):
    code, out, err = _cli(capsys, "serve", "--cluster", cluster, "--model", MODEL, "--dry-run", *_account(cluster),
                          "--set", "slurm.defaults.serve.gpu_type=null", "--set", f"clusters.{cluster}.catalog=[]",
                          "--set", "clusters.tamia.rules.whole_nodes=null")
    assert code == 2 and out == "" and UGS_TYPES in err and "--gpu-type" in err


@pytest.mark.parametrize("cluster, line", [("killarney", "#SBATCH --gpus-per-node=l40s:1"),
                                           ("vulcan", "#SBATCH --gpus-per-node=l40s:1"),
                                           ("tamia", "#SBATCH --gpus=h100:4")])
def test_paice_serve_jobs_name_their_gpu_type(capsys, cluster, line):
    code, out, err = _cli(capsys, "serve", "--cluster", cluster, "--model", MODEL, "--dry-run", *_account(cluster))
    assert code == 0 and line in out, err


@pytest.mark.parametrize("nodes, gpus", [(2, 2), (2, 4), (1, 2), (1, 3), (3, 6)])
def test_trillium_takes_one_gpu_or_whole_nodes_of_four(capsys, nodes, gpus):
    code, out, err = _cli(capsys, "serve", "--cluster", "trillium", "--model", MODEL, "--nodes", str(nodes),
                          "--gpus", str(gpus), "--dry-run", "--set", "slurm.account=def-x")
    assert code == 2 and out == "" and QUICKSTART in err and "4 GPUs per node" in err


@pytest.mark.parametrize("nodes, gpus, line", [(1, 1, "--gpus-per-node=1"), (1, 4, "--gpus-per-node=4"),
                                               (2, 8, "--gpus-per-node=4")])
def test_trillium_counts_inside_the_rule_pass(capsys, nodes, gpus, line):
    code, out, err = _cli(capsys, "serve", "--cluster", "trillium", "--model", MODEL, "--nodes", str(nodes),
                          "--gpus", str(gpus), "--dry-run", "--set", "slurm.account=def-x")
    assert code == 0 and f"#SBATCH {line}" in out, err


def test_trillium_node_types_keep_their_own_node_size(capsys):
    trillium = load_profile("trillium")
    assert trillium.rules.whole_nodes.gpus_per_node == {"h100": 4, "h200": 4, "b200": 8}
    assert trillium.slurm.gpu_types == ["h100"]          # the B200s have no documented Slurm type yet
    assert (trillium.multinode.max_nodes, trillium.multinode.source) == (5, QUICKSTART)
    assert trillium.slurm.allowed_gpu_counts == []       # one rule, with its page: rules.whole_nodes
    b200 = ["serve", "--cluster", "trillium", "--model", MODEL, "--dry-run", "--set", "slurm.account=def-x",
            "--set", "clusters.trillium.gpu_types=[h100, b200]", "--gpu-type", "b200", "--nodes", "2"]
    code, out, err = _cli(capsys, *b200, "--gpus", "16")
    assert code == 0 and "#SBATCH --gpus-per-node=b200:8" in out, err
    code, out, err = _cli(capsys, *b200, "--gpus", "8")
    assert code == 2 and "exactly 8 GPUs per node" in err and QUICKSTART in err


def test_trillium_cpu_jobs_have_a_15_minute_minimum(capsys):
    code, out, err = _cli(capsys, "compile", "--cluster", "trillium", "--job", "--dry-run",
                          "--set", "slurm.defaults.compile.time=10:00", "--set", "slurm.account=def-x")
    assert code == 2 and "CPU jobs must run at least 15 min" in err and QUICKSTART in err


def test_two_mig_instances_are_refused_on_narval(capsys):
    argv = ["serve", "--cluster", "narval", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--dry-run",
            "--set", "slurm.account=def-x", "--gpu-type", "a100_3g.20gb"]
    code, out, err = _cli(capsys, *argv, "--gpus", "2")
    assert code == 2 and out == "" and "https://docs.alliancecan.ca/wiki/Multi-Instance_GPU" in err
    code, out, err = _cli(capsys, *argv)
    assert code == 0 and "#SBATCH --gpus-per-node=a100_3g.20gb:1" in out, err


@pytest.mark.parametrize("cluster", ["fir", "nibi", "rorqual", "narval"])
def test_every_mig_type_matches_the_mig_rule_and_no_whole_gpu_does(cluster):
    profile = load_profile(cluster)
    mig = [t for t in profile.slurm.gpu_types if "g." in t]
    assert mig and all(fnmatch.fnmatchcase(t, profile.rules.mig.pattern) for t in mig)
    assert not any(fnmatch.fnmatchcase(t, profile.rules.mig.pattern) for t in profile.slurm.gpu_types if t not in mig)


# --- serve --gpu-type --------------------------------------------------------------------------------

@pytest.mark.parametrize("how", [["--gpu-type", "a100_3g.20gb"],
                                 ["--set", "slurm.defaults.serve.gpu_type=a100_3g.20gb"]])
def test_a_chosen_gpu_type_changes_the_gpu_line(capsys, how):
    code, out, err = _cli(capsys, "serve", "--cluster", "narval", "--model", "Qwen/Qwen2.5-0.5B-Instruct",
                          "--dry-run", "--set", "slurm.account=def-x", *how)
    assert code == 0, err
    assert "#SBATCH --gpus-per-node=a100_3g.20gb:1" in out and "a100:" not in out


@pytest.mark.parametrize("gpu_type", ["v100", "A100", "a100;rm -rf ~", "", "h100"])
def test_a_gpu_type_the_cluster_lacks_is_refused_before_submitting(capsys, gpu_type):
    code, out, err = _cli(capsys, "serve", "--cluster", "narval", "--model", MODEL, "--dry-run",
                          "--set", "slurm.account=def-x", "--gpu-type", gpu_type)
    assert code == 2 and out == "" and "a100, a100_1g.5gb" in err and "slurm.gpu_types" in err


@pytest.mark.parametrize("gpu_type, gpus", [("h100", 1), ("l40s", 1)])
def test_a_chosen_gpu_type_sizes_the_job_from_its_memory_8b(capsys, gpu_type, gpus):
    code, out, err = _cli(capsys, "serve", "--cluster", "killarney", "--model", MODEL, "--dry-run",
                          "--set", "slurm.account=aip-x", "--gpu-type", gpu_type)
    assert code == 0 and f"#SBATCH --gpus-per-node={gpu_type}:{gpus}" in out, err


@pytest.mark.parametrize("gpu_type, line", [("h100", "h100:4"), ("l40s", "l40s:4")])
def test_a_chosen_gpu_type_sizes_a_70b_model_from_its_memory(capsys, gpu_type, line):
    # Llama 3.1 70B: 140 GB of weights + 10 GB of KV cache = 150 GB. 80 GB x 0.85 per H100 -> 3 GPUs, rounded to
    # 4 (a tensor-parallel count: a power of two when the head count is unknown); 48 GB x 0.85 per L40S -> 4.
    code, out, err = _cli(capsys, "serve", "--cluster", "killarney", "--model", "meta-llama/Llama-3.1-70B-Instruct",
                          "--dry-run", "--set", "slurm.account=aip-x", "--gpu-type", gpu_type)
    assert code == 0 and f"#SBATCH --gpus-per-node={line}" in out and "--num-shard 4" in out, err


def test_a_chosen_gpu_type_too_small_for_one_node_is_refused_with_the_arithmetic(capsys):
    code, out, err = _cli(capsys, "serve", "--cluster", "killarney", "--model", "meta-llama/Llama-3.1-405B-Instruct",
                          "--dry-run", "--set", "slurm.account=aip-x", "--gpu-type", "l40s")
    assert code == 2 and out == "" and "more than one node's 4" in err and "--nodes" in err


def test_a_tamia_h200_job_is_sized_up_to_a_whole_node(capsys):
    code, out, err = _cli(capsys, "serve", "--cluster", "tamia", "--model", MODEL, "--dry-run",
                          "--set", "slurm.account=aip-x", "--gpu-type", "h200")
    assert code == 0 and "#SBATCH --gpus=h200:8" in out, err


# --- access rules shown when SSH fails ---------------------------------------------------------------

@pytest.mark.parametrize("cluster, words", [("tamia", "only from Canada"), ("trillium", "SSH keys and multifactor")])
def test_a_failed_ssh_connection_shows_the_clusters_access_rules(monkeypatch, cluster, words):
    from tgi_hpc.errors import SSHError
    from tgi_hpc.remote import ssh_runner
    from tgi_hpc.slurm import cluster as cluster_mod

    def refuse(alias, **kwargs):
        raise SSHError(f"Timed out connecting to {alias}.")

    monkeypatch.setattr(ssh_runner.ssh, "connect", refuse)
    opened = cluster_mod.open_cluster(cluster, ["slurm.account=def-x"], remote=True, strict_paths=False)
    with pytest.raises(SSHError) as caught:
        opened.runner.run(["true"])
    message = str(caught.value)
    assert message.startswith("Timed out connecting") and words in message
    assert load_profile(cluster).access[0].source in message


def test_a_cluster_without_access_rules_keeps_the_plain_ssh_message(monkeypatch):
    from tgi_hpc.errors import SSHError
    from tgi_hpc.remote import ssh_runner

    monkeypatch.setattr(ssh_runner.ssh, "connect", lambda alias, **kw: (_ for _ in ()).throw(SSHError("nope")))
    with pytest.raises(SSHError, match=r"^nope$"):
        ssh_runner.SSHRunner("fir").run(["true"])


@pytest.mark.parametrize("kwargs, overrides, expected", [
    ({"gpu_type": "l40s"}, [], "l40s"),
    ({}, ["slurm.defaults.serve.gpu_type=h100"], "h100"),
    ({"gpu_type": "l40s"}, ["slurm.defaults.serve.gpu_type=h100"], "l40s"),   # the explicit choice wins
    ({}, ["slurm.defaults.serve.gpu_type=null"], None),
])
def test_the_python_api_takes_a_gpu_type_like_the_command(monkeypatch, tmp_path, kwargs, overrides, expected):
    import tgi_hpc.api as api

    seen = {}

    def fake_run_serve(cluster, opts, **kw):
        seen["gpu_type"] = opts.gpu_type
        raise UsageError("stop here")

    monkeypatch.setattr(api, "run_serve", fake_run_serve)
    with pytest.raises(UsageError, match="stop here"):
        api.serve("a/b", cluster="local", overrides=[f"paths.jobs={tmp_path}", *overrides], **kwargs)
    assert seen["gpu_type"] == expected


def test_a_chosen_gpu_type_drops_the_node_features_of_another_type_on_mila(capsys):
    # Mila's 30-34B entry and multinode section ask for 80 GB A100s by features (ampere&80gb); an L40S job must not.
    base = ["serve", "--cluster", "mila", "--model", "Qwen/Qwen2.5-32B-Instruct", "--dry-run", "-p", "long"]
    code, out, err = _cli(capsys, *base, "--gpu-type", "l40s")
    assert code == 0 and "#SBATCH --gres=gpu:l40s:" in out and "--constraint" not in out, err
    code, out, err = _cli(capsys, *base, "--gpu-type", "l40s", "--nodes", "2", "--gpus", "4")
    assert code == 0 and "#SBATCH --gres=gpu:l40s:2" in out and "--constraint" not in out, err
    code, out, err = _cli(capsys, *base)
    assert code == 0 and '#SBATCH --constraint="ampere&80gb"' in out, err


def _every_gpu_type() -> list[tuple[str, str]]:
    return [(c or p, t) for p, c in _every_cluster() for t in load_profile(c or p).slurm.gpu_types]


@pytest.mark.parametrize("cluster, gpu_type", _every_gpu_type())
def test_every_listed_gpu_type_can_be_chosen_and_renders_its_line(capsys, cluster, gpu_type):
    profile = load_profile(cluster)
    assert gpu_type in profile.slurm.gpu_memory_gb          # sizing needs the type's memory
    code, out, err = _cli(capsys, "serve", "--cluster", cluster, "--model", "Qwen/Qwen2.5-0.5B-Instruct",
                          "--gpu-type", gpu_type, "--dry-run", *(["-p", "long"] if cluster == "mila" else []),
                          *_account(cluster))
    if cluster == "mila" and gpu_type == "h100":             # H100s: short-unkillable only, and it says so
        assert code == 2 and "has no h100 GPUs" in err and "mila/partitions" in err
        return
    assert code == 0, err
    assert re.search(rf"#SBATCH --(gres=gpu:|gpus=|gpus-per-node=|gpus-per-task=){re.escape(gpu_type)}:\d+\n", out)
    assert subprocess.run(["bash", "-n"], input=out, capture_output=True, text=True).returncode == 0


def test_trillium_node_limit_is_the_quickstarts(capsys):
    code, out, err = _cli(capsys, "serve", "--cluster", "trillium", "--model", MODEL, "--nodes", "6", "--gpus", "24",
                          "--dry-run", "--set", "slurm.account=def-x")
    assert code == 2 and "at most 5 nodes" in err and QUICKSTART in err
    code, out, err = _cli(capsys, "serve", "--cluster", "trillium", "--model", MODEL, "--nodes", "5", "--gpus", "20",
                          "--dry-run", "--set", "slurm.account=def-x")
    assert code == 0 and "#SBATCH --nodes=5" in out, err

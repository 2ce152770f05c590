"""`serve --nodes N`: multi-node scripts (srun, one rank per GPU, rank 0 owns the port) for every cluster that
allows them, hostile values refused before any submission, and the catalog's memory arithmetic picking nodes."""
from __future__ import annotations

import re
import subprocess

import pytest

from tgi_hpc.errors import UsageError
from tgi_hpc.models.footprint import footprint, kv_bytes_per_token
from tgi_hpc.models.size import active_params_b, param_split
from tgi_hpc.slurm.cluster import open_cluster
from tgi_hpc.slurm.render import render_job
from tgi_hpc.workflows.serve import ServeOptions, build_serve_spec

# (cluster, GPUs per node): Mila's 80 GB A100 nodes, the Alliance's H100/A100 nodes, the PAICE clusters
CLUSTERS = [("mila", 4), ("computecanada", 4), ("fir", 4), ("nibi", 4), ("rorqual", 4), ("narval", 4),
            ("trillium", 4), ("tamia", 4), ("killarney", 8), ("vulcan", 4)]


def _cluster(name):
    account = [] if name == "mila" else ["slurm.account=aip-x" if name in ("tamia", "killarney", "vulcan")
                                         else "slurm.account=def-x"]
    return open_cluster(name, account, strict_paths=False)


def _render(name, **opts):
    cluster = _cluster(name)
    spec = build_serve_spec(cluster, ServeOptions(model=opts.pop("model", "meta-llama/Llama-3.1-70B-Instruct"),
                                                  **opts))
    return spec, render_job(cluster.profile, spec, job_dir=cluster.job_dir)


def _bash_n(script):
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("nodes", [2, 4])
@pytest.mark.parametrize("name, per_node", CLUSTERS)
def test_multi_node_scripts_start_one_rank_per_gpu_with_srun(name, per_node, nodes):
    spec, script = _render(name, nodes=nodes, gpus=nodes * per_node)
    _bash_n(script)
    assert spec.nodes == nodes and spec.num_shard == per_node
    assert f"#SBATCH --nodes={nodes}" in script and f"#SBATCH --ntasks-per-node={per_node}" in script
    gpu_line = next(line for line in script.splitlines() if re.match(r"#SBATCH --(gres|gpus)", line))
    assert gpu_line.endswith(f":{nodes * per_node}" if "--gpus=" in gpu_line else f"{per_node}")
    engine = next(line for line in script.splitlines() if "python -m engine" in line)
    cpus = f"--cpus-per-task={spec.resources.cpus_per_task} " if spec.resources.cpus_per_task else ""
    assert engine.startswith(f"srun --kill-on-bad-exit=1 --distribution=block --nodes={nodes} "
                             f"--ntasks-per-node={per_node} {cpus}python -m engine ")
    rest = script[script.index(engine):]
    assert f"--num-shard {per_node}" in rest and f"--pipeline-parallel-size {nodes}" in rest
    assert '--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"' in rest
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in script
    # weights on every node before any rank starts; only the batch host (rank 0's node) publishes
    stage = script.index(f"srun --kill-on-bad-exit=1 --nodes={nodes} --ntasks-per-node=1 python -m tgi_hpc.slurm.job stage")
    assert stage < script.index(engine)
    assert script.count("write-endpoint") == 1 and script.count("--ready-file") == 2  # engine flag + helper


def test_a_one_node_job_is_unchanged(tmp_path):
    spec, script = _render("mila", gpus=2)
    assert spec.nodes == 1 and "srun" not in script and "--pipeline-parallel-size" not in script
    assert "\npython -m engine --model-id" in script


@pytest.mark.parametrize("opts, message", [
    (dict(nodes=0), "--nodes must be at least 1, not 0"),
    (dict(nodes=2, gpus=7), "--gpus 7 is the job's total and must split evenly over --nodes 2"),
    (dict(nodes=2, gpus=1), "must split evenly"),
    (dict(nodes=2, gpus=16), "8 GPUs per node is more than a node has here (4"),
    (dict(nodes=9), "a serve job spans at most 4 nodes, not 9"),
])
def test_hostile_node_counts_are_refused_before_submitting(opts, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        _render("mila", **opts)


def test_a_partition_that_cannot_take_the_gpus_refuses_a_multi_node_job():
    from tgi_hpc.profiles.rules import check_job

    spec, _ = _render("mila", nodes=2, gpus=8, partition="main")
    with pytest.raises(UsageError, match="partition main allows at most 2 GPUs per job, not 8"):
        check_job(_cluster("mila").profile, spec.resources)


def test_a_profile_without_multinode_refuses_nodes(tmp_path):
    cluster = open_cluster("local", [], strict_paths=False)
    with pytest.raises(UsageError, match="serve jobs stay on one node here"):
        build_serve_spec(cluster, ServeOptions(model="a/b", nodes=2, gpus=2))


def test_the_cli_refuses_zero_nodes(capsys):
    from tgi_hpc.cli import main

    assert main(["serve", "--cluster", "mila", "--model", "a/b", "--dry-run", "--nodes", "0"]) == 2
    assert "--nodes" in capsys.readouterr().err


def test_heads_that_do_not_split_over_a_node_are_refused(tmp_path):
    from tgi_hpc.models.footprint import Footprint
    from tgi_hpc.workflows.placement import place

    profile = _cluster("mila").profile
    fp = Footprint(1, 1, 2, 1000, "test")
    with pytest.raises(UsageError, match="9 attention heads do not split over 4 GPUs per node"):
        place(profile, fp, 1, gpus=8, nodes=2, num_heads=9)


# model cards: Mixtral-8x7B 46.7B / 12.9B active, Qwen3-30B-A3B 30.5B / 3.3B, Qwen3-235B-A22B 235B / 22B
MIXTRAL = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, vocab_size=32000,
               num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)
QWEN3_30B = dict(hidden_size=2048, num_hidden_layers=48, intermediate_size=6144, moe_intermediate_size=768,
                 vocab_size=151936, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                 num_experts_per_tok=8)
QWEN3_235B = dict(QWEN3_30B, hidden_size=4096, num_hidden_layers=94, intermediate_size=12288,
                  moe_intermediate_size=1536, num_attention_heads=64)


@pytest.mark.parametrize("config, total, active", [(MIXTRAL, 46.7, 12.9), (QWEN3_30B, 30.5, 3.3),
                                                   (QWEN3_235B, 235, 22)])
def test_moe_configs_count_every_expert_in_memory_and_the_routed_ones_per_token(config, total, active):
    # the cards round (3.35B is "3.3B", 22.19B is "22B"): 2% is their rounding, a dense count is 3x off
    assert sum(param_split(config)) == pytest.approx(total, rel=0.02)
    assert active_params_b(config) == pytest.approx(active, rel=0.02)


def test_kv_bytes_per_token_are_layers_kv_heads_head_dim_k_and_v_dtype():
    assert kv_bytes_per_token(94, 4, 128, 2) == 94 * 4 * 128 * 2 * 2
    fp = footprint("Qwen/Qwen3-235B-A22B", QWEN3_235B)
    assert fp.kv_bytes_per_token == 192_512 and fp.source == "config.json"
    assert footprint("a/b", {"hidden_size": 1}) is None   # neither a usable config nor a known model


@pytest.mark.parametrize("name, model, nodes, gpus", [
    # 470 GB + 12.6 GB KV over 68 GB usable per 80 GB GPU: 8 GPUs, 2 nodes of 4
    ("mila", "Qwen/Qwen3-235B-A22B", 2, 8),
    # 810 GB + 33.8 GB KV: 13 GPUs, 4 nodes of 4 x 80 GB
    ("mila", "meta-llama/Llama-3.1-405B-Instruct", 4, 16),
    # 40 GB A100s: 483 GB over 34 GB usable each = 15 GPUs, 4 nodes
    ("narval", "Qwen/Qwen3-235B-A22B", 4, 16),
    # 93 GB fits one catalog entry (the 70B size, 4 GPUs on one node)
    ("mila", "mistralai/Mixtral-8x7B-Instruct-v0.1", 1, 4),
    ("mila", "Qwen/Qwen3-30B-A3B", 1, 2),
])
def test_the_catalog_picks_gpus_and_nodes_from_memory(name, model, nodes, gpus):
    spec, script = _render(name, model=model)
    assert (spec.nodes, spec.resources.gpus) == (nodes, gpus)
    assert "# Sizing: " in script and "GB of GPU memory" in script


def test_a_model_too_large_for_the_cluster_says_so():
    with pytest.raises(UsageError, match=r"needs \d+ GPUs of 40 GB \(7 nodes\), more than the 4 nodes"):
        _render("narval", model="meta-llama/Llama-3.1-405B-Instruct")


@pytest.mark.parametrize("cluster", ["mila", "fir", "narval", "tamia"])
@pytest.mark.parametrize("nodes", [2, 4])
def test_serve_dry_run_nodes_through_the_cli(cluster, nodes, capsys):
    from tgi_hpc.cli import main

    account = [] if cluster == "mila" else ["--set", "slurm.account=" + ("aip-x" if cluster == "tamia" else "def-x")]
    code = main(["serve", "--cluster", cluster, *account, "--model", "Qwen/Qwen3-235B-A22B", "--dry-run",
                 "--nodes", str(nodes), "--gpus", str(4 * nodes)])
    out = capsys.readouterr().out
    assert code == 0
    _bash_n(out)
    assert f"--pipeline-parallel-size {nodes}" in out and "--num-shard 4" in out


def test_interconnect_settings_from_the_profile_reach_every_rank_quoted(hostile):
    value, marker = hostile[0]
    cluster = open_cluster("mila", ["multinode.env.NCCL_SOCKET_IFNAME=ib0", f"multinode.env.NCCL_IB_HCA={value!r}"],
                           strict_paths=False)
    spec = build_serve_spec(cluster, ServeOptions(model="meta-llama/Llama-3.1-70B-Instruct", nodes=2, gpus=8))
    script = render_job(cluster.profile, spec, job_dir=cluster.job_dir)
    _bash_n(script)
    exports = script[:script.index("srun --kill-on-bad-exit=1 --distribution=block")]
    assert "export NCCL_SOCKET_IFNAME=ib0" in exports
    line = next(x for x in exports.splitlines() if x.startswith("export NCCL_IB_HCA="))
    subprocess.run(["bash", "-c", line], check=True)   # quoted: defining it runs nothing
    assert not marker.exists()

"""A serve job over several nodes: its #SBATCH GPU and task lines, and the srun lines of its script.

One task per GPU (`--ntasks-per-node` = GPUs per node), started by one `srun` that ends the whole step
when any task exits with an error (`--kill-on-bad-exit=1`, srun(1)); `--distribution=block` puts tasks
0..G-1 on the first node, so rank 0 (HTTP, port, endpoint file) runs where the batch script runs.
Weights are staged by one task per node before any rank starts.
"""
from __future__ import annotations

from tgi_hpc.profiles.schema import Profile, Resources
from tgi_hpc.quoting import Shell, sh, sh_name

# https://slurm.schedmd.com/srun.html : -K/--kill-on-bad-exit, -m/--distribution, --gres-flags
ENGINE_SRUN = "srun --kill-on-bad-exit=1 --distribution=block"
# https://docs.mila.quebec/examples/distributed/multi_node/ : with --gpus-per-task each task sees only its
# own GPU, and NCCL between the GPUs of a node then fails unless tasks may share them.
TASK_SHARING = "--gres-flags=allow-task-sharing"


def gpus_per_node(res: Resources) -> int:
    return (res.gpus or 0) // (res.nodes or 1)


def gpu_flags(profile: Profile, res: Resources) -> dict[str, str]:
    """#SBATCH lines for `res.gpus` GPUs over `res.nodes` nodes, in the profile's GPU spelling."""
    per_node, nodes = gpus_per_node(res), res.nodes or 1
    count = lambda n: f"{res.gpu_type}:{n}" if res.gpu_type else str(n)  # noqa: E731
    spelling = profile.slurm.gpu_request if profile.slurm else "gpus_per_task"
    flags = {"nodes": str(nodes), "ntasks-per-node": str(per_node)}
    if spelling == "gres":          # per node
        flags["gres"] = f"gpu:{count(per_node)}"
    elif spelling == "gpus_per_task":
        flags["gpus-per-task"] = count(1)
    elif spelling == "gpus":        # the job's total
        flags["gpus"] = count(per_node * nodes)
    else:
        flags["gpus-per-node"] = count(per_node)
    return flags


def script_context(profile: Profile, res: Resources) -> dict[str, object]:
    """The template's multi-node values (empty for a one-node job)."""
    nodes, per_node = res.nodes or 1, gpus_per_node(res)
    if nodes <= 1:
        return {"nodes": 1, "srun_engine": "", "srun_stage": "", "rank_env": []}
    sharing = f" {TASK_SHARING}" if profile.slurm and profile.slurm.gpu_request == "gpus_per_task" else ""
    # srun of Slurm 22.05+ does not read the job's --cpus-per-task (its NEWS): each rank asks again
    cpus = f" --cpus-per-task={int(res.cpus_per_task)}" if res.cpus_per_task else ""
    env = profile.multinode.env if profile.multinode else {}
    return {
        "nodes": nodes,
        "gpus_per_node": per_node,
        "srun_engine": Shell(f"{ENGINE_SRUN} --nodes={nodes} --ntasks-per-node={per_node}{cpus}{sharing}"),
        "srun_stage": Shell(f"srun --kill-on-bad-exit=1 --nodes={nodes} --ntasks-per-node=1"),
        "rank_env": [(sh_name(k), sh(v)) for k, v in env.items()],
    }

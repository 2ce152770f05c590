"""`serve --gpu-type` on the local Slurm cluster: the GPU line rendered for a named type is one Slurm accepts
(sbatch --test-only), and a type the profile lacks is refused before anything reaches Slurm."""
from __future__ import annotations

from support.tgi_cli import TgiCli


def test_a_named_gpu_type_renders_a_request_slurm_accepts(local_cluster, model_path, tmp_path):
    tgi = TgiCli.for_cluster(local_cluster, tmp_path / "jobs")
    script = tgi("serve", "--model", str(model_path("smollm2")), "--gpu-type", "a100l", "--gpus", "2",
                 "--dry-run").stdout
    assert "#SBATCH --gpus-per-task=a100l:2" in script
    path = tmp_path / "job.sh"
    path.write_text(script)
    (tmp_path / "jobs").mkdir(exist_ok=True)
    result = local_cluster.run("sbatch", "--test-only", str(path), check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_a_gpu_type_the_profile_lacks_never_reaches_slurm(local_cluster, model_path, tmp_path):
    tgi = TgiCli.for_cluster(local_cluster, tmp_path / "jobs")
    out = tgi("serve", "--model", str(model_path("smollm2")), "--gpu-type", "h100", check=False)
    assert out.returncode == 2 and "no GPU type 'h100'" in out.stderr and "a100l" in out.stderr
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())

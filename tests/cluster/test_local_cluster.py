"""The local cluster behaves like the real ones tgi-hpc targets (Mila partitions and GPUs,
DRAC's --account rule, requeue/preemption, SLURM_TMPDIR, login + compute over ssh)."""
from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path

import paramiko
import pytest
import yaml

from tgi_hpc.profiles.schema import Profile

pytestmark = pytest.mark.timeout(90)


def wait_for_file_text(path: Path, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s: {content!r}")


def job_output(cluster, tmp_path: Path, script: str, *args: str) -> str:
    """Run `script` as a batch job to completion and return its output."""
    out = tmp_path / "job.out"
    job = cluster.sbatch("-o", str(out), *args, "--wrap", script, cwd=tmp_path)
    cluster.wait_for_state(job, "COMPLETED")
    return out.read_text()


def test_missing_cluster_is_reported(cluster_down_reason, tmp_path):
    assert "env.sh not found" in cluster_down_reason(tmp_path)


def test_job_goes_pending_running_completed(local_cluster, tmp_path):
    job = local_cluster.sbatch("--hold", "-o", str(tmp_path / "out"), "--wrap", "sleep 2; echo done",
                               cwd=tmp_path)
    assert local_cluster.state(job) == "PENDING"
    local_cluster.run("scontrol", "release", job)
    local_cluster.wait_for_state(job, "RUNNING", timeout=15)
    local_cluster.wait_for_state(job, "COMPLETED", timeout=30)
    assert (tmp_path / "out").read_text() == "done\n"
    local_cluster.wait_for_state(job, "COMPLETED", source="sacct", timeout=15)


def test_scancel_is_recorded_as_cancelled(local_cluster, tmp_path):
    job = local_cluster.sbatch("-o", "/dev/null", "--wrap", "sleep 300", cwd=tmp_path)
    local_cluster.wait_for_state(job, "RUNNING", timeout=15)
    local_cluster.cancel(job)
    local_cluster.wait_for_state(job, "CANCELLED", source="sacct", timeout=15)


def test_requeue_on_long_keeps_job_id_and_counts_restarts(local_cluster, tmp_path):
    out = tmp_path / "rq.out"
    job = local_cluster.sbatch("-p", "long", "-o", str(out), "--open-mode=append", "--wrap",
                               'echo "run id=$SLURM_JOB_ID restart=${SLURM_RESTART_COUNT:-0}"; sleep 60',
                               cwd=tmp_path)
    try:
        wait_for_file_text(out, f"run id={job} restart=0", timeout=15)
        local_cluster.run("scontrol", "requeue", job)
        # ~6 s: cred_expire=5 plus a 1 s scheduler pass (Slurm defaults: 120 s, then up to 60 s)
        wait_for_file_text(out, f"run id={job} restart=1", timeout=40)
        assert local_cluster.show_job(job)["Restarts"] == "1"
    finally:
        local_cluster.cancel(job)


def test_unkillable_job_preempts_long_job_by_requeue(local_cluster, tmp_path):
    long_job = local_cluster.sbatch("-p", "long", "-n1", f"--gpus-per-task={local_cluster.gpus}",
                                    "-o", "/dev/null", "--wrap", "sleep 120", cwd=tmp_path)
    try:
        local_cluster.wait_for_state(long_job, "RUNNING", timeout=30)
        urgent = local_cluster.sbatch("-p", "unkillable", "-n1", "--gpus-per-task=1", "-o", "/dev/null",
                                      "--wrap", "sleep 1", cwd=tmp_path)
        local_cluster.wait_for_state(urgent, {"RUNNING", "COMPLETED"}, timeout=30)
        job = local_cluster.show_job(long_job)
        assert job["Restarts"] == "1", job
        assert job["JobState"] in {"PENDING", "REQUEUED", "COMPLETING", "RUNNING"}, job
    finally:
        local_cluster.cancel(long_job)


def test_main_job_is_not_preempted(local_cluster, tmp_path):
    main_job = local_cluster.sbatch("-p", "main", "-n1", f"--gpus-per-task={local_cluster.gpus}",
                                    "-o", "/dev/null", "--wrap", "sleep 120", cwd=tmp_path)
    urgent = None
    try:
        local_cluster.wait_for_state(main_job, "RUNNING", timeout=30)
        urgent = local_cluster.sbatch("-p", "unkillable", "-n1", "--gpus-per-task=1", "-o", "/dev/null",
                                      "--wrap", "true", cwd=tmp_path)
        time.sleep(3)  # preemption of a long job takes ~1 s
        assert local_cluster.state(urgent) == "PENDING"
        job = local_cluster.show_job(main_job)
        assert (job["JobState"], job["Restarts"]) == ("RUNNING", "0"), job
    finally:
        local_cluster.cancel(main_job, *([urgent] if urgent else []))


@pytest.mark.parametrize("request_args, count", [
    (["-n1", "--gpus-per-task=2"], 2),
    (["--gres=gpu:a100l:1"], 1),
])
def test_gpu_request_sets_cuda_visible_devices(local_cluster, tmp_path, request_args, count):
    out = job_output(local_cluster, tmp_path, 'echo "$CUDA_VISIBLE_DEVICES"', *request_args)
    ids = out.strip().split(",")
    assert len(set(ids)) == count and all(i.isdigit() for i in ids), out


def test_gpu_type_and_features_match_mila(local_cluster):
    node = local_cluster.run("scontrol", "show", "node", local_cluster.node).stdout
    assert f"gpu:{local_cluster.gpu_type}:{local_cluster.gpus}" in node
    assert {"ampere", "nvlink", "80gb"} <= set(node.split("AvailableFeatures=")[1].split()[0].split(","))


def test_slurm_tmpdir_exists_in_job_and_is_removed_after(local_cluster, tmp_path):
    out = job_output(local_cluster, tmp_path, 'echo "$SLURM_TMPDIR"; touch "$SLURM_TMPDIR/x" && echo writable')
    tmpdir, status = out.split()
    assert status == "writable"
    assert Path(tmpdir).parent == local_cluster.tmpdir_root
    deadline = time.monotonic() + 10
    while Path(tmpdir).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(tmpdir).exists()


def test_accounts_default_known_and_unknown(local_cluster, tmp_path):
    if not local_cluster.enforce_accounts:
        pytest.skip("cluster started with TGI_HPC_CLUSTER_ENFORCE empty")
    rejected = local_cluster.run("sbatch", "-A", "no-such-account", "--wrap", "true", check=False, cwd=tmp_path)
    assert rejected.returncode != 0 and "Invalid account" in rejected.stderr
    default = local_cluster.sbatch("-o", "/dev/null", "--wrap", "true", cwd=tmp_path)
    chosen = local_cluster.sbatch("-A", "def-test", "-o", "/dev/null", "--wrap", "true", cwd=tmp_path)
    assert local_cluster.show_job(default)["Account"] == local_cluster.default_account
    assert local_cluster.show_job(chosen)["Account"] == "def-test"


def test_profile_resources_are_accepted_by_the_cluster(local_cluster, tmp_path):
    profile = Profile.model_validate(yaml.safe_load(local_cluster.profile.read_text()))
    resources = [*profile.slurm.defaults.values(), *(entry.resources for entry in profile.catalog)]
    for res in resources:
        args = ["--test-only", "-A", profile.slurm.account, "-p", res.partition, "-t", res.time,
                "-c", str(res.cpus_per_task), f"--mem={res.mem}"]
        if res.gpus:
            gpu = f"{res.gpu_type}:{res.gpus}" if res.gpu_type else str(res.gpus)
            args += ["-n1", f"--gpus-per-task={gpu}"]
        if res.constraint:
            args += ["-C", res.constraint]
        result = local_cluster.run("sbatch", *args, "--wrap", "true", check=False, cwd=tmp_path)
        assert result.returncode == 0, (res, result.stderr)


def test_ssh_login_node_runs_slurm_commands(local_cluster):
    result = local_cluster.ssh(local_cluster.login, "sinfo -h -o %P; sbatch --parsable -o /dev/null --wrap true")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert "main*" in lines
    local_cluster.wait_for_state(lines[-1], "COMPLETED")


def test_ssh_two_hops_to_compute_node(local_cluster):
    resolved = local_cluster.run("ssh", "-F", str(local_cluster.ssh_config), "-G", local_cluster.node).stdout
    assert f"proxyjump {local_cluster.login}" in resolved
    result = local_cluster.ssh(local_cluster.node, "echo compute-ok")
    assert (result.returncode, result.stdout) == (0, "compute-ok\n"), result.stderr


def paramiko_client(cluster, sock=None) -> paramiko.SSHClient:
    """Connect like the tunnel will: ssh_config entry, generated key, known_hosts only."""
    entry = paramiko.SSHConfig.from_path(str(cluster.ssh_config)).lookup(cluster.login)
    client = paramiko.SSHClient()
    client.load_host_keys(cluster.known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(entry["hostname"], port=int(entry["port"]), username=entry["user"],
                   key_filename=entry["identityfile"][0], look_for_keys=False, allow_agent=False,
                   sock=sock, timeout=10)
    return client


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_paramiko_two_hops_and_tunnel(local_cluster, http_server):
    login = paramiko_client(local_cluster)
    try:
        _, stdout, _ = login.exec_command("sinfo -h -o %N")
        assert stdout.read().decode().split() == [local_cluster.node]
        # second hop: a compute node's sshd reached through the login node, as ProxyJump does
        hop = login.get_transport().open_channel("direct-tcpip", ("127.0.0.1", local_cluster.ssh_port),
                                                 ("127.0.0.1", 0))
        compute = paramiko_client(local_cluster, sock=hop)
        try:
            tunnel = compute.get_transport().open_channel("direct-tcpip", ("127.0.0.1", http_server),
                                                          ("127.0.0.1", 0))
            tunnel.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert tunnel.recv(12).startswith(b"HTTP/1.0 200")
            tunnel.close()
        finally:
            compute.close()
    finally:
        login.close()

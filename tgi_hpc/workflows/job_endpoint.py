"""`tgi-hpc endpoint JOB`: a serve job's URL and API key as shell exports or JSON, for a client in another job
on the cluster (an evaluation job: lm-evaluation-harness, the openai package, ServiceClient.from_env())."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tgi_hpc.errors import JobFailedError, ReadinessTimeout, SlurmError
from tgi_hpc.quoting import sh
from tgi_hpc.slurm import jobs
from tgi_hpc.slurm.cluster import Cluster


@dataclass
class JobEndpoint:
    """What a client needs: where the job's server listens (the compute node's address) and its key."""

    job_id: str
    url: str
    model: str
    served: list[str]
    api_key_file: str
    api_key: str | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), "openai_base_url": f"{self.url}/v1"}

    def exports(self) -> str:
        lines = [f"export TGI_HPC_JOB={sh(self.job_id)}", f"export TGI_HPC_URL={sh(self.url)}",
                 f"export TGI_HPC_URLS={sh(self.url)}", f"export TGI_HPC_MODEL={sh(self.model)}",
                 f"export OPENAI_BASE_URL={sh(self.url + '/v1')}"]
        if self.api_key_file:   # read from the 0600 file by the shell: the key is not printed
            lines += [f"export TGI_HPC_API_KEY_FILE={sh(self.api_key_file)}",
                      f'export TGI_HPC_API_KEY="$(cat {sh(self.api_key_file)})"',
                      'export OPENAI_API_KEY="$TGI_HPC_API_KEY"']
        return "\n".join(lines)


def job_endpoint(cluster: Cluster, job_id: str, *, wait: bool = False, timeout: float = 600,
                 progress=lambda message: None) -> JobEndpoint:
    """The job's endpoint once it is READY (with `wait`, after waiting for it; else now or an error)."""
    if wait:
        jobs.wait(cluster, job_id, until={"READY"}, timeout=timeout, on_change=lambda s: progress(s.describe()),
                  on_beat=jobs.heartbeat(progress))
    else:
        st = jobs.status(cluster, [job_id], with_probe=True)[0]
        if st.state == "UNKNOWN":
            raise SlurmError(f"no such job: {job_id} (Slurm does not know it)")
        if st.state in jobs.FINAL:
            raise JobFailedError(f"job {job_id} has ended ({st.state}): it serves nothing")
        if st.state != "READY":
            raise ReadinessTimeout(f"job {job_id} is {st.state}, not READY yet: "
                                   f"add --wait to wait for it (`tgi-hpc endpoint {job_id} --wait`)")
    endpoint = jobs.read_endpoint(cluster, job_id)
    if endpoint is None:
        raise SlurmError(f"job {job_id} is not a serve job, or its endpoint file is gone "
                         f"({jobs.endpoint_file(cluster.job_dir, job_id)})")
    return JobEndpoint(job_id, endpoint.url, endpoint.model, endpoint.served_names, endpoint.api_key_file,
                       jobs.read_api_key(cluster, endpoint))

"""Jobs: the job spec, rendering `#SBATCH` scripts, the Slurm and local backends, the job lifecycle
(submit, watch, stop, logs), readiness probes, ports, the endpoint file, and the in-job helper
(`python -m tgi_hpc.slurm.job`).

Builds on `tgi_hpc.profiles` (what the cluster allows) and `tgi_hpc.remote` (where commands run).
"""

"""A service: N replicas of one model kept serving across Slurm job generations.

Owns the service's state file (one small JSON file per service, updated under a lock by the jobs
themselves), the handover lead time, and the choice of replica for a new connection. Pure: files and
arithmetic only, so the in-job helper, the CLI, the laptop tunnel and the cluster client all use it.
"""

"""The features the CLI calls: `serve` (model to submitted server, with its pre-submit checks), preparing
offline nodes (`download`, `compile`, here or as jobs), and tunnel sessions that follow a job.

Imports run one way: `tgi_hpc.cli` -> `tgi_hpc.workflows` -> the core packages (`profiles`, `remote`,
`models`, `release`, `slurm`); nothing below imports from here.
"""

"""A batch job's progress for `tgi-hpc status`: done/total, failed, tok/s and ETA, from the ledger its script
names, with the lines done in each open shard (its journals: they survive a requeue)."""
from __future__ import annotations

from pathlib import Path

from tgi_hpc.batch.ledger import Ledger, LedgerError
from tgi_hpc.slurm.backend import script_path
from tgi_hpc.slurm.cluster import Cluster
from tgi_hpc.slurm.jobs import JobStatus

MARK = "# Batch: "


def add_progress(cluster: Cluster, rows: list[JobStatus]) -> None:
    """Fill `detail` of the batch jobs among `rows` (only where this process sees the jobs' files)."""
    if not cluster.is_local:
        return
    for st in rows:
        if st.kind != "batch":
            continue
        try:
            script = Path(script_path(cluster.job_dir, st.job_id)).read_text()
            where = next(line[len(MARK):].strip() for line in script.splitlines() if line.startswith(MARK))
            p = Ledger(where).progress()
        except (OSError, StopIteration, LedgerError):
            continue
        st.detail = f"batch {p.describe(shards=True)}"
        st.batch = p.to_dict()

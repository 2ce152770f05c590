"""The final output: every committed shard's lines in input order, checked to be exactly one per record."""
from __future__ import annotations

import json
from pathlib import Path

from tgi_hpc.batch.durable import write_durable
from tgi_hpc.batch.inputs import Records
from tgi_hpc.batch.ledger import Ledger, LedgerError


def assemble(ledger: Ledger, output: Path) -> bool:
    """Write `output` once every shard is committed (False before). Line k answers record k: its custom_id is
    checked, so a line lost, doubled or out of place stops the assembly instead of reaching the output."""
    if not ledger.progress().complete:
        return False
    ids = Records(ledger.root).ids()
    lines: list[str] = []
    for shard in ledger.shards:
        lines += ledger.committed_lines(shard.index)
    if len(lines) != len(ids):
        raise LedgerError(f"the parts hold {len(lines)} lines for {len(ids)} records")
    for k, (line, expected) in enumerate(zip(lines, ids)):
        try:
            found = json.loads(line).get("custom_id")
        except (ValueError, AttributeError):
            found = None
        if found != expected:
            raise LedgerError(f"output line {k + 1} has custom_id {found!r}, expected {expected!r}")
    write_durable(output, "".join(f"{line}\n" for line in lines).encode())
    return True

"""The units scripts/test.sh's two workers share out (tests/conftest.py's scheduler): each runs whole on one worker."""
from __future__ import annotations


def cluster_or_file(nodeid: str) -> str:
    """tests/cluster as a whole (its tests submit jobs to the one local cluster: one at a time), else the test's
    file (its module fixtures are built once)."""
    path = nodeid.split("::", 1)[0]
    return "tests/cluster" if path.startswith("tests/cluster/") else path

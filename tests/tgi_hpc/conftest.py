"""Fixtures shared by the SSH and tunnel tests."""
from __future__ import annotations

import pytest

from support.sshd import sshd_available, start_sshd


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A throwaway real OpenSSH server on 127.0.0.1 (skipped where sshd or root is missing)."""
    if reason := sshd_available():
        pytest.skip(reason)
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()

"""Fixtures shared by the toolkit tests: the CLI run in-process, and a real sshd for the SSH and tunnel tests."""
from __future__ import annotations

import pytest

from support.sshd import sshd_available, start_sshd
from tgi_hpc.cli import main


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A throwaway real OpenSSH server on 127.0.0.1 (skipped where sshd or root is missing)."""
    if reason := sshd_available():
        pytest.skip(reason)
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def run(capsys):
    """The `tgi-hpc` command in-process: run(*args) -> (exit code, stdout, stderr)."""
    def invoke(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return invoke

"""The first SSH login from a laptop, through the real CLI: an unknown host key (`--accept-host-key` on any
command, `serve --tunnel` included) and a 2FA prompt nobody can answer (a background tunnel)."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from support.sshd import TwoFactorServer, _keygen
from tgi_hpc.errors import SSHError
from tgi_hpc.remote import ssh

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


def _remote(alias: str, jobs: str) -> list[str]:
    # `$HOME` in the jobs path makes the CLI expand it on the login host: a real SSH command
    return ["--cluster", "local", "--remote", "--set", f"login_host={alias}", "--set", f"paths.jobs={jobs}"]


def test_every_command_takes_accept_host_key(run, home, sshd, tmp_path, monkeypatch):
    (home / ".ssh" / "config").write_text(f"Host login\n  HostName 127.0.0.1\n  Port {sshd.port}\n"
                                          f"  User {sshd.user}\n  IdentityFile {sshd.client_key}\n")
    known = home / ".ssh" / "known_hosts"
    code, out, err = run("status", *_remote("login", "$HOME/no such; jobs"))
    assert code == 11 and out == "" and not known.exists()
    assert "Unknown host key for login" in err and "SHA256:" in err
    assert "`ssh login`" in err and "--accept-host-key" in err
    code, _, err = run("status", *_remote("login", "$HOME/no such; jobs"), "--accept-host-key")
    assert code == 0, err
    assert known.read_text() == sshd.known_hosts_line()
    known.unlink()
    monkeypatch.setenv("TGI_HPC_ACCEPT_HOST_KEY", "1")        # the env twin, and before the command
    code, _, err = run("--accept-host-key", "status", *_remote("login", "$HOME/x"))
    assert code == 0, err
    assert known.read_text() == sshd.known_hosts_line()


def test_serve_and_tunnel_show_the_flag_in_help(run):
    for command in (["serve"], ["tunnel", "open"], ["status"]):
        code, out, _ = run(*command, "--help")
        assert code == 0 and "--accept-host-key" in out and "TGI_HPC_ACCEPT_HOST_KEY" in out


@pytest.fixture
def duo(home, tmp_path):
    _keygen(tmp_path / "key")
    server = TwoFactorServer(tmp_path / "key", code="123456")
    (home / ".ssh" / "config").write_text(f"Host drac\n  HostName 127.0.0.1\n  Port {server.port}\n"
                                          f"  User someone\n  IdentityFile {tmp_path}/key\n")
    (home / ".ssh" / "known_hosts").write_text(server.known_hosts_line())
    yield server
    server.close()


def test_a_second_factor_without_a_terminal_says_the_true_ways(duo, monkeypatch):
    monkeypatch.setattr(ssh, "has_terminal", lambda: False)
    with pytest.raises(SSHError) as err:
        ssh.connect("drac")
    message = str(err.value)
    assert "drac asks for a second factor (2FA)" in message and "cannot reuse an OpenSSH ControlMaster" in message
    assert "`ssh -N -L 8080:NODE:PORT drac`" in message and "tmux" in message
    monkeypatch.setattr(ssh, "has_terminal", lambda: True)
    monkeypatch.setattr("sys.stdin", io.StringIO("123456\n"))   # someone types the code
    with ssh.connect("drac") as client:
        assert client.get_transport().is_authenticated()


def test_background_tunnel_refuses_where_the_login_asked_for_2fa(run, duo, monkeypatch):
    monkeypatch.setattr(ssh, "has_terminal", lambda: True)
    monkeypatch.setattr("sys.stdin", io.StringIO("123456\n"))
    code, out, err = run("tunnel", "open", "4148", "--background", *_remote("drac", "$HOME/jobs"))
    assert code == 2 and out == ""
    assert "--background: drac asks for a second factor" in err and "ssh -N -L" in err

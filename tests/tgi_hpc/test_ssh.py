"""tgi_hpc.remote.ssh against a real throwaway sshd on 127.0.0.1 (and a paramiko server for 2FA)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.sshd import TwoFactorServer, free_port, start_sshd
from tgi_hpc.errors import SSHError
from tgi_hpc.remote.ssh import connect, resolve_target

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh $HOME, so ~/.ssh/known_hosts and the agent are the test's own."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    (tmp_path / ".ssh").mkdir()
    return tmp_path


def write_config(home: Path, sshd, extra: str = "") -> Path:
    path = home / ".ssh" / "config"
    path.write_text(
        f"Host login\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  IdentityFile {sshd.client_key}\n\n"
        f"Host node\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  IdentityFile {sshd.client_key}\n  ProxyJump login\n\n{extra}")
    return path


def trust(home: Path, sshd) -> None:
    (home / ".ssh" / "known_hosts").write_text(sshd.known_hosts_line())


def run(client, command: str) -> str:
    _, stdout, _ = client.exec_command(command, timeout=10)
    return stdout.read().decode()


def test_resolve_target_reads_aliases_and_proxyjump_chain(tmp_path):
    config = tmp_path / "config"
    config.write_text(
        "Host mila\n  HostName login.server.mila.quebec\n  Port 2222\n  User alice\n"
        "  IdentityFile ~/.ssh/id_mila\n  ServerAliveInterval 120\n"
        "  UserKnownHostsFile ~/.ssh/kh_a ~/.ssh/kh_b\n\n"
        "Host cn-*\n  ProxyJump mila\n  User alice\n\n"
        "Host deep\n  HostName 10.0.0.5\n  ProxyJump bob@gate:2200,mila\n\n"
        "Host narval\n  HostName %h.alliancecan.ca\n\n"
        "Host *\n  User fallback\n")
    mila = resolve_target("mila", config)
    assert (mila.hostname, mila.port, mila.user) == ("login.server.mila.quebec", 2222, "alice")
    assert mila.identity_files == [str(Path("~/.ssh/id_mila").expanduser())]
    assert mila.server_alive_interval == 120
    assert mila.user_known_hosts_file == [str(Path(f"~/.ssh/kh_{x}").expanduser()) for x in "ab"]
    assert mila.proxy_jump == []
    node = resolve_target("cn-g017", config)
    assert (node.hostname, node.port, node.user, node.proxy_jump) == ("cn-g017", 22, "alice", ["mila"])
    assert resolve_target("deep", config).proxy_jump == ["bob@gate:2200", "mila"]
    assert resolve_target("narval", config).hostname == "narval.alliancecan.ca"
    hop = resolve_target("bob@mila:2201", config)  # the ProxyJump spelling of a hop
    assert (hop.user, hop.hostname, hop.port) == ("bob", "login.server.mila.quebec", 2201)
    assert resolve_target("elsewhere", config).user == "fallback"


def test_connect_with_key_runs_a_command(home, sshd):
    write_config(home, sshd)
    trust(home, sshd)
    with connect("login") as client:
        assert run(client, "echo hello") == "hello\n"


def test_unknown_host_key_is_refused_with_how_to(home, sshd):
    write_config(home, sshd)
    with pytest.raises(SSHError) as err:
        connect("login")
    message = str(err.value)
    assert "Unknown host key" in message and "SHA256:" in message
    assert "`ssh login`" in message and "--accept-host-key" in message
    assert not (home / ".ssh" / "known_hosts").exists()


def test_accept_new_host_key_writes_known_hosts(home, sshd):
    write_config(home, sshd)
    with connect("login", accept_new_host_key=True) as client:
        assert run(client, "echo once") == "once\n"
    known = (home / ".ssh" / "known_hosts").read_text()
    assert known == sshd.known_hosts_line()
    with connect("login") as client:  # now trusted without the flag
        assert run(client, "echo twice") == "twice\n"


def test_user_known_hosts_file_is_where_new_keys_go(home, sshd):
    custom = home / "cluster_known_hosts"
    write_config(home, sshd).write_text(
        f"Host login\n  HostName 127.0.0.1\n  Port {sshd.port}\n  IdentityFile {sshd.client_key}\n"
        f"  UserKnownHostsFile {custom}\n")
    connect("login", accept_new_host_key=True).close()
    assert custom.read_text() == sshd.known_hosts_line()
    connect("login").close()


def test_changed_host_key_is_refused_even_with_accept_new(home, sshd, tmp_path):
    write_config(home, sshd)
    other = start_sshd(tmp_path / "other")  # a different host key on another port...
    try:
        line = other.known_hosts_line().replace(str(other.port), str(sshd.port))  # ...claimed for ours
        (home / ".ssh" / "known_hosts").write_text(line)
        with pytest.raises(SSHError, match="does NOT match known_hosts"):
            connect("login", accept_new_host_key=True)
    finally:
        other.stop()


def test_proxyjump_goes_through_the_jump_host(home, sshd):
    write_config(home, sshd, extra=f"Host chain\n  HostName 127.0.0.1\n  Port {sshd.port}\n"
                                   f"  IdentityFile {sshd.client_key}\n  ProxyJump login,node\n")
    trust(home, sshd)
    before = set(sshd.connection_pids())  # earlier tests' connections may still be exiting
    with connect("node") as client:
        assert run(client, "echo via-jump") == "via-jump\n"
        assert len(set(sshd.connection_pids()) - before) == 2  # login + node
    with connect("chain") as client:  # login -> node -> chain
        assert run(client, "echo three") == "three\n"
        assert len(set(sshd.connection_pids()) - before) >= 3


@pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client not installed")
def test_proxycommand_is_used_when_there_is_no_proxyjump(home, sshd):
    ssh_opts = f"-F {home}/.ssh/config -o BatchMode=yes -o UserKnownHostsFile={home}/.ssh/known_hosts"
    write_config(home, sshd, extra=f"Host viacmd\n  HostName 127.0.0.1\n  Port {sshd.port}\n"
                                   f"  IdentityFile {sshd.client_key}\n  ProxyCommand ssh {ssh_opts} -W %h:%p login\n")
    trust(home, sshd)
    assert resolve_target("viacmd").proxy_command.endswith(f"-W 127.0.0.1:{sshd.port} login")
    before = set(sshd.connection_pids())
    with connect("viacmd") as client:
        assert run(client, "echo piped") == "piped\n"
        assert len(set(sshd.connection_pids()) - before) == 2  # the `ssh -W` hop + ours


def test_proxyjump_loop_is_reported(home, sshd):
    (home / ".ssh" / "config").write_text("Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n")
    with pytest.raises(SSHError, match="loop"):
        connect("a")


def test_wrong_key_is_an_authentication_error(home, sshd, tmp_path):
    from support.sshd import _keygen

    _keygen(tmp_path / "stranger")
    (home / ".ssh" / "config").write_text(
        f"Host login\n  HostName 127.0.0.1\n  Port {sshd.port}\n  IdentityFile {tmp_path}/stranger\n")
    trust(home, sshd)
    with pytest.raises(SSHError, match=r"Authentication to login .* failed"):
        connect("login")


def test_unreachable_host_is_an_ssh_error(home):
    (home / ".ssh" / "config").write_text(f"Host gone\n  HostName 127.0.0.1\n  Port {free_port()}\n")
    with pytest.raises(SSHError, match="Cannot connect to gone"):
        connect("gone", timeout=3)


def test_second_factor_goes_to_the_interactive_callback(home, tmp_path):
    from support.sshd import _keygen

    _keygen(tmp_path / "key")
    server = TwoFactorServer(tmp_path / "key", code="123456")
    try:
        (home / ".ssh" / "config").write_text(
            f"Host drac\n  HostName 127.0.0.1\n  Port {server.port}\n  User someone\n"
            f"  IdentityFile {tmp_path}/key\n")
        (home / ".ssh" / "known_hosts").write_text(server.known_hosts_line())
        asked = []

        def answer(title, instructions, prompts):
            asked.append((title, prompts))
            return ["123456" for _ in prompts]

        with connect("drac", interactive=answer) as client:
            assert run(client, "anything") == "ok\n"
        assert asked == [("Duo two-factor login", [("Passcode or option (1-1): ", True)])]
        with pytest.raises(SSHError, match="Authentication to drac"):
            connect("drac", interactive=lambda *_: ["000000"])
    finally:
        server.close()


# --- SSHRunner: remote mode over one connection ---

@pytest.fixture
def runner(home, sshd):
    from tgi_hpc.remote.ssh_runner import SSHRunner

    write_config(home, sshd)
    trust(home, sshd)
    with SSHRunner("login") as r:
        yield r


def test_runner_runs_argv_without_shell_interpretation(runner, sshd):
    weird = "it's a $HOME; `x` \"q\"\nnewline"
    done = runner.run(["printf", "%s|", weird, "b c"])
    connections = set(sshd.connection_pids())
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{weird}|b c|", "")
    assert done.args == ["printf", "%s|", weird, "b c"]
    failed = runner.run(["sh", "-c", "echo oops >&2; exit 3"])
    assert (failed.returncode, failed.stderr) == (3, "oops\n")
    assert runner.run(["cat"], input="to stdin\n").stdout == "to stdin\n"
    assert set(sshd.connection_pids()) <= connections  # all of it over the first connection


def test_runner_timeout_and_missing_command_are_slurm_errors(runner):
    from tgi_hpc.errors import SlurmError

    with pytest.raises(SlurmError, match="did not answer within 0 s on login"):
        runner.run(["sleep", "5"], timeout=0.5)
    assert runner.run(["echo", "still usable"]).stdout == "still usable\n"
    with pytest.raises(SlurmError, match="`sbatch-not-here` is not installed on login"):
        runner.run(["sbatch-not-here", "--parsable"], env={"A": "1"})


def test_runner_env_never_appears_in_a_command_line(home, tmp_path):
    from tgi_hpc.remote.ssh_runner import SSHRunner

    server = start_sshd(tmp_path / "recording", record_commands=True)
    try:
        write_config(home, server)
        trust(home, server)
        secret = "hf_s3cr3t 'quoted' \"x\" $(touch /tmp/pwned)\nline2"
        script = 'printf "%s" "$HF_TOKEN"; echo; echo "$OTHER"; cat; ps -eo args'
        with SSHRunner("login") as r:
            done = r.run(["sh", "-c", script], env={"HF_TOKEN": secret, "OTHER": "2"}, input="in\n")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(secret + "\n2\nin\n")  # the value arrived intact, stdin too
        processes = done.stdout[len(secret):]  # `ps -eo args` while the command ran
        commands = server.commands()
        assert len(commands) == 1 and "ps -eo args" in commands[0]  # what sshd got, verbatim
        for seen in (commands[0], processes):  # nor in any process's argv while it ran
            assert "s3cr3t" not in seen
    finally:
        server.stop()


def test_runner_writes_and_reads_files_over_sftp(runner, tmp_path):
    import stat

    path = tmp_path / "deep" / "er" / "job.sbatch"
    runner.write_file(str(path), "#!/bin/bash\necho hi\n")
    assert path.read_text() == "#!/bin/bash\necho hi\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    runner.write_file(str(path), "replaced", mode=0o640)
    assert runner.read_file(str(path)) == "replaced"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in path.parent.iterdir()) == ["job.sbatch"]  # no temp leftovers
    with pytest.raises(FileNotFoundError):
        runner.read_file(str(tmp_path / "endpoint.json"))


def test_runner_reconnects_after_the_connection_drops(runner, sshd):
    assert runner.run(["true"]).returncode == 0
    assert sshd.drop_connections() >= 1
    import time

    time.sleep(0.3)  # let paramiko notice the dead socket
    assert runner.run(["echo", "back"]).stdout == "back\n"

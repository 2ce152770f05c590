"""A throwaway OpenSSH server on a free 127.0.0.1 port, for tests of the SSH layer.

Everything lives in one tmp dir (host key, client key, authorized_keys, config, log),
so nothing in ~/.ssh or /etc/ssh is read or changed. sshd must run as root, and
/run/sshd must exist (privilege separation), as found in the local-slurm report.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def sshd_available() -> str | None:
    """None when a test sshd can start here, else why not (for pytest.skip)."""
    if not Path(SSHD).exists():
        return f"{SSHD} not installed (apt-get install openssh-server)"
    if os.geteuid() != 0:
        return "sshd must be started as root"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not installed"
    return None


@dataclass
class SSHServer:
    """A running test sshd; `user` logs in with `client_key`."""

    port: int
    dir: Path
    user: str
    client_key: Path
    host_key_line: str  # "ssh-ed25519 AAAA..." (the .pub without comment)
    process: subprocess.Popen

    @property
    def log(self) -> str:
        return (self.dir / "sshd.log").read_text(errors="replace")

    def commands(self) -> list[str]:
        """Command lines received so far (only with start_sshd(record_commands=True))."""
        path = self.dir / "commands"
        return path.read_text().split("\0")[:-1] if path.exists() else []

    def known_hosts_line(self, host: str = "127.0.0.1") -> str:
        return f"[{host}]:{self.port} {self.host_key_line}\n"

    def connection_pids(self) -> list[int]:
        """The per-connection sshd children (killing them drops those connections)."""
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.process.pid and fields[0] != "Z":
                children.append(int(stat.parent.name))
        return children

    def drop_connections(self) -> int:
        """SIGKILL every live connection, like a network cut; returns how many."""
        pids = self.connection_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def stop(self) -> None:
        self.drop_connections()
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)],
                   check=True, timeout=30)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


def start_sshd(tmp: Path, *, extra_config: str = "", log_level: str = "VERBOSE",
               record_commands: bool = False) -> SSHServer:
    """Start sshd in `tmp` (publickey only: password and keyboard-interactive disabled).

    `extra_config` lines take precedence over those defaults.

    `record_commands`: every exec'd command line, exactly as sshd received it, is appended
    to `tmp/commands` (NUL-separated; see SSHServer.commands). SFTP does not work then.
    """
    if record_commands:
        extra_config += (f"\nForceCommand printf '%s\\0' \"$SSH_ORIGINAL_COMMAND\" >> {tmp}/commands;"
                         ' eval "$SSH_ORIGINAL_COMMAND"\n')
    tmp.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    host_key_line = _keygen(tmp / "host_ed25519")
    client_pub = _keygen(tmp / "id_ed25519")
    (tmp / "authorized_keys").write_text(client_pub + "\n")
    port = free_port()
    (tmp / "sshd_config").write_text(  # sshd keeps the first value of a keyword: extras go first
        f"{extra_config}\nPort {port}\nListenAddress 127.0.0.1\nHostKey {tmp}/host_ed25519\n"
        f"PidFile {tmp}/sshd.pid\nAuthorizedKeysFile {tmp}/authorized_keys\n"
        "StrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nAllowTcpForwarding yes\nMaxStartups 50\n"
        f"Subsystem sftp internal-sftp\nLogLevel {log_level}\n")
    proc = subprocess.Popen([SSHD, "-D", "-f", str(tmp / "sshd_config"), "-E", str(tmp / "sshd.log")],
                            preexec_fn=_die_with_parent)
    server = SSHServer(port, tmp, _user(), tmp / "id_ed25519", host_key_line, proc)
    _wait_listening(server)
    return server


def _die_with_parent() -> None:
    """Even if the test process is SIGKILLed, its sshd does not outlive it (Linux prctl;
    it fires when the starting *thread* ends, so start sshd from the main thread)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name  # $USER is unset on this sandbox


def _wait_listening(server: SSHServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"sshd exited with {server.process.returncode}:\n{server.log}")
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=0.5) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"sshd did not listen on 127.0.0.1:{server.port} within {timeout}s:\n{server.log}")


class TwoFactorServer:
    """An in-process paramiko server that wants publickey AND a keyboard-interactive code,
    the way DRAC's Duo does (OpenSSH needs PAM for that, which a test cannot configure).
    Each accepted connection answers one `exec` with "ok"."""

    def __init__(self, client_key: Path, code: str, prompt: str = "Passcode or option (1-1): "):
        import paramiko  # tests/support must import without paramiko for unrelated tests

        self.paramiko = paramiko
        self.allowed_key = paramiko.PKey.from_path(str(client_key))
        self.host_key = paramiko.Ed25519Key.from_private_key_file(str(client_key))  # any key works
        self.code, self.prompt = code, prompt
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.transports: list = []
        threading.Thread(target=self._serve, daemon=True).start()

    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {self.host_key.get_name()} {self.host_key.get_base64()}\n"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = self.paramiko.Transport(conn)
            t.add_server_key(self.host_key)
            self.transports.append(t)
            t.start_server(server=_TwoFactorInterface(self))
            threading.Thread(target=self._answer, args=(t,), daemon=True).start()

    def _answer(self, t) -> None:
        chan = t.accept(20)
        if chan is None:
            return
        deadline = time.monotonic() + 10
        while not getattr(chan, "exec_seen", False) and time.monotonic() < deadline:
            time.sleep(0.01)
        chan.sendall(b"ok\n")
        chan.send_exit_status(0)
        chan.close()

    def close(self) -> None:
        self.sock.close()
        for t in self.transports:
            t.close()


def _TwoFactorInterface(server: TwoFactorServer):
    paramiko = server.paramiko

    class Interface(paramiko.ServerInterface):
        key_ok = False

        def get_allowed_auths(self, username):
            return "keyboard-interactive" if self.key_ok else "publickey"

        def check_auth_publickey(self, username, key):
            if key == server.allowed_key:
                self.key_ok = True
                return paramiko.AUTH_PARTIALLY_SUCCESSFUL
            return paramiko.AUTH_FAILED

        def check_auth_interactive(self, username, submethods):
            if not self.key_ok:
                return paramiko.AUTH_FAILED
            return paramiko.InteractiveQuery("Duo two-factor login", "", (server.prompt, True))

        def check_auth_interactive_response(self, responses):
            return paramiko.AUTH_SUCCESSFUL if list(responses) == [server.code] else paramiko.AUTH_FAILED

        def check_channel_request(self, kind, chanid):
            ok = kind == "session"
            return paramiko.OPEN_SUCCEEDED if ok else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

        def check_channel_exec_request(self, channel, command):
            channel.exec_seen = True
            return True

    return Interface()

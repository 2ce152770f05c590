"""SSHRunner: run Slurm commands and move small files on the login node over one SSH connection."""
from __future__ import annotations

import base64
import contextlib
import logging
import posixpath
import select
import shlex
import subprocess
import time
import uuid
from pathlib import Path

import paramiko

from tgi_hpc.errors import SlurmError, SSHError
from tgi_hpc.remote import ssh

logger = logging.getLogger(__name__)

# Environment values (tokens) must not reach any command line, where `ps` on the login
# node would show them. The wrapper reads one base64 line of `export` statements from
# stdin with shell builtins only, then execs argv with the rest of stdin.
_ENV_WRAPPER = 'IFS= read -r e; eval "$(printf %s "$e" | base64 -d)"; exec "$@"'


class SSHRunner:
    """Same interface as LocalRunner, but on `alias` (a ~/.ssh/config host).

    Connects on first use and keeps that one connection (one 2FA prompt per command).
    """

    def __init__(self, alias: str, *, config_path: Path | None = None, accept_new_host_key: bool = False,
                 interactive: ssh.Interactive | None = None, client: paramiko.SSHClient | None = None,
                 access_rules: tuple[str, ...] = ()):
        self.alias, self.accept_new_host_key = alias, accept_new_host_key
        self.access_rules = access_rules   # the cluster's login rules, added to a failed connection's message
        self.prompted = False              # a 2FA code or key passphrase was asked: a detached process cannot
        answer = interactive or ssh.prompt_terminal

        def asked(*args):
            self.prompted = True
            return answer(*args)

        asked.needs_terminal = getattr(answer, "needs_terminal", False)  # type: ignore[attr-defined]

        self._connect_args = dict(config_path=config_path, accept_new_host_key=accept_new_host_key,
                                  interactive=asked)
        self._client = client
        self._sftp: paramiko.SFTPClient | None = None

    def run(self, argv: list[str], *, input: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run argv remotely (no shell interpretation of its items); never raises on exit codes."""
        command, stdin = shlex.join(argv), (input or "").encode()
        if env:
            command = f"sh -c {shlex.quote(_ENV_WRAPPER)} sh {command}"
            stdin = _export_line(env) + stdin
        chan = self._start(command)
        try:
            chan.sendall(stdin)
            chan.shutdown_write()
            out, err = _collect(chan, argv, timeout)
            status = chan.recv_exit_status()
        except subprocess.TimeoutExpired as e:  # the same error LocalRunner gives
            raise SlurmError(f"`{' '.join(argv[:2])}` did not answer within {timeout:.0f} s on {self.alias}") from e
        finally:
            chan.close()
        logger.debug("%s: %s -> %d", self.alias, command, status)
        if status == 127 and b"not found" in err:
            raise SlurmError(f"`{argv[0]}` is not installed on {self.alias}: is it a Slurm login node? "
                             f"(remote said: {err.decode(errors='replace').strip()})")
        return subprocess.CompletedProcess(argv, status, out.decode(errors="replace"), err.decode(errors="replace"))

    def write_file(self, path: str, text: str, mode: int = 0o600) -> None:
        """Write `path` atomically, never readable by others, even while being written."""
        sftp, path = self._sftp_client(), _sftp_path(path)
        parent = posixpath.dirname(path) or "."
        _makedirs(sftp, parent)
        # a private dir keeps the half-written file unreachable; rename makes it appear whole
        private = posixpath.join(parent, f".tgi-hpc-{uuid.uuid4().hex[:12]}")
        sftp.mkdir(private, mode=0o700)
        tmp = posixpath.join(private, "f")
        try:
            with sftp.open(tmp, "w") as f:
                f.chmod(mode)
                f.write(text.encode())
            sftp.posix_rename(tmp, path)
        finally:
            _remove_quietly(sftp, tmp)
            sftp.rmdir(private)

    def read_file(self, path: str) -> str:
        """Text of a remote file; FileNotFoundError when it does not exist (yet)."""
        with self._sftp_client().open(_sftp_path(path), "r") as f:
            return f.read().decode(errors="replace")

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
        if self._client is not None:
            self._client.close()
        self._sftp = self._client = None

    def __enter__(self) -> SSHRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, command: str) -> paramiko.Channel:
        """A channel running `command`; a dead connection is replaced once (nothing has run yet)."""
        try:
            return self._exec(command)
        except (paramiko.SSHException, EOFError, OSError):
            self.close()
        try:
            return self._exec(command)
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise SSHError(f"Cannot start a command over SSH on {self.alias}: {e}. Check `ssh {self.alias}`.") from e

    def _exec(self, command: str) -> paramiko.Channel:
        chan = self.transport().open_session(timeout=30)
        chan.exec_command(command)
        return chan

    def transport(self) -> paramiko.Transport:
        """The live SSH connection, reconnecting if it dropped (a Tunnel can share it)."""
        transport = self._client.get_transport() if self._client is not None else None
        if transport is None or not transport.is_active():
            if self._client is not None:
                logger.warning("SSH connection to %s was lost; reconnecting", self.alias)
                self.close()
            try:
                self._client = ssh.connect(self.alias, **self._connect_args)
            except SSHError as e:
                if not self.access_rules:
                    raise
                rules = "".join(f"\n  - {rule}" for rule in self.access_rules)
                raise type(e)(f"{e}\nThis cluster's access rules:{rules}") from e
            transport = self._client.get_transport()
        return transport

    def _sftp_client(self) -> paramiko.SFTPClient:
        transport = self.transport()
        if self._sftp is None or self._sftp.get_channel().get_transport() is not transport:
            self._sftp = paramiko.SFTPClient.from_transport(transport)
        return self._sftp


def _export_line(env: dict[str, str]) -> bytes:
    exports = "".join(f"export {_env_name(k)}={shlex.quote(v)}\n" for k, v in env.items())
    return base64.b64encode(exports.encode()) + b"\n"


def _env_name(name: str) -> str:
    if not name.isidentifier() or not name.isascii():
        raise SSHError(f"Invalid environment variable name {name!r}: use letters, digits and '_'.")
    return name


def _collect(chan: paramiko.Channel, argv: list[str], timeout: float) -> tuple[bytes, bytes]:
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    while True:
        while chan.recv_ready():
            out += chan.recv(65536)
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
        # the exit status follows all of the output on the wire, so nothing is left to read
        if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
            return bytes(out), bytes(err)
        if chan.closed or not chan.get_transport().is_active():
            raise SSHError(f"The SSH connection dropped while running {shlex.join(argv)!r}; "
                           "it may or may not have run. Check with `squeue --me` before retrying.")
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(argv, timeout, bytes(out), bytes(err))
        select.select([chan], [], [], 0.1)


def _sftp_path(path: str) -> str:
    # SFTP resolves relative paths from the home directory; it does not expand "~"
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


def _makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        sftp.stat(path)
    except FileNotFoundError:
        _makedirs(sftp, posixpath.dirname(path.rstrip("/")) or ".")
        sftp.mkdir(path, mode=0o700)


def _remove_quietly(sftp: paramiko.SFTPClient, path: str) -> None:
    with contextlib.suppress(OSError):  # already renamed into place
        sftp.remove(path)

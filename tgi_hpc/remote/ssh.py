"""SSH connections from ~/.ssh/config: aliases, ProxyJump chains, known_hosts, 2FA, keepalive."""
from __future__ import annotations

import getpass
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import paramiko
from paramiko.auth_strategy import AuthStrategy

from tgi_hpc.errors import SSHError

logger = logging.getLogger(__name__)

# (title, instructions, [(prompt, echo), ...]) -> answers: paramiko's keyboard-interactive handler.
Interactive = Callable[[str, str, list[tuple[str, bool]]], list[str]]

DEFAULT_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
DEFAULT_KEYS = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")
DEFAULT_KEEPALIVE = 30
MAX_HOPS = 8  # a ProxyJump cycle in ~/.ssh/config would otherwise recurse forever


class HostKeyError(SSHError):
    """The host key is unknown or changed: retrying cannot help, the user must decide."""


class SSHAuthError(SSHError):
    """No credential was accepted: retrying cannot help."""


@dataclass
class SSHTarget:
    """Where one hop goes, after ~/.ssh/config has been applied."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: list[str]
    proxy_jump: list[str]
    server_alive_interval: int | None
    user_known_hosts_file: list[str]
    proxy_command: str | None = None  # used only without ProxyJump, as OpenSSH does

    @property
    def known_hosts_name(self) -> str:
        """The name OpenSSH writes in known_hosts for this host."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def resolve_target(alias: str, config_path: Path | None = None) -> SSHTarget:
    """Apply ~/.ssh/config to `alias` (also `user@host:port`, the ProxyJump form)."""
    user, host, port = _split_spec(alias)
    options = _load_config(config_path).lookup(host)
    jumps = options.get("proxyjump", "none")
    command = options.get("proxycommand", "none")
    alive = options.get("serveraliveinterval")
    return SSHTarget(
        alias=alias,
        hostname=options["hostname"],
        port=port or int(options.get("port", 22)),
        user=user or options.get("user") or getpass.getuser(),
        identity_files=[str(Path(p).expanduser()) for p in options.get("identityfile", [])],
        proxy_jump=[] if jumps.lower() == "none" else [j.strip() for j in jumps.split(",") if j.strip()],
        server_alive_interval=int(alive) if alive else None,
        user_known_hosts_file=[str(Path(p).expanduser()) for p in options.get("userknownhostsfile", "").split()],
        proxy_command=None if command.lower() == "none" else command,
    )


def _split_spec(spec: str) -> tuple[str | None, str, int | None]:
    user, _, hostport = spec.rpartition("@")
    host, port = hostport, None
    if hostport.startswith("["):  # [ipv6]:port
        host, _, rest = hostport[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else None
    elif hostport.count(":") == 1:
        host, _, p = hostport.partition(":")
        port = int(p)
    return user or None, host, port


def _load_config(config_path: Path | None) -> paramiko.SSHConfig:
    path = Path(config_path or DEFAULT_CONFIG).expanduser()
    if not path.exists():
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except Exception as e:  # paramiko raises several types for a malformed file
        raise SSHError(f"Cannot parse SSH config {path}: {e}. Fix the file (check it with `ssh -G HOST`).") from e


def connect(
    alias: str,
    *,
    config_path: Path | None = None,
    accept_new_host_key: bool = False,
    interactive: Interactive | None = None,
    timeout: float = 15.0,
) -> paramiko.SSHClient:
    """Open an authenticated SSH connection to `alias`, through its ProxyJump hops.

    Host keys must already be in known_hosts unless `accept_new_host_key`; a 2FA
    prompt (keyboard-interactive) goes to `interactive`, by default the terminal.
    """
    target = resolve_target(alias, config_path)
    return _connect(target, config_path, accept_new_host_key, interactive or prompt_terminal, timeout, 0)


def _connect(target: SSHTarget, config_path: Path | None, accept_new: bool, interactive: Interactive,
             timeout: float, depth: int) -> paramiko.SSHClient:
    if depth > MAX_HOPS:
        raise SSHError(f"ProxyJump chain to {target.alias} is longer than {MAX_HOPS} hops: "
                       "is there a loop in your ~/.ssh/config?")
    jumps: list[paramiko.SSHClient] = []
    sock: paramiko.Channel | paramiko.ProxyCommand | None = None
    if target.proxy_command and not target.proxy_jump:
        sock = paramiko.ProxyCommand(target.proxy_command)  # e.g. `ssh -W %h:%p gateway`
    if target.proxy_jump:
        *earlier, last = target.proxy_jump
        hop = resolve_target(last, config_path)
        if earlier:  # like `ssh -J a,b`: b is reached through a, whatever b's own ProxyJump says
            hop = replace(hop, proxy_jump=earlier)
        jumps.append(_connect(hop, config_path, accept_new, interactive, timeout, depth + 1))
        sock = _open_hop(jumps[-1], hop, target, timeout)
    client = _ChainedClient(jumps)
    try:
        _load_known_hosts(client, target)
        client.set_missing_host_key_policy(_HostKeyPolicy(target, accept_new))
        client.connect(target.hostname, target.port, username=target.user, sock=sock, timeout=timeout,
                       banner_timeout=timeout, auth_timeout=max(timeout, 120),
                       auth_strategy=_Strategy(target, interactive))
    except (SSHError, KeyboardInterrupt):
        client.close()
        raise
    except Exception as e:
        client.close()
        raise _as_ssh_error(e, target) from e
    client.get_transport().set_keepalive(target.server_alive_interval or DEFAULT_KEEPALIVE)
    logger.debug("connected to %s (%s@%s:%d)", target.alias, target.user, target.hostname, target.port)
    return client


def _open_hop(jump: paramiko.SSHClient, hop: SSHTarget, target: SSHTarget, timeout: float) -> paramiko.Channel:
    try:
        return jump.get_transport().open_channel(
            "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0), timeout=timeout)
    except (paramiko.SSHException, OSError) as e:
        jump.close()
        raise SSHError(f"Jump host {hop.alias} could not reach {target.hostname}:{target.port} "
                       f"for {target.alias}: {e}. Check HostName/Port of {target.alias} in ~/.ssh/config.") from e


class _ChainedClient(paramiko.SSHClient):
    """An SSHClient that also closes the jump hosts it was reached through."""

    def __init__(self, jumps: list[paramiko.SSHClient]):
        super().__init__()
        self._jumps = jumps

    def close(self) -> None:
        super().close()
        for jump in reversed(self._jumps):
            jump.close()


def _known_hosts_files(target: SSHTarget) -> list[Path]:
    files = [Path(DEFAULT_KNOWN_HOSTS).expanduser(), *map(Path, target.user_known_hosts_file)]
    return list(dict.fromkeys(files))  # keep order, drop duplicates


def _load_known_hosts(client: paramiko.SSHClient, target: SSHTarget) -> None:
    for path in [Path("/etc/ssh/ssh_known_hosts"), *_known_hosts_files(target)]:
        if path.is_file():
            try:
                client.load_system_host_keys(str(path))
            except (OSError, paramiko.SSHException) as e:
                logger.warning("ignoring unreadable known_hosts file %s: %s", path, e)


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host key: refuse with a how-to, or (when asked to) record it like `ssh` would."""

    def __init__(self, target: SSHTarget, accept_new: bool):
        self.target, self.accept_new = target, accept_new

    def missing_host_key(self, client, hostname, key) -> None:
        # OpenSSH writes new keys to the first UserKnownHostsFile, else ~/.ssh/known_hosts
        path = Path(self.target.user_known_hosts_file[0] if self.target.user_known_hosts_file
                    else Path(DEFAULT_KNOWN_HOSTS).expanduser())
        if not self.accept_new:
            raise HostKeyError(
                f"Unknown host key for {self.target.alias} ({hostname}): {key.get_name()} {key.fingerprint}. "
                "tgi-hpc never trusts a new host key silently. Check the fingerprint against your cluster's "
                f"documentation, then either run `ssh {self.target.alias}` once and answer 'yes', or pass "
                f"--accept-host-key to add it to {path}.")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)
        logger.warning("added host key %s %s for %s to %s", key.get_name(), key.fingerprint, hostname, path)


class _Strategy(AuthStrategy):
    """publickey (agent, then identity files), then keyboard-interactive or password for 2FA."""

    def __init__(self, target: SSHTarget, interactive: Interactive):
        super().__init__(ssh_config=None)
        self.target, self.interactive = target, interactive

    def authenticate(self, transport: paramiko.Transport) -> None:
        user, key_accepted = self.target.user, False
        for key in self._keys():
            try:
                transport.auth_publickey(user, key)
            except paramiko.BadAuthenticationType:
                break  # the server does not take keys at all
            except paramiko.AuthenticationException:
                continue
            key_accepted = True
            break  # success, or partial success: the server now wants a second factor
        if not transport.is_authenticated():
            self._second_factor(transport, user, key_accepted)
        if not transport.is_authenticated():
            raise paramiko.AuthenticationException("no method was accepted")

    def _second_factor(self, transport: paramiko.Transport, user: str, key_accepted: bool) -> None:
        if key_accepted and getattr(self.interactive, "needs_terminal", False) and not has_terminal():
            raise SSHAuthError(no_terminal_message(self.target.alias))   # the key was not enough: 2FA
        try:
            transport.auth_interactive(user, self.interactive)
        except paramiko.BadAuthenticationType as e:
            if "password" not in e.allowed_types:
                raise
            prompt = f"Password for {user}@{self.target.hostname}: "
            transport.auth_password(user, self.interactive("", "", [(prompt, False)])[0])

    def _keys(self) -> Iterator[paramiko.PKey]:
        try:
            yield from paramiko.Agent().get_keys()
        except paramiko.SSHException as e:
            logger.debug("ssh-agent not usable: %s", e)
        paths = self.target.identity_files or [str(Path(p).expanduser()) for p in DEFAULT_KEYS]
        for path in paths:
            if Path(path).is_file():
                key = self._load_key(path)
                if key is not None:
                    yield key

    def _load_key(self, path: str) -> paramiko.PKey | None:
        try:
            return paramiko.PKey.from_path(path)
        except paramiko.PasswordRequiredException:
            answer = self.interactive("", f"{path} is encrypted.", [(f"Passphrase for {path}: ", False)])
            try:
                return paramiko.PKey.from_path(path, passphrase=answer[0])
            except (paramiko.SSHException, ValueError) as e:
                logger.warning("cannot decrypt %s: %s", path, e)
                return None
        except (paramiko.SSHException, OSError, ValueError) as e:
            logger.warning("skipping identity file %s: %s", path, e)
            return None


def _as_ssh_error(e: Exception, target: SSHTarget) -> SSHError:
    where = f"{target.alias} ({target.user}@{target.hostname}:{target.port})"
    if isinstance(e, paramiko.BadHostKeyException):
        return HostKeyError(
            f"The host key of {where} does NOT match known_hosts (got {e.key.fingerprint}). This can be an attack, "
            "or the cluster changed its keys: check the cluster's announcements, then remove the old entry with "
            f"`ssh-keygen -R '{target.known_hosts_name}'` and connect again.")
    if isinstance(e, paramiko.AuthenticationException):
        return SSHAuthError(
            f"Authentication to {where} failed ({str(e).rstrip('.')}). "
            f"Check that `ssh {target.alias}` works without tgi-hpc, "
            "that your public key is registered with the cluster (Mila: `mila init`; DRAC: CCDB), "
            "and that your key is in ssh-agent or listed as IdentityFile.")
    if isinstance(e, TimeoutError):
        return SSHError(f"Timed out connecting to {where}. Check your network or VPN, and `ssh {target.alias}`.")
    return SSHError(f"Cannot connect to {where} ({str(e).rstrip('.')}). Check your network and `ssh {target.alias}`.")


def prompt_terminal(title: str, instructions: str, prompts: list[tuple[str, bool]]) -> list[str]:
    """Answer a keyboard-interactive (2FA) request on the terminal."""
    for line in (title, instructions):
        if line.strip():
            print(line.strip(), file=sys.stderr)
    return [_ask(text) if echo else getpass.getpass(text) for text, echo in prompts]


prompt_terminal.needs_terminal = True  # type: ignore[attr-defined]


def has_terminal() -> bool:
    """Whether someone can answer a prompt: stdin is a terminal, or this process has one (/dev/tty)."""
    if sys.stdin is not None and sys.stdin.isatty():
        return True
    try:
        open("/dev/tty").close()
        return True
    except OSError:
        return False


def no_terminal_message(alias: str) -> str:
    """The 2FA story, where a second factor is asked and nobody can answer it."""
    return (f"{alias} asks for a second factor (2FA) and this process has no terminal to answer it (a background "
            "tunnel, a job, cron). tgi-hpc connects with paramiko, which cannot reuse an OpenSSH ControlMaster "
            "login, so every tgi-hpc command authenticates on its own, once. Run it in a terminal (for a lasting "
            "tunnel: `tgi-hpc tunnel JOB` in a terminal or tmux of its own), or forward with OpenSSH itself, "
            f"which reuses your ControlMaster login: `ssh -N -L 8080:NODE:PORT {alias}` (NODE:PORT from "
            "`tgi-hpc status JOB`).")


def _ask(text: str) -> str:
    print(text, end="", file=sys.stderr, flush=True)  # stdout may be --json output
    return sys.stdin.readline().rstrip("\n")

"""render_ssh_config: the ~/.ssh/config entries a cluster needs (login alias, 2FA reuse, compute-node jumps)."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from tgi_hpc.errors import UsageError

# Authenticate (2FA) once and let later ssh/scp/rsync reuse that connection. The values are the ones
# milatools writes (mila-iqia/milatools, milatools/cli/init_command.py at 7f79c43,
# `ssh_multiplexing_config`), so both tools share one socket per login: ControlPath
# ~/.cache/ssh/%r@%h:%p, ControlPersist yes (until the laptop restarts). milatools sets them on Mila's
# compute-node entries too, not on the Alliance ones; we set them on every entry (our choice: one 2FA
# prompt per login, whichever cluster).
# (The Alliance "Multifactor authentication" page shows the same mechanism with ControlPersist 10m:
# https://docs.alliancecan.ca/wiki/Multifactor_authentication.) Windows' OpenSSH has no
# ControlMaster (milatools drops these keys there too).
CONTROL_DIR = "~/.cache/ssh"
MULTIPLEX = {} if sys.platform == "win32" else {
    "ControlMaster": "auto", "ControlPath": f"{CONTROL_DIR}/%r@%h:%p", "ControlPersist": "yes"}

_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class ClusterSSH:
    """Login aliases (alias -> options) and compute-node Host patterns (pattern -> login alias)."""

    logins: dict[str, dict[str, str]]
    nodes: dict[str, str]
    source: str  # the page that documents the login host


# Compute-node name patterns are milatools' (init_command.py at 7f79c43: MILA_ENTRIES, DRAC_ENTRIES),
# which a cluster tool run by Mila keeps current; the login hosts come from each cluster's own page.
CLUSTERS: dict[str, ClusterSSH] = {
    # "The Mila login nodes require: Hostname login.server.mila.quebec, Port 2222,
    #  PreferredAuthentications publickey,keyboard-interactive"
    "mila": ClusterSSH(
        logins={"mila": {"HostName": "login.server.mila.quebec", "Port": "2222",
                         "PreferredAuthentications": "publickey,keyboard-interactive",
                         "ServerAliveInterval": "120", "ServerAliveCountMax": "5"}},
        nodes={"*.server.mila.quebec !*login.server.mila.quebec": "mila", "cn-????": "mila"},
        source="https://docs.mila.quebec/userguides/login/"),
    # "Login node: fir.alliancecan.ca"
    "fir": ClusterSSH(logins={"fir": {"HostName": "fir.alliancecan.ca"}},
                      nodes={"fc????? fb?????": "fir"},
                      source="https://docs.alliancecan.ca/wiki/Fir"),
    # "SSH login node: nibi.alliancecan.ca"
    "nibi": ClusterSSH(logins={"nibi": {"HostName": "nibi.alliancecan.ca"}},
                       nodes={"c? c?? c??? g? g?? l? l?? m? m?? u?": "nibi"},
                       source="https://docs.alliancecan.ca/wiki/Nibi"),
    # "Login node: rorqual.alliancecan.ca"
    "rorqual": ClusterSSH(logins={"rorqual": {"HostName": "rorqual.alliancecan.ca"}},
                          nodes={"rc????? rg????? rl?????": "rorqual"},
                          source="https://docs.alliancecan.ca/wiki/Rorqual"),
    # "Login node: narval.alliancecan.ca"
    "narval": ClusterSSH(logins={"narval": {"HostName": "narval.alliancecan.ca"}},
                         nodes={"nc????? ng?????": "narval"},
                         source="https://docs.alliancecan.ca/wiki/Narval/en"),
    # "Login node: trillium.alliancecan.ca and trillium-gpu.alliancecan.ca" (GPU jobs are
    # submitted from the GPU login node)
    "trillium": ClusterSSH(
        logins={"trillium": {"HostName": "trillium.alliancecan.ca"},
                "trillium-gpu": {"HostName": "trillium-gpu.alliancecan.ca"}},
        nodes={"!trillium tri????": "trillium", "!trillium trig????": "trillium-gpu"},
        source="https://docs.alliancecan.ca/wiki/Trillium"),
    # PAICE clusters. "Login node : tamia.alliancecan.ca"
    "tamia": ClusterSSH(logins={"tamia": {"HostName": "tamia.alliancecan.ca"}},
                        nodes={"tg????? tc?????": "tamia"},
                        source="https://docs.alliancecan.ca/wiki/TamIA/en"),
    # "Login node killarney.alliancecan.ca"
    "killarney": ClusterSSH(logins={"killarney": {"HostName": "killarney.alliancecan.ca"}},
                            nodes={"kn???": "killarney"},
                            source="https://docs.alliancecan.ca/wiki/Killarney/en"),
    # "Login node: vulcan.alliancecan.ca"
    "vulcan": ClusterSSH(logins={"vulcan": {"HostName": "vulcan.alliancecan.ca"}},
                         nodes={"rack??-??": "vulcan"},
                         source="https://docs.alliancecan.ca/wiki/Vulcan/en"),
    # "Login node rocky.alliancecan.ca" (Amii). The page and milatools name no compute-node pattern: none here.
    "rocky": ClusterSSH(logins={"rocky": {"HostName": "rocky.alliancecan.ca"}}, nodes={},
                        source="https://docs.alliancecan.ca/wiki/Rocky"),
}


def render_ssh_config(cluster: str, user: str, spec: ClusterSSH | None = None) -> str:
    """The ~/.ssh/config text for `cluster` (or for `spec`, a profile's own `ssh` section), as `user`."""
    if spec is None and cluster not in CLUSTERS:
        raise UsageError(f"Unknown cluster {cluster!r} for ssh-config: choose one of {', '.join(CLUSTERS)}, "
                         "or give a profile (name or YAML path) with an `ssh` section.")
    if not _USER.fullmatch(user):
        raise UsageError(f"Invalid cluster username {user!r}: use your login name, e.g. `alice` "
                         "(letters, digits, '.', '_' and '-').")
    spec = spec or CLUSTERS[cluster]
    lines = [f"# tgi-hpc: SSH entries for {cluster}. Add them to ~/.ssh/config, above any `Host *` block.",
             f"# Login host: {spec.source}"]
    if MULTIPLEX:
        lines += ["# ControlMaster: ssh, scp and rsync reuse one 2FA login while the socket lives (as milatools",
                  f"# sets it up); create its folder once: mkdir -p {CONTROL_DIR} && chmod 700 {CONTROL_DIR}",
                  "# tgi-hpc itself cannot use that socket (paramiko): each tgi-hpc command logs in once."]
    for alias, options in spec.logins.items():
        lines += ["", f"Host {alias}", *_options({**options, "User": user, **MULTIPLEX})]
    if spec.nodes:
        lines += ["", f"# Compute nodes, reached through the {cluster} login node"]
    for pattern, login in spec.nodes.items():
        lines += [f"Host {pattern}", *_options({"ProxyJump": login, "User": user, **MULTIPLEX}), ""]
    return "\n".join(lines)


def profile_ssh(profile) -> ClusterSSH | None:
    """The entries a profile itself declares (`ssh:` with login options and node patterns), if any."""
    ssh = getattr(profile, "ssh", None)
    if ssh is None or not profile.login_host:
        return None
    return ClusterSSH(logins={profile.login_host: dict(ssh.login)},
                      nodes={pattern: profile.login_host for pattern in ssh.nodes}, source=ssh.source)


def _options(options: dict[str, str]) -> list[str]:
    return [f"  {key} {value}" for key, value in options.items()]

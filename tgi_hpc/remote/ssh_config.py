"""render_ssh_config: the ~/.ssh/config entries a cluster needs (login alias, 2FA reuse, compute-node jumps)."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from tgi_hpc.errors import UsageError

# Authenticate (2FA) once and let later ssh/scp/rsync reuse that connection for 10 minutes.
# Values from the Alliance "Multifactor authentication" page, section on ControlMaster
# (https://docs.alliancecan.ca/wiki/Multifactor_authentication); milatools writes the same three
# keys for Mila since Mila enabled 2FA (mila-iqia/milatools, milatools/cli/init_command.py).
# Windows' OpenSSH has no ControlMaster (milatools drops these keys there too).
MULTIPLEX = {} if sys.platform == "win32" else {
    "ControlMaster": "auto", "ControlPath": "~/.ssh/cm-%r@%h:%p", "ControlPersist": "10m"}

_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class ClusterSSH:
    """Login aliases (alias -> options) and compute-node Host patterns (pattern -> login alias)."""

    logins: dict[str, dict[str, str]]
    nodes: dict[str, str]
    source: str  # the page that documents the login host


# Compute-node name patterns are milatools' (init_command.py, HEAD 7f79c43), which a cluster
# tool run by Mila keeps current; the login hosts come from each cluster's own page.
CLUSTERS: dict[str, ClusterSSH] = {
    # "The Mila login nodes require: Hostname login.server.mila.quebec, Port 2222,
    #  PreferredAuthentications publickey,keyboard-interactive"
    "mila": ClusterSSH(
        logins={"mila": {"HostName": "login.server.mila.quebec", "Port": "2222",
                         "PreferredAuthentications": "publickey,keyboard-interactive",
                         "ServerAliveInterval": "120", "ServerAliveCountMax": "5"}},
        nodes={"cn-*": "mila", "*.server.mila.quebec !*login.server.mila.quebec": "mila"},
        source="https://docs.mila.quebec/Userguide_login.html"),
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
}


def render_ssh_config(cluster: str, user: str) -> str:
    """The ~/.ssh/config text for `cluster`, logging in as `user`."""
    if cluster not in CLUSTERS:
        raise UsageError(f"Unknown cluster {cluster!r} for ssh-config: choose one of {', '.join(CLUSTERS)}.")
    if not _USER.fullmatch(user):
        raise UsageError(f"Invalid cluster username {user!r}: use your login name, e.g. `alice` "
                         "(letters, digits, '.', '_' and '-').")
    spec = CLUSTERS[cluster]
    lines = [f"# tgi-hpc: SSH entries for {cluster}. Add them to ~/.ssh/config, above any `Host *` block.",
             f"# Login host: {spec.source}"]
    if MULTIPLEX:
        lines.append("# ControlMaster: ssh, scp and rsync reuse one 2FA login for 10 minutes.")
    for alias, options in spec.logins.items():
        lines += ["", f"Host {alias}", *_options({**options, "User": user, **MULTIPLEX})]
    lines += ["", f"# Compute nodes, reached through the {cluster} login node"]
    for pattern, login in spec.nodes.items():
        lines += [f"Host {pattern}", *_options({"ProxyJump": login, "User": user}), ""]
    return "\n".join(lines)


def _options(options: dict[str, str]) -> list[str]:
    return [f"  {key} {value}" for key, value in options.items()]

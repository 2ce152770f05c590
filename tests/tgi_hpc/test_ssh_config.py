"""render_ssh_config: read back by paramiko, by our resolve_target, and by OpenSSH's own `ssh -G`."""
from __future__ import annotations

import shutil
import subprocess

import paramiko
import pytest

from tgi_hpc.errors import UsageError
from tgi_hpc.remote.ssh import resolve_target
from tgi_hpc.remote.ssh_config import CLUSTERS, render_ssh_config

pytestmark = pytest.mark.timeout(60)

# (cluster, login alias, login hostname, port, a compute node name, the alias it jumps through)
CASES = [
    ("mila", "mila", "login.server.mila.quebec", 2222, "cn-g017", "mila"),
    ("fir", "fir", "fir.alliancecan.ca", 22, "fc10304", "fir"),
    ("nibi", "nibi", "nibi.alliancecan.ca", 22, "g12", "nibi"),
    ("rorqual", "rorqual", "rorqual.alliancecan.ca", 22, "rg10101", "rorqual"),
    ("narval", "narval", "narval.alliancecan.ca", 22, "ng30601", "narval"),
    ("trillium", "trillium", "trillium.alliancecan.ca", 22, "tri0042", "trillium"),
    ("trillium", "trillium-gpu", "trillium-gpu.alliancecan.ca", 22, "trig0042", "trillium-gpu"),
    ("tamia", "tamia", "tamia.alliancecan.ca", 22, "tg10101", "tamia"),
    ("tamia", "tamia", "tamia.alliancecan.ca", 22, "tc10101", "tamia"),
    ("killarney", "killarney", "killarney.alliancecan.ca", 22, "kn101", "killarney"),
    ("vulcan", "vulcan", "vulcan.alliancecan.ca", 22, "rack01-12", "vulcan"),
]


@pytest.mark.parametrize(("cluster", "alias", "hostname", "port", "node", "jump"), CASES)
def test_entries_resolve_to_the_documented_hosts(tmp_path, cluster, alias, hostname, port, node, jump):
    path = tmp_path / "config"
    path.write_text(render_ssh_config(cluster, "alice"))
    login = resolve_target(alias, path)
    assert (login.hostname, login.port, login.user, login.proxy_jump) == (hostname, port, "alice", [])
    options = paramiko.SSHConfig.from_path(str(path)).lookup(alias)
    # milatools' values (init_command.py: ssh_multiplexing_config), so both tools share one socket
    assert (options["controlmaster"], options["controlpersist"]) == ("auto", "yes")
    assert options["controlpath"].endswith(f"/.cache/ssh/alice@{hostname}:{port}")
    compute = resolve_target(node, path)
    assert (compute.hostname, compute.user, compute.proxy_jump) == (node, "alice", [jump])
    assert paramiko.SSHConfig.from_path(str(path)).lookup(node)["controlpersist"] == "yes"


def test_mila_asks_for_publickey_then_2fa_and_reaches_full_node_names(tmp_path):
    text = render_ssh_config("mila", "alice")
    config = paramiko.SSHConfig.from_text(text)
    assert config.lookup("mila")["preferredauthentications"] == "publickey,keyboard-interactive"
    assert config.lookup("cn-a001.server.mila.quebec")["proxyjump"] == "mila"
    assert "proxyjump" not in config.lookup("login.server.mila.quebec")  # no jump loop
    assert "proxyjump" not in config.lookup("trillium")
    assert config.lookup("cn-g017")["proxyjump"] == "mila"           # milatools' cn-???? pattern
    assert "proxyjump" not in config.lookup("cn-gpu-test")           # ... not any cn-* name
    assert "https://docs.mila.quebec/userguides/login/" in text      # the page moved from Userguide_login.html


def test_a_profile_with_an_ssh_section_gets_entries_and_one_without_is_refused(tmp_path):
    from tgi_hpc.cli import main

    path = tmp_path / "lab.yaml"
    path.write_text("name: lab\nlogin_host: lab-login\nslurm: {}\n"
                    "paths: {scratch: /s, models: /s/m, releases: /s/r, jobs: /s/j}\n"
                    "network: {compute_nodes_internet: false, download_on: login, compile_on: job}\n"
                    "ssh: {login: {HostName: lab.example.org, Port: '2200'}, nodes: [node??], source: our wiki}\n")
    out = tmp_path / "config"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["ssh-config", str(path), "-u", "alice"]) == 0
    out.write_text(buf.getvalue())
    login = resolve_target("lab-login", out)
    assert (login.hostname, login.port, login.user) == ("lab.example.org", 2200, "alice")
    assert resolve_target("node07", out).proxy_jump == ["lab-login"]
    path.write_text(path.read_text().split("ssh:")[0])
    assert main(["ssh-config", str(path), "-u", "alice"]) == 2


def test_login_aliases_never_jump_through_themselves():
    for cluster, spec in CLUSTERS.items():
        config = paramiko.SSHConfig.from_text(render_ssh_config(cluster, "alice"))
        for alias in spec.logins:
            assert "proxyjump" not in config.lookup(alias), (cluster, alias)


@pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH client not installed")
@pytest.mark.parametrize(("cluster", "alias", "hostname", "port", "node", "jump"), CASES)
def test_openssh_reads_the_entries_the_same_way(tmp_path, cluster, alias, hostname, port, node, jump):
    path = tmp_path / "config"
    path.write_text(render_ssh_config(cluster, "alice"))

    def effective(host: str) -> dict[str, str]:
        out = subprocess.run(["ssh", "-G", "-F", str(path), host], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)

    login = effective(alias)
    assert (login["hostname"], login["port"], login["user"]) == (hostname, str(port), "alice")
    assert login["controlmaster"] == "auto" and "proxyjump" not in login
    assert effective(node)["proxyjump"] == jump


def test_bad_input_is_a_usage_error():
    with pytest.raises(UsageError, match="choose one of mila, fir, nibi, rorqual, narval, trillium"):
        render_ssh_config("cedar", "alice")
    for user in ("", "alice bob", "alice\nHost *", "-oProxyCommand=x"):
        with pytest.raises(UsageError, match="Invalid cluster username"):
            render_ssh_config("mila", user)

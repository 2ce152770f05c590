"""What `--help` says is true: every module path it names exists, every cluster family is named, the config
folder is the one platformdirs gives."""
from __future__ import annotations

import importlib
import json
import re

import click
import pytest

from tgi_hpc.cli import cli, main


def _helps() -> dict[str, str]:
    """Every command's and group's --help text, by command path."""
    found: dict[str, str] = {}

    def walk(command: click.Command, path: list[str]) -> None:
        with click.Context(command, info_name=" ".join(path)) as ctx:
            found[" ".join(path)] = command.get_help(ctx)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(cli, ["tgi-hpc"])
    return found


def test_every_dotted_name_in_help_exists():
    names = {(where, m) for where, text in _helps().items()
             for m in re.findall(r"\b(?:tgi_hpc|engine)(?:\.\w+)+", text.replace("\n", " "))}
    assert names, "no help names a module: this test would check nothing"
    for where, dotted in sorted(names):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):   # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"`{where} --help` names {dotted}, which does not exist"
            obj = getattr(obj, attr)


def test_the_top_help_names_every_cluster_family(capsys):
    assert main(["--help"]) == 0
    assert "(Mila, DRAC, PAICE)" in capsys.readouterr().out


@pytest.mark.parametrize("set_dir", [True, False])
def test_profiles_list_prints_the_config_folder_it_reads(capsys, monkeypatch, tmp_path, set_dir):
    import platformdirs

    if set_dir:
        monkeypatch.setenv("TGI_HPC_CONFIG_DIR", str(tmp_path / "my conf"))
        want = str(tmp_path / "my conf")
    else:
        monkeypatch.delenv("TGI_HPC_CONFIG_DIR")
        want = platformdirs.user_config_dir("tgi-hpc")
    assert main(["profiles", "list"]) == 0
    assert f"(your profiles and overrides: {want}/NAME.yaml)" in capsys.readouterr().out
    assert main(["profiles", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config_dir"] == want

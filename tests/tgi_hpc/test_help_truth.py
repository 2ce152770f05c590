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


# --- the README, CONTRIBUTING.md and docs/ name only what exists ----------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
_PATH = re.compile(r"(?<![\w./-])((?:tgi_hpc|engine|tests|scripts|profiles|templates|docs)/[\w./-]*\w)")
_DOTTED = re.compile(r"(?<![\w./-])((?:tgi_hpc|engine)(?:\.[A-Za-z_]\w*)+)")
# a command as typed: in backticks, at the start of a line, or inside $( ) / after && (not "each tgi-hpc command")
_COMMAND = re.compile(r"(?:^|`|\$\(|&& |\n)\s*tgi-hpc((?: [a-z][a-z-]*)+)((?: [^`\n#|;&)]*)?)", re.M)


def _doc_texts() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in DOCS]


def test_every_path_the_docs_name_exists():
    named = {(where, m) for where, text in _doc_texts() for m in _PATH.findall(text)
             if not any(c in m for c in "*{<") and "NAME" not in m and "..." not in m
             and ("." in m.rsplit("/", 1)[-1] or m.endswith("/"))}   # files, and folders written with their /
    assert len(named) > 50
    missing = sorted(f"{where}: {path}" for where, path in named if not (ROOT / path.rstrip(".")).exists())
    assert not missing, "\n".join(missing)


def test_every_module_the_docs_name_exists():
    missing = []
    for where, text in _doc_texts():
        for dotted in set(_DOTTED.findall(text)):
            parts = dotted.split(".")
            cut = max((i for i in range(1, len(parts) + 1)
                       if (ROOT / "/".join(parts[:i])).with_suffix(".py").is_file()
                       or (ROOT / "/".join(parts[:i]) / "__init__.py").is_file()), default=0)
            if cut == 0 or (parts[0] == "tgi_hpc" and not _has_attrs(".".join(parts[:cut]), parts[cut:])):
                missing.append(f"{where}: {dotted}")
    assert not missing, "\n".join(sorted(missing))


def _has_attrs(module: str, attrs: list[str]) -> bool:
    obj = importlib.import_module(module)
    for attr in attrs:
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def test_every_command_and_flag_the_docs_name_exists():
    commands: dict[str, click.Command] = {}

    def walk(command: click.Command, path: list[str]) -> None:
        commands[" ".join(path)] = command
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(cli, [])
    wrong, seen = [], 0
    for where, text in _doc_texts():
        for words, rest in _COMMAND.findall(text):
            names = words.split()
            path = []
            while names and " ".join([*path, names[0]]) in commands:
                path.append(names.pop(0))
            if not path:
                if names[0] not in ("is", "and", "or", "itself", "reads", "on", "as"):   # prose: "tgi-hpc itself"
                    wrong.append(f"{where}: `tgi-hpc {words.strip()}`: no such command")
                continue
            command = commands[" ".join(path)]
            if isinstance(command, click.Group) and command.name != "tunnel":
                command = command.commands.get(getattr(command, "default_command", ""), command)
            known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", " ".join(names) + rest):
                seen += 1
                if flag not in known and not (command.name == "tunnel"
                                              and flag in {o for p in cli.commands["tunnel"].commands["open"].params
                                                           for o in p.opts}):
                    wrong.append(f"{where}: `tgi-hpc {' '.join(path)} ... {flag}`: no such option")
    assert seen > 30
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_readme_names_the_states_status_prints():
    with click.Context(cli.commands["status"], info_name="status") as ctx:
        help_text = cli.commands["status"].get_help(ctx)
    states = set(re.findall(r"\b(PENDING|STARTING|LISTENING|READY|ENDING|COMPLETED|FAILED|CANCELLED|TIMEOUT)\b",
                            help_text))
    assert len(states) == 9, help_text
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### `status`", 1)[1].split("\n### ", 1)[0]
    assert not {s for s in states if s not in section}, section

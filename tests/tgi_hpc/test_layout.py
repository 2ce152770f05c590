"""The package layout holds: no import cycles inside tgi_hpc, imports run cli -> api -> workflows -> core, no torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tgi_hpc

ROOT = Path(tgi_hpc.__file__).parent
# A package may import from its own rank and the ranks below it, never above.
RANKS = {"errors": 0, "data": 0, "files": 0, "quoting": 0, "__init__": 0, "__main__": 5,
         "profiles": 1, "remote": 1, "models": 1, "release": 1, "service": 1,
         "slurm": 2, "workflows": 3, "batch": 3, "api": 4, "cli": 5}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every tgi_hpc module `name` imports, at module level or inside functions (both can form a cycle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None: a depth-first search with colours."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in colour and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        colour[node] = 2
        return None

    for start in sorted(graph):
        if start not in colour and (cycle := visit(start)):
            return cycle
    return None


def _area(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def test_the_walk_sees_every_package_and_real_edges():
    graph = import_graph()
    assert {"tgi_hpc.cli", "tgi_hpc.slurm.jobs", "tgi_hpc.release.verify", "tgi_hpc.profiles.loader"} <= set(graph)
    assert "tgi_hpc.slurm.render" in graph["tgi_hpc.slurm.jobs"]
    assert "tgi_hpc.slurm" in graph["tgi_hpc.cli.jobs"] or "tgi_hpc.slurm.jobs" in graph["tgi_hpc.cli.jobs"]


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_there_are_no_import_cycles_inside_tgi_hpc():
    assert find_cycle(import_graph()) is None


def test_every_package_has_a_docstring_saying_what_it_owns():
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, init


@pytest.mark.parametrize("area", sorted(k for k in RANKS if k not in ("__init__", "__main__")))
def test_imports_run_one_way_cli_workflows_core(area):
    wrong = [(m, dep) for m, deps in import_graph().items() if _area(m) == area
             for dep in deps if RANKS[_area(dep)] > RANKS[area]]
    assert wrong == []


def test_no_module_is_left_flat_at_the_top():
    assert sorted(p.stem for p in ROOT.glob("*.py")) == ["__init__", "__main__", "api", "data", "errors", "files",
                                                        "quoting"]
    assert {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == {
        "batch", "cli", "models", "profiles", "release", "remote", "service", "slurm", "workflows"}


def test_importing_each_package_and_the_cli_imports_no_torch():
    packages = ["tgi_hpc." + p.parent.name for p in ROOT.glob("*/__init__.py")]
    modules = sorted(m for m in _modules() if not m.endswith("__main__"))
    code = (f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
            "bad = sorted(m for m in ('torch', 'transformers', 'engine') if m in sys.modules)\n"
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(packages) == 9


def test_a_release_still_finds_this_checkout_from_its_new_folder():
    from tgi_hpc.release.spec import _checkout_root

    assert _checkout_root() == ROOT.parent

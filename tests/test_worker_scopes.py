"""scripts/test.sh's two workers: how tests/conftest.py cuts the suite into units that each run whole on one."""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _root_conftest(config):
    """tests/conftest.py as pytest loaded it (`import conftest` may find tests/cluster/conftest.py instead)."""
    return next(p for p in config.pluginmanager.get_plugins()
                if getattr(p, "__file__", None) == str(TESTS / "conftest.py"))


def test_every_cluster_test_is_one_unit_and_every_other_file_its_own(pytestconfig):
    cluster_or_file = _root_conftest(pytestconfig).cluster_or_file
    cluster = sorted(p.relative_to(TESTS.parent).as_posix() for p in (TESTS / "cluster").glob("test_*.py"))
    others = sorted(p.relative_to(TESTS.parent).as_posix() for p in (TESTS / "engine").glob("test_*.py"))
    assert len(cluster) > 10 and len(others) > 10
    assert {cluster_or_file(f"{path}::test_x[a::b]") for path in cluster} == {"tests/cluster"}
    units = [cluster_or_file(f"{path}::TestX::test_y") for path in others]
    assert units == others


def test_the_scheduler_hook_is_what_pytest_xdist_calls(pytestconfig):
    import xdist.newhooks

    assert hasattr(xdist.newhooks, "pytest_xdist_make_scheduler")
    scheduler = _root_conftest(pytestconfig).pytest_xdist_make_scheduler(_Config(), log=None)
    assert scheduler._split_scope("tests/cluster/test_laptop.py::test_a") == "tests/cluster"
    assert scheduler._split_scope("tests/engine/test_clients.py::test_a") == "tests/engine/test_clients.py"


class _Config:
    """What xdist's LoadScopeScheduling reads from the config at construction."""

    class option:
        tx = ["popen", "popen"]
        numprocesses = 2
        maxschedchunk = None

    def getvalue(self, name):
        return getattr(self.option, name, None)

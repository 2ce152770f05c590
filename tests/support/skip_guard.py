"""CI fails on an unexpected skip: a test that CI is expected to run and that did not run has not passed.

Active where CI runs the suite (CI=true, or TGI_HPC_REQUIRE_CLUSTER=1 as scripts/test.sh sets, or
TGI_HPC_STRICT_SKIPS=1); registered by tests/conftest.py. There, a skip (an `importorskip` of a missing
package, a fixture's missing sshd or cluster, a `skipif`) becomes a failure that prints its reason,
unless it is one of:
- the `gpu` marker's skip on a machine without CUDA (tests/conftest.py);
- a reason in ALLOWED below, each with why it may be skipped in CI.
A module skipped at collection becomes a collection error. xfail is not a skip and is left alone.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

GPU_REASON = "needs CUDA"   # tests/conftest.py's skip for the `gpu` marker
ALLOWED = {
    "neither flash_attn nor vllm_flash_attn is importable": "flash-attn is the optional `gpu` extra, never required",
    "flash-attn is importable here: auto picks it": "a test of the default where flash-attn is not installed",
    "torchvision does not import beside this torch": "the `vision` extra: PyPI's torchvision needs PyPI's torch "
    "build, and scripts/setup.sh's default is the CPU wheel on disk (docs/models.md, Mistral 3 / SmolVLM rows)",
}


def active(env: Mapping[str, str]) -> bool:
    return (env.get("CI", "").lower() in ("true", "1") or env.get("TGI_HPC_REQUIRE_CLUSTER") == "1"
            or env.get("TGI_HPC_STRICT_SKIPS") == "1")


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def allowed(reason: str, item: pytest.Item | None) -> bool:
    if reason == GPU_REASON:
        return item is not None and item.get_closest_marker("gpu") is not None
    return reason in ALLOWED


def _fail(report: pytest.TestReport | pytest.CollectReport, where: str) -> None:
    reason = skip_reason(report)
    report.outcome = "failed"
    report.longrepr = (f"unexpected skip in CI: {reason}\n  {where}\n  CI runs every test except the `gpu` ones "
                       "where there is no CUDA: install what it needs or start what it needs, or, if it may "
                       "be skipped, mark it `gpu` or list its reason in tests/support/skip_guard.py ALLOWED.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and active(os.environ)
            and not allowed(skip_reason(report), item)):
        _fail(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and active(os.environ) and not allowed(skip_reason(report), None):
        _fail(report, f"{collector.nodeid} (the whole module)")

"""Shared fixtures: test models, hostile strings, the engine/cluster markers' skips, and no other skip in CI."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# Without a GPU, Triton kernels run in Triton's CPU interpreter (fp32/fp16 exact, bf16 wrong). The
# variable is read when a kernel is decorated, so it must be set before any engine module imports.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A shell without job control starts a background command (`bash scripts/test.sh &`, a CI runner's
# step) with SIGINT ignored, and every child inherits that: the tests that press Ctrl-C (serve --tunnel, the
# metrics live view, --stop-on-exit) then wait out their timeouts and fail. Children get the default back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# `tgi-hpc ... --wait` backs off to one poll every 5 s; 1 s here notices a READY job sooner (tgi_hpc/slurm/jobs.py).
os.environ.setdefault("TGI_HPC_MAX_POLL_S", "1")

# Strings that would run code if they reached a shell unquoted (submitit's weird_tmp_path, and more).
HOSTILE = [
    "x/$(touch {marker})",
    "x/`touch {marker}`",
    "a'; touch {marker}; echo '",
    'a"; touch {marker}; echo "',
    "a\ntouch {marker}\n",
    "a b; touch {marker} #",
    "$(touch {marker})",
    "a && touch {marker}",
    "${{IFS}}touch${{IFS}}{marker}",
]


@pytest.fixture
def hostile(tmp_path):
    """(value, marker path): executing anything built from `value` must not create `marker`."""
    marker = tmp_path / "pwned"
    return [(template.format(marker=marker), marker) for template in HOSTILE]


@pytest.fixture(scope="session")
def model_path():
    """model_path("smollm2") -> snapshot dir (built once, cached; see scripts/make_models.py)."""
    from make_models import ensure_model

    return ensure_model


def pytest_configure(config):
    config.pluginmanager.import_plugin("support.skip_guard")   # CI fails on an unexpected skip


def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist (scripts/test.sh runs two workers): each test file runs whole on one worker, so its
    module fixtures are built once, and every test under tests/cluster runs on one worker, one after another,
    as the suite alone: jobs from two tests at once would wait for each other's nodes (PENDING (Resources)).
    (`--dist loadgroup` cannot say this under pytest 9: it renames node ids, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndTheCluster(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return cluster_or_file(nodeid)

    return FilesAndTheCluster(config, log)


def cluster_or_file(nodeid: str) -> str:
    """A test's unit on the workers: tests/cluster as a whole (its tests submit jobs to the one local cluster: one
    at a time), else the test's file (its module fixtures are built once)."""
    path = nodeid.split("::", 1)[0]
    return "tests/cluster" if path.startswith("tests/cluster/") else path


def pytest_collection_modifyitems(config, items):
    has_cuda = _has_cuda()
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path_factory, monkeypatch):
    """No test reads the developer's own tgi-hpc config or HF token."""
    home = tmp_path_factory.mktemp("config")
    monkeypatch.setenv("TGI_HPC_CONFIG_DIR", str(home))
    for var in ("TGI_HPC_CLUSTER", "TGI_HPC_SET", "TGI_HPC_JSON", "TGI_HPC_REMOTE", "TGI_HPC_ACCOUNT", "HF_TOKEN",
                "TGI_HPC_ACCEPT_HOST_KEY"):
        monkeypatch.delenv(var, raising=False)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

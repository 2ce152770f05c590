"""tests/support/skip_guard.py: in CI an unexpected skip fails the run, with its reason; gpu skips do not."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CONFTEST = """
import pytest
pytest_plugins = ["support.skip_guard"]
def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA")
"""

ALLOWED_SKIPS = """
import pytest

@pytest.mark.gpu
@pytest.mark.skip(reason="needs CUDA")
def test_gpu():
    pass

def test_optional_flash_attn():
    pytest.skip("neither flash_attn nor vllm_flash_attn is importable")

@pytest.mark.xfail(strict=True, reason="a known refusal")
def test_known_refusal():
    assert False

def test_runs():
    pass
"""


def _pytest(tmp_path: Path, files: dict[str, str], **env: str) -> subprocess.CompletedProcess:
    for name, text in {"conftest.py": CONFTEST, "pytest.ini": "[pytest]\naddopts = -ra\n", **files}.items():
        (tmp_path / name).write_text(text)
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "TGI_HPC_REQUIRE_CLUSTER", "TGI_HPC_STRICT_SKIPS")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env={**clean, "PYTHONPATH": str(TESTS), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env", [{"CI": "true"}, {"TGI_HPC_REQUIRE_CLUSTER": "1"}, {"TGI_HPC_STRICT_SKIPS": "1"}])
def test_a_skip_for_a_missing_service_fails_ci_with_its_reason(tmp_path, env):
    result = _pytest(tmp_path, {"test_x.py": "import pytest\n\ndef test_ssh():\n    pytest.skip('sshd must be started as root')\n"
                                             "\ndef test_other():\n    pass\n"}, **env)
    assert result.returncode == 1, result.stdout
    assert "unexpected skip in CI: sshd must be started as root" in result.stdout
    assert "1 failed, 1 passed" in result.stdout


def test_a_module_skipped_for_a_missing_package_fails_ci(tmp_path):
    result = _pytest(tmp_path, {"test_x.py": "import pytest\nnope = pytest.importorskip('no_such_package_xyz')\n"
                                             "\ndef test_a():\n    pass\n"}, CI="true")
    assert result.returncode != 0, result.stdout
    assert "unexpected skip in CI: could not import 'no_such_package_xyz'" in result.stdout


def test_a_fixture_skip_and_a_skipif_fail_ci_too(tmp_path):
    result = _pytest(tmp_path, {"test_x.py": """
import pytest

@pytest.fixture
def cluster():
    pytest.skip("local Slurm cluster is not running")

def test_uses_cluster(cluster):
    pass

@pytest.mark.skipif(True, reason="OpenSSH client not installed")
def test_ssh():
    pass
"""}, CI="true")
    assert result.returncode == 1 and "2 errors" in result.stdout, result.stdout   # both skip at setup
    assert "unexpected skip in CI: local Slurm cluster is not running" in result.stdout
    assert "unexpected skip in CI: OpenSSH client not installed" in result.stdout


def test_gpu_skips_listed_reasons_and_xfail_pass_ci(tmp_path):
    result = _pytest(tmp_path, {"test_x.py": ALLOWED_SKIPS}, CI="true")
    assert result.returncode == 0, result.stdout
    assert "1 passed, 2 skipped, 1 xfailed" in result.stdout


def test_the_gpu_reason_without_the_gpu_marker_fails_ci(tmp_path):
    result = _pytest(tmp_path, {"test_x.py": "import pytest\n\ndef test_x():\n    pytest.skip('needs CUDA')\n"}, CI="true")
    assert result.returncode == 1 and "unexpected skip in CI: needs CUDA" in result.stdout, result.stdout


def test_outside_ci_a_skip_is_only_a_skip(tmp_path):
    result = _pytest(tmp_path, {"test_x.py": "import pytest\n\ndef test_x():\n    pytest.skip('no sshd here')\n"},
                     CI="false")
    assert result.returncode == 0 and "1 skipped" in result.stdout, result.stdout

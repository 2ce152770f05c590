"""`release verify` runs the engine's attention self-check only where the release's torch sees a GPU."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from tgi_hpc.release.verify import verify_release


def _fake_release(tmp_path: Path, *, cuda: bool, attention: str | None) -> Path:
    """A folder whose bin/python answers the two checks like a release would (selftest, attention_check)."""
    root = tmp_path / "rel"
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text(f"home = {root}/bin\n")
    check = json.dumps({"info": {"torch": "2.13.0", "cuda_available": cuda}, "problems": [], "warnings": []})
    attention_branch = {
        None: "echo should-not-run >&2; exit 99",
        "ok": "echo 'compiling...'; echo '{\"attention_backend\": \"triton\", \"ok\": true}'",
        "bad": "echo 'triton kernel differs from the reference by 0.3' >&2; exit 1",
    }[attention]
    script = root / "bin" / "python"
    script.write_text(f"""#!/bin/bash
case "$*" in
  *engine.attention_check*) {attention_branch} ;;
  *tgi_hpc.release.selftest*) echo '{check}' ;;
  *) exit 0 ;;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return root


def test_on_a_gpu_the_attention_backend_is_reported(tmp_path):
    report = verify_release(_fake_release(tmp_path, cuda=True, attention="ok"))
    assert report.details["attention_backend"] == "triton"
    assert not [p for p in report.problems if "attention self-check" in p]


def test_a_failing_attention_check_is_a_problem_with_its_message(tmp_path):
    report = verify_release(_fake_release(tmp_path, cuda=True, attention="bad"))
    assert not report.ok
    assert any("attention self-check failed" in p and "differs from the reference" in p for p in report.problems)


@pytest.mark.parametrize("gpu", [None, False])
def test_without_a_gpu_the_attention_check_is_skipped_with_a_clear_line(tmp_path, gpu):
    report = verify_release(_fake_release(tmp_path, cuda=False, attention=None), gpu=gpu)
    assert "attention_backend" not in report.details
    assert not [p for p in report.problems if "attention self-check" in p]
    if gpu is None:
        assert "on a GPU node" in report.details["attention_check"]

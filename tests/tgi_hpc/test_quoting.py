import subprocess

import pytest

from tgi_hpc.errors import TemplateError
from tgi_hpc.quoting import Shell, finalize, sh, sh_comment, sh_env, sh_join, sh_name


def _echo(word: str, env=None) -> str:
    return subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, text=True, env=env, check=True).stdout


def test_sh_keeps_hostile_values_literal(hostile):
    for value, marker in hostile:
        assert _echo(sh(value)) == value
        assert not marker.exists(), value


def test_sh_env_expands_only_variables(hostile, tmp_path):
    env = {"SCRATCH": "/scratch/u", "PATH": "/usr/bin:/bin"}
    assert _echo(sh_env("$SCRATCH/tgi-hpc/models"), env) == "/scratch/u/tgi-hpc/models"
    assert _echo(sh_env("${SCRATCH}/a b/*"), env) == "/scratch/u/a b/*"
    for value, marker in hostile:
        out = _echo(sh_env("$SCRATCH/" + value), env)
        assert out.startswith("/scratch/u/")
        assert not marker.exists(), value


def test_sh_join_and_names():
    assert _echo(sh_join(["a b", "$(x)"])) == "a b$(x)"
    assert sh_name("HF_HOME") == "HF_HOME"
    with pytest.raises(TemplateError):
        sh_name("A;B")


def test_comment_is_one_line():
    assert "\n" not in sh_comment("a\nrm -rf /")


def test_nul_refused():
    with pytest.raises(TemplateError):
        sh("a\x00b")


def test_finalizer_refuses_unquoted_text():
    assert finalize(sh("x")) == "x"
    assert finalize(3) == 3
    with pytest.raises(TemplateError):
        finalize("raw text")
    with pytest.raises(TemplateError):
        finalize(True)
    assert isinstance(sh("x"), Shell)

"""The one place where values become shell text. Every template interpolation goes through here.

Templates are rendered with a finalizer that accepts only `Shell` values (and ints), so a value
that skipped these functions is a render error, not a silent injection.
"""
from __future__ import annotations

import json
import re
import shlex

from tgi_hpc.errors import TemplateError

# $NAME or ${NAME}: the only expansion a trusted profile path may ask for ($SCRATCH, $SLURM_TMPDIR).
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class Shell(str):
    """Text that is already safe to paste into a shell script."""


def _check(value: object) -> str:
    text = str(value)
    if "\x00" in text:
        raise TemplateError(f"a NUL byte cannot be passed to the shell: {text!r}")
    return text


def sh(value: object) -> Shell:
    """Quote a value as one literal shell word: nothing in it is expanded or executed."""
    return Shell(shlex.quote(_check(value)))


def sh_env(value: object) -> Shell:
    """Quote a value as one shell word in which only $NAME / ${NAME} expand.

    For profile paths such as "$SCRATCH/tgi-hpc"; command substitution, backticks, globs and
    every other character stay literal, so even a hostile value cannot run anything.
    """
    text = _check(value)
    parts: list[str] = []
    pos = 0
    for match in _VAR.finditer(text):
        if match.start() > pos:
            parts.append(shlex.quote(text[pos:match.start()]))
        parts.append('"${%s}"' % (match.group(1) or match.group(2)))
        pos = match.end()
    if pos < len(text) or not parts:
        parts.append(shlex.quote(text[pos:]))
    return Shell("".join(parts))


def sh_join(argv: list[object]) -> Shell:
    """Quote a whole command line, word by word."""
    return Shell(" ".join(sh(a) for a in argv))


def sbatch_value(value: object) -> Shell:
    """A value for an `#SBATCH --flag=VALUE` line, as sbatch's own parser reads it.

    sbatch is not a shell: it knows only double quotes and backslash, and a bare `#` ends the
    value. A newline would end the comment line and turn the rest into shell, so it is refused.
    """
    text = _check(value)
    if "\n" in text or "\r" in text:
        raise TemplateError(f"a line break cannot go into an #SBATCH option: {text!r}")
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("#", "\\#")
    plain = escaped == text and text and all(ch.isalnum() or ch in "-_.:/,=@%+" for ch in text)
    return Shell(text if plain else f'"{escaped}"')


def sh_comment(value: object) -> Shell:
    """Text for a `# comment`: one line whatever the value holds (JSON string escaping)."""
    text = json.dumps(_check(value), ensure_ascii=True)[1:-1]
    return Shell(text)


def sh_name(value: object) -> Shell:
    """An environment variable name; anything else is refused."""
    text = _check(value)
    if not _NAME.match(text):
        raise TemplateError(f"not a valid environment variable name: {text!r}")
    return Shell(text)


def trusted(value: str) -> Shell:
    """Mark a profile's raw shell line (setup:) as shell. Only for profile data, never CLI input."""
    return Shell(_check(value))


def finalize(value: object) -> object:
    """Jinja finalizer: only quoted text and plain numbers may reach the script."""
    if isinstance(value, Shell) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise TemplateError(
        f"template interpolated an unquoted value {value!r}: pipe it through sh, sh_env or sh_name"
    )

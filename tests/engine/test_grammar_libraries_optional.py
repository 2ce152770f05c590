"""llguidance and jsonschema are imported on the first grammar only: the engine (and every module the GPU
check imports) loads without them, and a grammar request then gets a clear error, not an ImportError."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_imports_and_refuses_grammars_without_the_libraries():
    script = textwrap.dedent("""
        import sys
        sys.modules["llguidance"] = None      # import llguidance -> ImportError, as on a machine without it
        sys.modules["jsonschema"] = None
        import engine.llm_engine, engine.server.app, engine.structured.compiler, engine.structured.token_table
        from engine.structured.spec import GrammarError, json_schema_spec, regex_spec
        for build, arg in ((json_schema_spec, '{"type": "object"}'), (regex_spec, "[a-z]+")):
            try:
                build(arg, "grammar")
            except GrammarError as exc:
                assert "not installed" in str(exc) and ("llguidance" in str(exc) or "jsonschema" in str(exc))
            else:
                raise AssertionError("a grammar was built without its libraries")
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]

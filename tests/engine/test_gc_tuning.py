"""gc_tuning: the serving process freezes its start-up objects and collects young objects less often; off by env.
Each case runs in a fresh interpreter (the settings are the whole process's)."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import gc, json
from engine import gc_tuning
before = gc.get_threshold()
applied = gc_tuning.apply()
again = gc_tuning.apply()
print(json.dumps({"applied": applied, "again": again, "before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count()}))
"""


def run(env_value):
    env = {"PATH": "/usr/bin:/bin"} | ({} if env_value is None else {"TGI_HPC_GC_TUNING": env_value})
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    return json.loads(out.stdout)


def test_applied_once_per_process_with_start_up_objects_frozen():
    got = run(None)
    assert got["applied"] is True and got["again"] is True
    assert got["after"][0] == 20_000 and got["after"][1:] == got["before"][1:]
    assert got["frozen"] > 1000     # the interpreter's and the imported modules' objects


def test_turned_off_leaves_the_defaults():
    got = run("0")
    assert got["applied"] is False and got["after"] == got["before"] and got["frozen"] == 0

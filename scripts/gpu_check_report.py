"""Fold scripts/gpu_check.sh's logs into one results file: gpu_check.json and a Markdown summary.

    python scripts/gpu_check_report.py LOG_DIR OUT_DIR TOTAL_SECONDS [CALL] [DRY_RUN: 0|1]

Run after every stage, so a call killed midway leaves the report of what it finished. A stage's status:
ok, failed (exit N), timed out (its limit or the call's budget ran out: exit 124/137), not run (no budget
left for it).
"""
from __future__ import annotations

import datetime
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TAIL = 3000  # characters of each stage's log kept in the results file


def junit(path: Path) -> dict | None:
    """{passed, failed, skipped, failures: [test: message]} from a pytest --junitxml file."""
    if not path.exists():
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            counts["failures"].append(f"{name}: {(problem.get('message') or '')[:300]}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            counts["skips"].append(f"{name}: {(case.find('skipped').get('message') or '')[:200]}")
        else:
            counts["passed"] += 1
    return counts


def status(rc: str) -> str:
    if rc == "budget":
        return "not run (no budget left)"
    code = int(rc)
    return "ok" if code == 0 else "timed out" if code in (124, 137) else f"failed (exit {code})"


def stages_of(logs: Path) -> dict:
    stages = {}
    for line in (logs / "stages.tsv").read_text().splitlines():
        name, rc, seconds = line.split("\t")
        log = logs / f"{name}.log"
        stages[name] = {"status": status(rc), "exit": rc if rc == "budget" else int(rc), "seconds": int(seconds),
                        "log_tail": log.read_text(errors="replace")[-TAIL:] if log.exists() else ""}
        tests = junit(logs / f"{name}.xml")
        if tests is not None:
            stages[name]["tests"] = tests
    return stages


def main(log_dir: str, out_dir: str, total_s: str, call: str = "all", dry_run: str = "0") -> None:
    logs, out = Path(log_dir), Path(out_dir)
    stages = stages_of(logs)
    figures = {}
    for path in sorted(logs.glob("*.json")):
        try:
            figures[path.stem] = json.loads(path.read_text())
        except ValueError:   # a stage killed while writing it
            figures[path.stem] = {"unreadable": path.read_text(errors="replace")[-300:]}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "call": call, "dry_run": dry_run == "1", "host": platform.node(), "total_seconds": int(total_s),
              "ok": all(s["status"] == "ok" and not s.get("tests", {}).get("failed") for s in stages.values()),
              "stages": stages, "figures": figures}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    title = f"# gpu_check `{call}`{' (dry run: CPU, Triton interpreted)' if result['dry_run'] else ''}"
    lines = [title, "", f"{result['date']}, {total_s} s, host {result['host']}", "",
             "| stage | status | s | tests |", "|---|---|---|---|"]
    for name, stage in stages.items():
        tests = stage.get("tests")
        summary = f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped" if tests else ""
        lines.append(f"| {name} | {stage['status']} | {stage['seconds']} | {summary} |")
    for name, stage in stages.items():
        for failure in stage.get("tests", {}).get("failures", []):
            lines.append(f"- FAILED {failure}")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:6])

"""Fold scripts/gpu_check.sh's logs into one results file: gpu_check.json and a Markdown summary.

    python scripts/gpu_check_report.py LOG_DIR OUT_DIR TOTAL_SECONDS
"""
from __future__ import annotations

import datetime
import json
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


def main(log_dir: str, out_dir: str, total_s: str) -> None:
    logs, out = Path(log_dir), Path(out_dir)
    stages = {}
    for line in (logs / "stages.tsv").read_text().splitlines():
        name, rc, seconds = line.split("\t")
        log = logs / f"{name}.log"
        stages[name] = {"exit": int(rc), "seconds": int(seconds),
                        "log_tail": log.read_text(errors="replace")[-TAIL:] if log.exists() else ""}
        tests = junit(logs / f"{name}.xml")
        if tests is not None:
            stages[name]["tests"] = tests
    figures = {path.stem: json.loads(path.read_text()) for path in sorted(logs.glob("*.json"))}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "total_seconds": int(total_s), "stages": stages, "figures": figures}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [f"# gpu_check {result['date']} ({total_s} s)", "", "| stage | exit | s | tests |", "|---|---|---|---|"]
    for name, stage in stages.items():
        tests = stage.get("tests")
        summary = f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped" if tests else ""
        lines.append(f"| {name} | {stage['exit']} | {stage['seconds']} | {summary} |")
    for name, stage in stages.items():
        for failure in stage.get("tests", {}).get("failures", []):
            lines.append(f"- FAILED {failure}")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:4])

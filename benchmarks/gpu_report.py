"""The GPU check's records and its report: one JSON file and one markdown table, rebuilt after every step.

    python benchmarks/gpu_report.py --work WORK --out OUT [--print]

Each step of scripts/gpu_check.sh leaves, in WORK/steps/:
  NN-NAME.status  written by the shell: `status`, `rc`, `seconds`, `limit`, `reason` (key=value lines);
  NN-NAME.json    written by the step's Python (`StepRecord`): its items, each a check or a figure, rewritten after
                  every item, so a step that crashes or times out keeps what it had measured.
A step's status: failed if its command failed or timed out or an item failed; skipped if it did not run or all
its items were skipped; else passed. The report is OUT/gpu_check.json, OUT/gpu_check.md (one table) and
OUT/gpu_check.log (every step's output). Pure Python: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

STATUSES = ("passed", "failed", "skipped")


class StepRecord:
    """The items of one step, written to `path` (JSON) after each one; `path` None keeps them in memory."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self.items: list[dict] = []
        if self.path and self.path.exists():  # a step may record in several processes (torchrun, pytest)
            self.items = json.loads(self.path.read_text())["items"]

    def item(self, name: str, status: str, value=None, unit: str = "", note: str = "") -> None:
        if status not in STATUSES:
            raise ValueError(f"item {name}: status {status!r}, expected one of {STATUSES}")
        if isinstance(value, float) and not math.isfinite(value):
            value, note = None, f"{note} (not finite)".strip()
        self.items.append({"name": name, "status": status, "value": value, "unit": unit, "note": note})
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"items": self.items}, indent=1, default=str))
            os.replace(tmp, self.path)

    def figure(self, name: str, value, unit: str = "", note: str = "") -> None:
        """A measurement: passed when it could be taken."""
        self.item(name, "passed", value, unit, note)

    @property
    def failed(self) -> bool:
        return any(i["status"] == "failed" for i in self.items)


def read_status(path: Path) -> dict:
    fields = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        fields[key.strip()] = value.strip()
    for key in ("rc", "limit"):
        if fields.get(key, "").lstrip("-").isdigit():
            fields[key] = int(fields[key])
    if "seconds" in fields:
        fields["seconds"] = float(fields["seconds"])
    return fields


def step_status(shell: dict, items: list[dict]) -> tuple[str, str]:
    """(status, reason) of a step from what the shell saw and what the step recorded."""
    if shell.get("status") == "skipped":
        return "skipped", shell.get("reason", "")
    if shell.get("status") == "running":
        return "failed", "still running when the check stopped"
    if shell.get("rc", 0) != 0:
        return "failed", shell.get("reason") or f"exit {shell.get('rc')}"
    failed = [i["name"] for i in items if i["status"] == "failed"]
    if failed:
        return "failed", f"{len(failed)} item(s) failed: {', '.join(failed[:4])}"
    if items and all(i["status"] == "skipped" for i in items):
        return "skipped", items[0]["note"]
    return "passed", ""


def collect(work: Path) -> list[dict]:
    steps = []
    for status_file in sorted((work / "steps").glob("*.status")):
        shell = read_status(status_file)
        record = status_file.with_suffix(".json")
        items = json.loads(record.read_text())["items"] if record.exists() else []
        status, reason = step_status(shell, items)
        name = status_file.stem.split("-", 1)[1]
        log = work / "logs" / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        steps.append({"step": name, "status": status, "reason": reason, "seconds": shell.get("seconds"),
                      "limit_s": shell.get("limit"), "command": shell.get("command", ""), "items": items,
                      "log_tail": tail if status == "failed" else []})  # fmt: skip
    return steps


def format_value(value, unit: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    elif isinstance(value, int):
        text = f"{value:,}"
    else:
        text = str(value)
    return f"{text} {unit}".strip()


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"# GPU check{' (dry run)' if report['dry_run'] else ''}: {report['summary_line']}",
        "",
        f"{meta.get('device', '?')}; {meta.get('versions', '')}; {report['elapsed_s']:.0f} s of a "
        f"{report['budget_s']} s budget; started {report['started']}.",
        "",
        "| step / item | status | figure | note |",
        "|---|---|---:|---|",
    ]
    for step in report["steps"]:
        seconds = f"{step['seconds']:.0f} s" if step["seconds"] is not None else ""
        lines.append(f"| **{step['step']}** | **{step['status']}** | {seconds} | {cell(step['reason'])} |")
        for item in step["items"]:
            value = format_value(item["value"], item["unit"])
            lines.append(f"| {cell(item['name'])} | {item['status']} | {cell(value)} | {cell(item['note'])} |")
    for step in report["steps"]:
        if step["log_tail"]:
            lines += ["", f"`{step['step']}` failed; the end of its log (all of it: gpu_check.log):", "", "```"]
            lines += step["log_tail"] + ["```"]
    return "\n".join(lines) + "\n"


def build(work: Path, out: Path) -> dict:
    steps = collect(work)
    counts = {s: sum(step["status"] == s for step in steps) for s in STATUSES}
    meta_file = work / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    started = float(meta.get("started", time.time()))
    report = {
        "dry_run": bool(meta.get("dry_run")),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "elapsed_s": round(time.time() - started, 1),
        "budget_s": meta.get("budget_s"),
        "summary": counts,
        "summary_line": ", ".join(f"{counts[s]} {s}" for s in STATUSES),
        "meta": meta,
        "steps": steps,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    with open(out / "gpu_check.log", "w") as log:
        for step in steps:
            path = work / "logs" / f"{step['step']}.log"
            log.write(f"===== {step['step']}: {step['status']} {step['reason']}\n$ {step['command']}\n")
            log.write(path.read_text(errors="replace")[-200_000:] if path.exists() else "(no output)\n")
            log.write("\n")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--print", action="store_true", help="print the markdown table")
    args = parser.parse_args()
    build(args.work, args.out)
    if args.print:
        print((args.out / "gpu_check.md").read_text())


if __name__ == "__main__":
    main()

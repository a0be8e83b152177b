"""The GPU check's own logic, fast: the carried wheel list, the wheel folder check, the report, the step runner.

The whole dry run (`bash scripts/gpu_check.sh --dry-run`, about 1.5-3 minutes here: every step at toy size on
the CPU) is a step of .ci/run, not of the default suite; these tests cover what it decides with small inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_deps  # noqa: E402
import gpu_report  # noqa: E402


def test_the_pinned_list_covers_every_runtime_dependency_the_image_lacks():
    pins = gpu_deps.read_pins()
    assert gpu_deps.coverage_problems(pins, gpu_deps.runtime_requirements()) == []
    names = {p.name for p in pins}
    assert {"pydantic", "pydantic-core", "annotated-types", "typing-inspection"} <= names
    assert not names & {"torch", "triton", "transformers"}  # never carried: the image has them


def test_coverage_names_an_unpinned_dependency_and_a_pin_outside_the_range():
    pins = gpu_deps.read_pins()
    problems = gpu_deps.coverage_problems(pins, [Requirement("newdep>=1"), Requirement("pydantic>=99")])
    assert len(problems) == 2
    assert problems[0].startswith("newdep: a runtime dependency the image lacks, not pinned")
    assert "pydantic==" in problems[1] and "pydantic>=99" in problems[1]


@pytest.mark.parametrize("line", ["pydantic>=2.7", "pydantic", "pydantic==2.*", "not a requirement ==="])
def test_a_bad_pin_is_a_one_line_error_naming_the_line(tmp_path, line):
    path = tmp_path / "pins.txt"
    path.write_text(f"# comment\nrich==15.0.0\n{line}\n")
    with pytest.raises(ValueError, match=r"pins.txt:3: "):
        gpu_deps.read_pins(path)


def fake_wheel(folder: Path, filename: str, requires: list[str] = ()) -> Path:
    name, version = filename.split("-")[:2]
    path = folder / filename
    with zipfile.ZipFile(path, "w") as archive:
        headers = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        headers += [f"Requires-Dist: {r}" for r in requires]
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(headers) + "\n\nlong description\n")
    return path


def test_check_wheels_wants_each_pin_for_cpython_312_manylinux_with_its_requirements(tmp_path):
    pins = [gpu_deps.Pin("alpha", "1.0", 1), gpu_deps.Pin("beta", "2.0", 2), gpu_deps.Pin("gamma", "3.0", 3)]
    pins += [gpu_deps.Pin("delta", "4.0", 4), gpu_deps.Pin("epsilon", "5.0", 5)]
    fake_wheel(tmp_path, "alpha-1.0-py3-none-any.whl", ["beta>=2", "torch>=2", "windows-only; sys_platform == 'win32'"])
    fake_wheel(tmp_path, "beta-2.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    fake_wheel(tmp_path, "gamma-3.0-cp312-cp312-macosx_11_0_arm64.whl")  # another platform
    fake_wheel(tmp_path, "delta-4.0-py3-none-any.whl", ["missing>=1"])  # an unpinned requirement
    fake_wheel(tmp_path, "zeta-6.0-py3-none-any.whl")  # no pin names it
    records = {r["name"]: r for r in gpu_deps.check_wheels(tmp_path, pins)}
    assert records["alpha"]["status"] == "passed" and records["beta"]["status"] == "passed"
    assert records["gamma"] == dict(
        name="gamma",
        status="failed",
        note="gamma-3.0-cp312-cp312-macosx_11_0_arm64.whl: not for CPython 3.12 manylinux x86_64",
    )
    assert records["delta"]["status"] == "failed" and records["delta"]["note"] == "requires missing>=1: not pinned"
    assert records["epsilon"] == dict(name="epsilon", status="failed", note="no wheel epsilon==5.0")
    assert records["zeta"]["status"] == "failed"
    assert [p.name for p in gpu_deps.prune_wheels(tmp_path, pins)] == ["zeta-6.0-py3-none-any.whl"]


def write_step(work: Path, index: int, name: str, shell: str, items: list[tuple] = ()) -> None:
    (work / "steps").mkdir(parents=True, exist_ok=True)
    (work / "steps" / f"{index:02d}-{name}.status").write_text(shell)
    record = gpu_report.StepRecord(work / "steps" / f"{index:02d}-{name}.json")
    for item in items:
        record.item(*item)


def test_report_derives_each_steps_status_and_writes_json_markdown_and_log(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    write_step(work, 1, "ok", "status=done\nrc=0\nseconds=3\nlimit=60\ncommand=a\n", [("speed", "passed", 1234.5, "tokens/s", "")])  # fmt: skip
    write_step(work, 2, "item", "status=done\nrc=1\nseconds=2\nlimit=60\ncommand=b\n", [("parity", "failed", 0.3, "nats", "bound 0.05")])  # fmt: skip
    write_step(work, 3, "slow", "status=done\nrc=124\nseconds=60\nlimit=60\nreason=timed out after 60 s\ncommand=c\n")
    write_step(work, 4, "late", "status=skipped\nreason=5 s of the 470 s budget left, the step needs 30\ncommand=d\n")
    write_step(work, 5, "nogpu", "status=done\nrc=0\nseconds=1\nlimit=60\ncommand=e\n", [("loss", "skipped", None, "", "no CUDA")])  # fmt: skip
    write_step(work, 6, "cut", "status=running\nlimit=60\ncommand=f\n", [("half", "passed", 1, "", "")])
    (work / "logs").mkdir()
    (work / "logs" / "slow.log").write_text("line 1\nlast words\n")
    (work / "meta.json").write_text(json.dumps({"started": 0, "dry_run": False, "budget_s": 470, "device": "X"}))
    report = gpu_report.build(work, out)
    status = {s["step"]: (s["status"], s["reason"]) for s in report["steps"]}
    assert status == {
        "ok": ("passed", ""),
        "item": ("failed", "exit 1"),
        "slow": ("failed", "timed out after 60 s"),
        "late": ("skipped", "5 s of the 470 s budget left, the step needs 30"),
        "nogpu": ("skipped", "no CUDA"),
        "cut": ("failed", "still running when the check stopped"),
    }
    assert report["summary"] == {"passed": 1, "failed": 3, "skipped": 2}
    saved = json.loads((out / "gpu_check.json").read_text())
    assert saved["steps"][1]["items"][0] == {"name": "parity", "status": "failed", "value": 0.3, "unit": "nats", "note": "bound 0.05"}  # fmt: skip
    table = (out / "gpu_check.md").read_text()
    assert "| **slow** | **failed** | 60 s | timed out after 60 s |" in table
    assert "| speed | passed | 1,234 tokens/s |  |" in table and "| parity | failed | 0.3 nats | bound 0.05 |" in table
    assert "last words" in table  # a failed step's log tail
    assert "===== slow: failed timed out after 60 s\n$ c\nline 1\nlast words" in (out / "gpu_check.log").read_text()


def test_a_non_finite_figure_is_recorded_as_none_and_a_bad_status_refused(tmp_path):
    record = gpu_report.StepRecord(tmp_path / "r.json")
    record.item("x", "passed", float("nan"), "s", "n")
    assert json.loads((tmp_path / "r.json").read_text())["items"][0]["value"] is None
    with pytest.raises(ValueError, match="status 'ok'"):
        record.item("y", "ok")


def test_gpu_check_sh_records_a_failed_step_skips_what_the_budget_cannot_fit_and_exits_1(tmp_path):
    """A dry run of two steps: the wheel check fails on a folder with a wrong wheel, the next is out of budget
    (a budget of 19 s: 10 are kept for the report, the install step gets the other 9, imports needs 10)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "pydantic-0.1-py3-none-any.whl")
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--steps", "install,imports", "--budget", "19",
         "--wheels", str(wheels), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    assert [(s["step"], s["status"]) for s in report["steps"]] == [("install", "failed"), ("imports", "skipped")]
    install, imports = report["steps"]
    items = {i["name"]: i for i in install["items"]}
    assert items["pinned list"]["status"] == "passed"
    assert items["wheel pydantic"]["note"].startswith("no wheel pydantic==")
    assert "budget" in imports["reason"]
    assert "| **install** | **failed** |" in (out / "gpu_check.md").read_text()
    assert "| **install** | **failed** |" in run.stdout  # the table is printed at the end


def test_run_pytest_records_each_failure_and_stops_at_the_deadline_with_what_finished(tmp_path):
    import gpu_check

    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "import time, pytest\n"
        "def test_ok(): pass\n"
        "def test_wrong(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
    )
    record = gpu_report.StepRecord(None)
    gpu_check.run_pytest(record, "sample", [str(tests)], [], collect_only=False, deadline_s=120)
    items = {i["name"].rsplit("::", 1)[-1]: i for i in record.items}
    assert items["pytest (sample)"]["status"] == "failed"
    assert items["pytest (sample)"]["note"] == "1 passed, 1 failed, 1 skipped"
    assert items["test_wrong"]["status"] == "failed" and "one is not two" in items["test_wrong"]["note"]

    tests.write_text("import time\ndef test_ok(): pass\ndef test_hangs(): time.sleep(600)\n")
    record = gpu_report.StepRecord(None)
    gpu_check.run_pytest(record, "sample", [str(tests)], [], collect_only=False, deadline_s=8)
    summary = record.items[0]
    assert summary["status"] == "failed" and summary["note"] == "stopped after 8 s: 1 passed"

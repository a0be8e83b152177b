"""The GPU check's dependencies: the carried wheels, what the image lacks, installing offline, version gaps.

    python benchmarks/gpu_deps.py check --wheels .gpu_wheels --record FILE     # the dry run's wheel step
    python benchmarks/gpu_deps.py install --wheels .gpu_wheels --record FILE   # on the GPU machine, offline
    python benchmarks/gpu_deps.py versions --record FILE                       # pyproject's pins vs installed
    python benchmarks/gpu_deps.py prune-wheels --wheels .gpu_wheels            # drop wheels no pin names

The lent GPU machine has no network. Its image has the packages of IMAGE_HAS (and, through them, IMAGE_BRINGS);
every other runtime dependency of pyproject.toml is assumed missing and travels as a wheel pinned in
benchmarks/gpu_wheels.txt, except IMAGE_LACKS_UNCARRIED (large, and imported by no code path the check runs).
Pure Python (no torch): the dry run and tests/test_gpu_check.py run it on a CPU machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "benchmarks" / "gpu_wheels.txt"
PYPROJECT = ROOT / "pyproject.toml"

# What the lent machine's image is said to have (docs/gpu.md), and what those packages require in turn.
IMAGE_HAS = {"torch", "transformers", "pyarrow", "typer", "xxhash", "pytest", "hypothesis"}
IMAGE_BRINGS = {"triton": "torch's CUDA wheels require it", "huggingface-hub": "transformers requires it"}
# Runtime dependencies the image lacks that are not carried: big, and no code path of the check imports them.
IMAGE_LACKS_UNCARRIED = {
    "matplotlib": "plots only (`opd report`, the demo); with pillow, fonttools, kiwisolver, ... ~20 MB of wheels",
    "datasets": "hub and save_to_disk prompt folders only (opd_cache/tasks/prompts.py); needs pandas (~12 MB)",
}
OPTIONAL_PINS = {"liger-kernel": "the loss benchmark's outside reference"}

# The lent machine: CPython 3.12 on manylinux x86_64 (glibc >= 2.17).
TARGET_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}  # fmt: skip
TARGET_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]


def target_tags() -> set[Tag]:
    """Every wheel tag CPython 3.12 on manylinux_2_17 x86_64 accepts."""
    tags = set(cpython_tags((3, 12), abis=["cp312", "abi3", "none"], platforms=TARGET_PLATFORMS))
    return tags | set(compatible_tags((3, 12), "cp312", platforms=TARGET_PLATFORMS))


@dataclass(frozen=True)
class Pin:
    name: str  # canonical (pydantic-core)
    version: str
    line: int


def read_pins(path: Path = PINS) -> list[Pin]:
    """The pinned list: `name==version` a line, `#` comments; a bad line is a one-line error naming it."""
    pins, seen = [], set()
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            req = Requirement(text)
        except Exception as e:
            raise ValueError(f"{path}:{number}: {text!r} is not a requirement ({e})") from None
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version or req.extras or req.marker:
            raise ValueError(f"{path}:{number}: {text!r}: expected one exact pin, name==version")
        Version(specs[0].version)  # a valid version
        name = canonicalize_name(req.name)
        if name in seen:
            raise ValueError(f"{path}:{number}: {name} is pinned twice")
        seen.add(name)
        pins.append(Pin(name, specs[0].version, number))
    return pins


def runtime_requirements(pyproject: Path = PYPROJECT) -> list[Requirement]:
    import tomllib

    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def coverage_problems(pins: list[Pin], requirements: list[Requirement]) -> list[str]:
    """Runtime dependencies neither in the image, nor pinned, nor knowingly left out; pins of other versions."""
    pinned = {p.name: p for p in pins}
    problems = []
    for req in requirements:
        name = canonicalize_name(req.name)
        if name in IMAGE_HAS or name in IMAGE_LACKS_UNCARRIED:
            continue
        if name not in pinned:
            problems.append(f"{name}: a runtime dependency the image lacks, not pinned in {PINS.name}")
        elif not req.specifier.contains(pinned[name].version, prereleases=True):
            problems.append(f"{name}=={pinned[name].version} does not satisfy pyproject's {req}")
    return problems


# ---------------------------------------------------------------- the wheels folder
def wheel_requirements(path: Path) -> list[Requirement]:
    """A wheel's Requires-Dist that apply on the target (extras and other platforms left out)."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode("utf-8", "replace").splitlines()
    reqs = []
    for line in lines:
        if not line.strip():
            break  # the headers end at the first blank line
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(TARGET_ENV):
                reqs.append(req)
    return reqs


def check_wheels(wheels: Path, pins: list[Pin]) -> list[dict]:
    """One record per pin: its wheel file, installable on the target, and whose requirements are all met."""
    tags = target_tags()
    files = {}
    for path in sorted(wheels.glob("*.whl")):
        name, version, _, file_tags = parse_wheel_filename(path.name)
        files.setdefault(canonicalize_name(name), []).append((str(version), file_tags, path))
    versions = {p.name: p.version for p in pins}
    records = []
    for pin in pins:
        found = [f for f in files.get(pin.name, []) if Version(f[0]) == Version(pin.version)]
        usable = [f for f in found if f[1] & tags]
        if not found:
            records.append(dict(name=pin.name, status="failed", note=f"no wheel {pin.name}=={pin.version}"))
            continue
        if not usable:
            records.append(dict(name=pin.name, status="failed", note=f"{found[0][2].name}: not for CPython 3.12 manylinux x86_64"))  # fmt: skip
            continue
        path = usable[0][2]
        unmet = []
        for req in wheel_requirements(path):
            dep = canonicalize_name(req.name)
            if dep in IMAGE_HAS or dep in IMAGE_BRINGS:
                continue
            if dep not in versions or not req.specifier.contains(versions[dep], prereleases=True):
                unmet.append(str(req))
        status = "failed" if unmet else "passed"
        note = f"requires {', '.join(unmet)}: not pinned" if unmet else path.name
        records.append(dict(name=pin.name, status=status, value=path.stat().st_size, unit="bytes", note=note))
    for name in sorted(set(files) - set(versions)):
        records.append(dict(name=name, status="failed", note="a wheel no pin names (bash scripts/gpu_wheels.sh prunes it)"))  # fmt: skip
    return records


def prune_wheels(wheels: Path, pins: list[Pin]) -> list[Path]:
    wanted = {(p.name, Version(p.version)) for p in pins}
    removed = []
    for path in wheels.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(path.name)
        if (canonicalize_name(name), version) not in wanted:
            path.unlink()
            removed.append(path)
    return removed


# ---------------------------------------------------------------- what is installed
def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_gaps(requirements: list[Requirement]) -> list[dict]:
    """pyproject's pin of each runtime dependency against the installed version: ok, gap (too old) or missing."""
    records = []
    for req in requirements:
        name = canonicalize_name(req.name)
        have = installed_version(name)
        if have is None and name in IMAGE_LACKS_UNCARRIED:
            why = IMAGE_LACKS_UNCARRIED[name]
            records.append(dict(name=name, status="skipped", value=None, note=f"missing, not carried: {why}"))
        elif have is None:
            records.append(dict(name=name, status="failed", value=None, note=f"missing; pyproject: {req}"))
        elif req.specifier.contains(have, prereleases=True):
            records.append(dict(name=name, status="passed", value=have, note=f"pyproject: {req}"))
        else:
            records.append(dict(name=name, status="failed", value=have, note=f"version gap: pyproject needs {req}"))
    return records


def wheel_of(wheels: Path, pin: Pin) -> Path | None:
    tags = target_tags() | _running_tags()
    for path in sorted(wheels.glob("*.whl")):
        name, version, _, file_tags = parse_wheel_filename(path.name)
        if canonicalize_name(name) == pin.name and version == Version(pin.version) and file_tags & tags:
            return path
    return None


def _running_tags() -> set[Tag]:
    from packaging.tags import sys_tags

    return set(sys_tags())


def unpack(wheels: Path, pins: list[Pin], name: str, site: Path, done: set[str] | None = None) -> list[str]:
    """Without a working pip: extract the pinned wheel of `name`, and of each requirement of it that is not
    installed in a version it accepts, into `site` (a folder on PYTHONPATH); returns what was extracted."""
    done = set() if done is None else done
    pin = next((p for p in pins if p.name == name), None)
    path = wheel_of(wheels, pin) if pin else None
    if path is None or name in done:
        return []
    done.add(name)
    with zipfile.ZipFile(path) as archive:
        archive.extractall(site)
    extracted = [f"{name}=={pin.version}"]
    for req in wheel_requirements(path):
        have = installed_version(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            extracted += unpack(wheels, pins, canonicalize_name(req.name), site, done)
    return extracted


def install(wheels: Path, requirements: list[Requirement], pins: list[Pin], site: Path | None = None) -> list[dict]:
    """pip install, offline from `wheels`, every runtime dependency that is missing or too old, the optional pins
    whose wheel is there, then the project itself (editable, --no-deps); one record each.

    When pip cannot install a package (no pip, an externally managed interpreter, ...) and `site` is given, its
    wheel and its missing requirements are extracted into `site` instead (the check puts it on PYTHONPATH).
    """
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
           "--disable-pip-version-check", "--no-input"]  # fmt: skip
    carried = {p.name for p in pins}
    wanted, records = [], []
    for req in requirements:
        name, have = canonicalize_name(req.name), installed_version(req.name)
        if have is not None and req.specifier.contains(have, prereleases=True):
            records.append(dict(name=name, status="passed", value=have, note="already installed"))
        elif name in carried:
            wanted.append((name, str(req)))
        else:
            why = IMAGE_LACKS_UNCARRIED.get(name, "not in benchmarks/gpu_wheels.txt")
            records.append(dict(name=name, status="skipped", value=have, note=f"missing, not carried: {why}"))
    for name in OPTIONAL_PINS:
        pin = next((p for p in pins if p.name == name), None)
        if pin and installed_version(name) is None and wheel_of(wheels, pin) is not None:
            wanted.append((name, f"{name}=={pin.version}"))
    for name, spec in wanted:
        # one package a call: a wheel that does not install does not stop the others
        out = subprocess.run([*pip, spec], capture_output=True, text=True)
        if out.returncode == 0:
            records.append(dict(name=name, status="passed", value=installed_version(name), note="installed from the wheels"))  # fmt: skip
            continue
        why = (out.stderr.strip().splitlines() or ["pip failed"])[-1][:160]
        extracted = unpack(wheels, pins, name, site) if site is not None else []
        if extracted:
            note = f"pip failed ({why}); extracted {', '.join(extracted)} into {site}"
            records.append(dict(name=name, status="passed", value=spec, note=note))
        else:
            records.append(dict(name=name, status="failed", value=None, note=f"pip: {why}"))
    out = subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], capture_output=True, text=True)
    last = (out.stderr.strip().splitlines() or ["pip failed"])[-1][:160]
    records.append(dict(name="opd-cache (editable)", status="passed" if out.returncode == 0 else "skipped",
                        note="pip install --no-index --no-deps -e ." if out.returncode == 0
                        else f"{last}; the check runs from the checkout (PYTHONPATH) instead"))  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["check", "install", "versions", "prune-wheels"])
    parser.add_argument("--wheels", type=Path, default=ROOT / ".gpu_wheels")
    parser.add_argument("--record", type=Path, help="append the records to this step record (gpu_report.py)")
    parser.add_argument("--site", type=Path, help="install: extract wheels here when pip cannot install them")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_report import StepRecord

    pins = read_pins()
    if args.action == "prune-wheels":
        for path in prune_wheels(args.wheels, pins):
            print(f"removed {path.name}: no pin names it")
        return
    record = StepRecord(args.record) if args.record else StepRecord(None)
    requirements = runtime_requirements()
    if args.action == "check":
        problems = coverage_problems(pins, requirements)
        record.item("pinned list", "failed" if problems else "passed", len(pins), "pins",
                    "; ".join(problems) or f"{PINS.name} parses and covers pyproject's runtime dependencies")  # fmt: skip
        if not args.wheels.is_dir():
            record.item("wheels folder", "skipped", note=f"{args.wheels} absent: run bash scripts/gpu_wheels.sh")
        else:
            records = check_wheels(args.wheels, pins)
            for r in records:
                record.item(f"wheel {r['name']}", r["status"], r.get("value"), r.get("unit", ""), r["note"])
            total = sum(f.stat().st_size for f in args.wheels.glob("*.whl"))
            record.item("wheels total", "passed", round(total / 2**20, 1), "MiB", f"{args.wheels}")
    elif args.action == "install":
        for r in install(args.wheels, requirements, pins, args.site):
            record.item(f"install {r['name']}", r["status"], r.get("value"), "", r["note"])
    else:
        for r in version_gaps(requirements):
            record.item(f"version {r['name']}", r["status"], r.get("value"), "", r["note"])
    for item in record.items:
        print(f"{item['status']:>7}  {item['name']}: {item.get('value')} {item.get('note', '')}")
    sys.exit(1 if record.failed else 0)


if __name__ == "__main__":
    main()

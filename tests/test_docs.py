"""Docs that are generated from code must match the code."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_up_to_date():
    out = subprocess.run(
        [sys.executable, "scripts/config_reference.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr

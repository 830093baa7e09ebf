"""Smoke test of benchmarks/surrogate_settings.py: a miniature run prints a row per variant."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "surrogate_settings.py"


def test_smoke_run_prints_each_variant():
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--settings",
            "breast_cancer",
            "--variants",
            "(default),representer",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    names = [r.split("|")[1].strip() for r in rows]
    (default,) = [n for n in names if n.endswith("(default)")]
    assert default.startswith("centred smoother, readable α")
    assert "representer (loss residuals)" in names
    default = rows[names.index(default)].split("|")[2:-1]
    assert len(default) == 8 and all(c.strip() != "nan" for c in default)

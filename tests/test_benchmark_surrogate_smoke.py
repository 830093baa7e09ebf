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


def test_the_faithful_fraction_is_the_best_worst_tau_ties_to_the_stronger_damping():
    """The Gauss–Newton machine's default fraction: the best worst label-fitted τ over the
    settings, not the smallest fraction that clears 0.85 on them (which, chosen on three
    settings, left the fourth at 0.846); equal worst τ goes to the smaller fraction."""
    sys.path.insert(0, str(SCRIPT.parents[1]))
    from benchmarks.surrogate_settings import faithful_fraction

    tau = {("a", 0.05): 0.86, ("a", 0.1): 0.9, ("a", 0.5): 0.95}
    tau |= {("b", 0.05): 0.85, ("b", 0.1): 0.8, ("b", 0.5): 0.94}
    assert faithful_fraction(tau, ["a", "b"], [0.05, 0.1, 0.5]) == 0.5
    assert faithful_fraction(tau, ["b"], [0.1, 0.05]) == 0.05
    flat = {(n, f): 0.9 for n in "ab" for f in (0.05, 0.5)}
    assert faithful_fraction(flat, ["a", "b"], [0.5, 0.05]) == 0.05


def test_fractions_smoke_run_holds_out_each_setting_and_reports_the_unseen_one():
    """--fractions: a row per setting and fraction, a leave-one-setting-out row per setting the
    choice reads (settings.NAMES), the never-chosen setting at the in-sample fractions."""
    fractions = ("0.015", "0.5")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--fractions", ",".join(fractions)]
        + ["--settings", "breast_cancer,wine_mlp,synth_mlp"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    measured, held_out = (
        [
            [c.strip() for c in line.strip().strip("|").split("|")]
            for line in part.splitlines()
            if line.startswith("| ") and not line.startswith(("| setting", "| held out"))
        ]
        for part in proc.stdout.split("| held out |")
    )
    names = ("breast_cancer", "wine_mlp", "synth_mlp")
    assert sorted((r[0], r[1]) for r in measured) == sorted(
        (n, f) for n in names for f in fractions
    )
    assert [r[0] for r in held_out] == ["breast_cancer", "wine_mlp", "synth_mlp (never chosen on)"]
    assert all(r[1] in fractions and r[3] in fractions for r in held_out)
    assert "in sample: faithful f = " in proc.stdout

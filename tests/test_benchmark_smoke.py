"""Smoke tests of the benchmarks: quick runs print their tables."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "entk_speed.py"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_quick_run_prints_a_table_of_our_methods():
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--no-peers",
            "--cases",
            "mlp,trace",
            "--trace-sizes",
            "64",
            "--repeats",
            "1",
            "--skip",
            "ours:jacobian,ours:ntk_vp",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(
        i for i, line in enumerate(lines) if line.startswith("| case | method | median s")
    )
    rows = {(c[0], c[1]): c for c in map(_cells, lines[header + 2 :]) if len(c) == 11}
    structured = rows[("mlp, N=16, full", "ours, structured")]
    auto = rows[("mlp, N=16, full", "ours, auto")]
    for row in (structured, auto):
        assert float(row[2]) > 0 and float(row[5]) >= 0  # median time, memory
    assert float(auto[9]) < 1e-5  # same kernel as structured
    assert rows[("mlp, N=16, full", "ours, jacobian")][10].startswith("skipped")
    assert rows[("mlp, N=64, trace", "ours, auto, tile 32")][7] == "32"
    assert re.search(r"\| mlp, N=64, trace \| ours, auto, tile auto \| [0-9.]+ \|", proc.stdout)


def _run(script: str, *args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.slow  # tens of seconds on 2 shared cores
def test_quick_engine_leftovers_print_auto_picks_and_overhead():
    lines = _run("hf_engine.py", "--models", "cnn")
    auto = [_cells(line) for line in lines if line.startswith("| CNN")][:2]
    assert [row[1] for row in auto] == ["full", "trace"]
    assert all(row[5] in ("jacobian", "structured") and float(row[6]) > 0 for row in auto)
    overhead = [_cells(line) for line in lines if line.startswith("| Linear 2→2")]
    assert len(overhead) == 1 and float(overhead[0][1]) > 0


def test_quick_precision_run_prints_the_resnet_ratio():
    lines = _run("precision.py", "--sections", "resnet")
    ratio = next(line for line in lines if line.startswith("influence / float32 trace eNTK"))
    assert float(re.search(r"eNTK: ([0-9.]+)", ratio).group(1)) > 0


SCALE = SCRIPT.parent / "attribution_scale.py"


@pytest.mark.slow
def test_attribution_scale_smoke_run_prints_its_table():
    """The smoke run of benchmarks/attribution_scale.py: exact rows and EK-FAC at two N, with
    time, memory and a positive rank agreement of EK-FAC with the exact kind="full" scores."""
    proc = subprocess.run(
        [sys.executable, str(SCALE), "--smoke", "--no-peers"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {(c[1], c[2]): c for c in map(_cells, proc.stdout.splitlines()) if len(c) == 9}
    assert {("100", "exact (trace)"), ("100", "exact (full)"), ("400", "ours, ekfac")} <= set(rows)
    for row in rows.values():
        if row[0] == "mlp":
            assert float(row[3]) > 0 and float(row[4]) > 0  # seconds, peak memory
    assert float(rows[("100", "ours, ekfac")][8]) > 0.3  # ρ vs exact (full)


def _run_benchmark(name: str, *args: str) -> str:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / name
    env = {k: v for k, v in os.environ.items() if k != "NTK_PEER_PYTHON"}  # no peers in smoke runs
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _table_rows(out: str, title: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("### " + title))
    rows = {}
    for line in lines[start + 4 :]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        rows[cells[0]] = cells[1:]
    return rows


def test_uncertainty_benchmark_smoke_run_scores_the_map_and_the_posterior():
    methods = "NTKPosterior (default: EK-FAC),NTKPosterior exact/validation,NTKPosterior last layer"
    out = _run_benchmark("uncertainty.py", "--settings", "breast_cancer", "--methods", methods)
    rows = _table_rows(out, "breast_cancer")
    assert set(rows) == {"MAP softmax", *methods.split(",")}
    for cells in rows.values():
        accuracy, nll, ece, brier = (float(c) for c in cells[:4])
        assert 0.5 < accuracy <= 1 and nll > 0 and 0 <= ece <= 1 and 0 <= brier <= 2
    assert float(rows["NTKPosterior exact/validation"][-3]) > 0  # seconds measured
    # paired-bootstrap intervals of the NLL and ECE differences to the MAP: ordered bounds
    intervals = [c for c in rows["NTKPosterior exact/validation"] if c.startswith("[")]
    assert len(intervals) == 2
    for cell in intervals:
        low, high = (float(v) for v in cell.strip("[]").split(","))
        assert low <= high


def test_uncertainty_benchmark_summarises_several_splits():
    """--splits 2: a table per split (different samples: different MAP metrics) and the summary
    of the means with the default's paired differences to each method."""
    method = "NTKPosterior (default: EK-FAC)"
    out = _run_benchmark(
        "uncertainty.py", "--settings", "breast_cancer", "--methods", method, "--splits", "2"
    )
    maps = [_table_rows(out, f"breast_cancer, split {i}")["MAP softmax"] for i in (0, 1)]
    assert maps[0][:4] != maps[1][:4]
    rows = _table_rows(out, "breast_cancer: means over 2 splits")
    assert set(rows) == {"MAP softmax", method}
    nll, ece = (float(c) for c in rows["MAP softmax"][:2])
    assert nll == pytest.approx(sum(float(m[1]) for m in maps) / 2, abs=1e-4)
    assert ece == pytest.approx(sum(float(m[2]) for m in maps) / 2, abs=1e-4)
    assert float(rows[method][2]) > 0 and rows[method][3:] == ["–"] * 4  # seconds; no self-Δ
    for cell in (rows["MAP softmax"][3], rows["MAP softmax"][5]):
        low, high = (float(v) for v in cell.strip("[]").split(","))
        assert low <= high
    assert all(
        re.fullmatch(r"[0-2] / 2", c) for c in (rows["MAP softmax"][4], rows["MAP softmax"][6])
    )


def test_uncertainty_held_out_settings_smoke_and_never_in_the_default_list(monkeypatch):
    """seq_conv (its own shifted sets of one-hot sequences) runs when named; synth_mlp's data
    carries the tabular shifts; the default --settings (the settings the defaults were chosen
    on) never includes either. (One setting run end to end: each costs ~25 s of workers.)"""
    method = "NTKPosterior (default: EK-FAC)"
    out = _run_benchmark("uncertainty.py", "--settings", "seq_conv", "--methods", method)
    columns = " | ".join(f"auroc {name}" for name in ("dominant", "noise", "two_hot"))
    assert f"| {columns} |" in out.split("### seq_conv")[1].splitlines()[2]
    rows = _table_rows(out, "seq_conv")
    assert set(rows) == {"MAP softmax", method}
    for cells in rows.values():
        accuracy, nll, ece, brier, *aurocs = (float(c) for c in cells[:7])
        assert 0 < accuracy <= 1 and nll > 0 and 0 <= ece <= 1 and 0 <= brier <= 2
        assert all(0 <= a <= 1 for a in aurocs)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import uncertainty

    synth = uncertainty.data("synth_mlp", smoke=True)
    shifted = {k for k in synth if k.startswith("ood_")}
    assert shifted == {"ood_permuted", "ood_negated", "ood_noise"}
    assert all(synth[k].shape[1:] == synth["x_test"].shape[1:] for k in shifted)
    assert set(uncertainty.HELD_OUT_SETTINGS) == {"synth_mlp", "seq_conv"}
    assert not set(uncertainty.HELD_OUT_SETTINGS) & set(uncertainty.SETTINGS)


def test_lpntk_uses_smoke_run_prints_aucs_and_pruning_curves():
    out = _run_benchmark("lpntk_uses.py", "--settings", "breast_cancer")
    aucs = _table_rows(out, "breast_cancer: mislabel AUC")
    assert {"lpNTK contradiction", "loss", "self-influence (GN)"} <= set(aucs)
    assert all(0 <= float(cells[0]) <= 1 for cells in aucs.values())
    curves = _table_rows(out, "breast_cancer: test accuracy")
    assert set(curves) == {"lpNTK (drop redundant)", "EL2N (keep hard)", "random"}
    assert all(len(cells) == 5 for cells in curves.values())


def test_self_influence_smoke_run_prints_both_scores_aucs():
    out = _run_benchmark("self_influence.py")
    rows = [line.split() for line in out.splitlines()[1:3]]
    assert [r[0] for r in rows] == ["generated", "wine"]
    assert all(0 <= float(v) <= 1 for r in rows for v in r[-2:])
    assert "removal: mislabel AUC min" in out


def test_damping_benchmark_smoke_run_checks_the_library_default():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "damping.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--settings", "wine_mlp"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {_cells(line)[0]: _cells(line)[1:] for line in proc.stdout.splitlines() if "|" in line}
    # the library's damping="auto" is the rule's row at DOF_FRACTION = 0.015 (three classes: the
    # row also depends on where the benchmark takes the test margins' gradients, as the library)
    assert rows["library, influence(method='gauss_newton')"][0] == rows["dof fraction 0.015"][0]


def test_damping_benchmark_for_averaged_models_checks_the_library_default():
    """--ensemble: the library's influence(checkpoints=...) is the rule's row at DOF_FRACTION,
    each model's λ keeping that fraction of its own curvature, for both kinds of members."""
    from attribution.damping import DOF_FRACTION

    out = _run_benchmark("damping.py", "--settings", "wine_mlp,breast_cancer", "--ensemble", "2")
    tables = [block for block in out.split("\n\n") if block.startswith("| rule |")]
    assert len(tables) == 2
    for table in tables:
        rows = {_cells(line)[0]: _cells(line)[1:] for line in table.splitlines()}
        library = rows["library, influence(checkpoints=...)"]
        assert library == rows[f"dof fraction {DOF_FRACTION:g}"]
        assert library != rows["dof fraction 0.05"]
    assert "| wine_mlp | 2 on random halves |" in out


def test_proxy_damping_benchmark_checks_the_fixed_rule_and_chooses_leave_one_out():
    """benchmarks/proxy_damping.py: the library's influence(damping="auto") is the fixed rule's
    row (the benchmark's system is the library's), every share × weight has a row, and the
    leave-one-setting-out table names a rule per setting."""
    out = _run_benchmark("proxy_damping.py", "--settings", "wine_mlp,breast_cancer")
    rows = {_cells(line)[0]: _cells(line)[1:] for line in out.splitlines() if "|" in line}
    assert rows["library, influence(damping='auto')"][:2] == rows["fixed, dof fraction 0.015"][:2]
    assert len([key for key in rows if key.startswith("proxy, share ")]) == 20
    assert all(rows[name][0].startswith("share ") for name in ("wine_mlp", "breast_cancer"))
    assert float(rows["share 0.5: λ_p / λ₀"][0]) > 0


def test_posterior_prior_smoke_run_scores_the_library_default():
    """benchmarks/posterior_prior.py: the leave-one-setting-out table, and the library's default
    fit reproduces the benchmark's rule at EFFECTIVE_PARAMETERS, TRAINING_VARIANCE_RATIO and
    SHAPE_EFFECTIVE_PARAMETERS (which must lie on its grid)."""
    from attribution.posterior import (
        EFFECTIVE_PARAMETERS,
        SHAPE_EFFECTIVE_PARAMETERS,
        TRAINING_VARIANCE_RATIO,
    )

    out = _run_benchmark("posterior_prior.py")
    rows = {_cells(line)[0]: _cells(line)[1:] for line in out.splitlines() if line.startswith("|")}
    assert {"breast_cancer", "wine"} <= set(rows)
    for name in ("breast_cancer", "wine"):
        nll = [float(v) for v in rows[name][1].split("/")]
        assert len(nll) == 3 and all(v > 0 for v in nll)
    rule = (
        f"γ {EFFECTIVE_PARAMETERS:.3g} / ρ {TRAINING_VARIANCE_RATIO:g} / "
        f"shape γ {SHAPE_EFFECTIVE_PARAMETERS:.3g}"
    )
    assert f"library rule ({rule})" in out
    checks = [line for line in out.splitlines() if "NTKPosterior(model).fit test NLL" in line]
    assert len(checks) == 2
    for line in checks:
        library, row = (float(part.split()[-1]) for part in line.split(","))
        assert library == pytest.approx(row, rel=1e-6)


def test_posterior_regression_smoke_run():
    """benchmarks/posterior_regression.py: a row per setting with every rule's test NLL, the
    default's noise above the training residual (the joint evidence's σ² = (RSS + λ‖θ*‖²)/(N·O)),
    and a held-out pick among the rules."""
    out = _run_benchmark("posterior_regression.py")
    rows = {_cells(line)[0]: _cells(line)[1:] for line in out.splitlines() if line.startswith("|")}
    assert {"diabetes_30ep", "sine_gap"} <= set(rows)
    for name in ("diabetes_30ep", "sine_gap"):
        train_mse = float(rows[name][0].split("/")[0])
        assert float(rows[name][1]) > train_mse
        assert all(float(v) == float(v) for v in rows[name][2:9])  # finite NLLs
        assert rows[name][9].split(" (")[0] in ("previous default", "evidence δ", "default")


def test_checkpoints_benchmark_smoke_run_checks_the_library_average():
    """benchmarks/checkpoints.py: influence(checkpoints=...) reproduces the scheme it averages,
    the leave-one-setting-out table has a row per setting, and the ensemble line is printed."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoints.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--smoke",
            "--no-peers",
            "--ensemble",
            "2",
            "--settings",
            "breast_cancer,wine_mlp",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {
        _cells(line)[0]: _cells(line)[1:]
        for line in proc.stdout.splitlines()
        if line.startswith("|")
    }
    library = rows["library: influence(checkpoints=4 evenly spaced)"]
    assert library == rows["gauss_newton: 4 evenly spaced (1/4, 1/2, 3/4, 1)"]
    assert {"breast_cancer", "wine_mlp"} <= set(rows)
    assert re.search(r"ensemble of 2 runs: final models -?\d\.\d{3}, checkpoints", proc.stdout)


def test_projected_influence_smoke_run_agrees_across_ways():
    """benchmarks/projected_influence.py: streamed, stored and all-in-memory features give the
    same scores."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "projected_influence.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    rows = [_cells(line) for line in proc.stdout.splitlines() if line.startswith("| 200 |")]
    ways = {cells[1]: float(cells[4]) for cells in rows if cells[4] != "–"}
    assert set(ways) == {"all features in memory", "streamed", "from a store"}
    assert max(ways.values()) < 1e-6


def test_training_logits_smoke_run_prints_every_share_and_the_held_out_choice():
    """benchmarks/training_logits.py: a row per share and the network's logits, the
    leave-one-setting-out table with a row per setting, and the ensemble / checkpoint lines."""
    out = _run_benchmark(
        "training_logits.py",
        "--settings",
        "breast_cancer,wine_mlp",
        "--fractions",
        "0.03,0.06",
        "--ensemble",
        "2",
        "--checkpoints",
    )
    rows = {_cells(line)[0]: _cells(line)[1:] for line in out.splitlines() if line.startswith("|")}
    assert {"network's logits", "flow to 0.03 of the directions"} <= set(rows)
    assert all(-1 <= float(v) <= 1 for v in rows["network's logits"])
    assert rows["breast_cancer"][0] in ("0.03", "0.06") and rows["wine_mlp"][0] in ("0.03", "0.06")
    for members in ("2 seeds on all the data", "2 on random halves"):
        ensemble = [r for r in rows if r.startswith(f"{members}, ")]  # network's, the flow's
        assert len(ensemble) == 2 and f"{members}, network's logits" in ensemble
        for cells in (rows[r] for r in ensemble):  # breast_cancer, wine_mlp, mean
            assert len(cells) == 3 and all(-1 <= float(v) <= 1 for v in cells)
    assert "one run's checkpoints after 1/4 and 1/2" in out

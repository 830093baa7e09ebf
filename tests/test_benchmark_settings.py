"""The attribution benchmarks' settings (benchmarks/settings.py) in smoke mode."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import settings


@pytest.mark.parametrize("name", settings.NAMES + settings.HELD_OUT_NAMES)
def test_smoke_setting_has_model_data_and_truth(name, tmp_path):
    s = settings.load(name, smoke=True, cache_dir=tmp_path)
    n, m = settings.SMOKE["n_train"], settings.SMOKE["n_test"]
    assert s.x.shape[0] == s.y.shape[0] == n and s.xt.shape[0] == s.yt.shape[0] == m
    assert s.subsets.shape == (settings.SMOKE["subsets"], n)
    assert bool((s.subsets.sum(1) == n // 2).all())
    assert s.truth.shape == (settings.SMOKE["subsets"], m) and bool(s.truth.isfinite().all())
    assert s.model(s.xt).shape[0] == m
    cached = settings.load(name, smoke=True, cache_dir=tmp_path)
    assert cached.seconds == 0.0 and torch.equal(cached.truth, s.truth)


def test_unknown_setting_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown setting"):
        settings.load("mnist")


def test_benchmark_smoke_run_prints_lds_of_our_methods():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "attribution_settings.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--smoke",
            "--no-peers",
            "--settings",
            "breast_cancer",
            "--skip",
            "×,full,trak",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    row = re.search(r"\| influence auto \(gauss_newton, trace\) \| (-?[0-9.]+) \|", proc.stdout)
    assert row and -1 <= float(row.group(1)) <= 1
    assert "| breast_cancer |" in proc.stdout  # the summary table

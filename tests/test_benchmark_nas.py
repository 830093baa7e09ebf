"""Smoke runs of the cross-space NAS benchmark (benchmarks/nas/compare.py,
ground_truth_spaces.py, holdout.py) and the layer-importance families benchmark, and the
leave-one-out choice they rely on."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attribution.layers import DEFAULT_SCORE
from ntk import proxies

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def nas_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH / "nas"))
    import compare
    import ground_truth_spaces

    return compare, ground_truth_spaces


def _script(name: str, *args: str, cwd: Path = BENCH / "nas") -> subprocess.CompletedProcess:
    """A benchmark script run with the repository on its path, one thread, output captured."""
    return subprocess.run(
        [sys.executable, name, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )


def _table(stdout: str, header: str) -> dict:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_choose_takes_the_best_worst_space_not_the_best_mean(nas_modules):
    compare, _ = nas_modules
    taus = {"spiky": {"a": 0.95, "b": 0.9, "c": 0.1}, "steady": {"a": 0.6, "b": 0.6, "c": 0.5}}
    assert compare.choose(taus, ["a", "b", "c"]) == "steady"
    assert compare.choose(taus, ["a", "b"]) == "spiky"


def test_leave_one_out_reports_the_held_out_tau_of_a_choice_made_without_it(nas_modules):
    compare, _ = nas_modules
    acc = {s: np.arange(6.0) for s in "abc"}
    good, bad = list(range(6)), [0, 1, 2, 3, 5, 4]
    scores = {
        "a": {"params": good, "naswot": bad},
        "b": {"params": good, "naswot": bad},
        "c": {"params": bad, "naswot": good},
    }
    folds, default, taus = compare.leave_one_out(scores, acc, votes=False)
    assert default == "params"
    assert folds["c"] == ("params", pytest.approx(taus["params"]["c"]))
    assert taus["params"]["c"] < 1.0 == pytest.approx(taus["naswot"]["c"])


def test_rescore_batchnorm_recomputes_only_the_architectures_holding_one(nas_modules):
    compare, _ = nas_modules
    from torch import nn

    cands = {
        "plain": lambda: nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)),
        "bn": lambda: nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)),
        "plain too": lambda: nn.Linear(2, 2),
    }
    scores, calls = {"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0]}, []

    def rescore(c, x, y, labels):
        calls.append((list(c), x, y, labels))
        return {label: [10.0 * len(label)] * len(c) for label in labels}

    assert compare.rescore_batchnorm(scores, cands, "x", "y", rescore) == ["bn"]
    assert calls == [(["bn"], "x", "y", ["a", "b"])]
    assert scores == {"a": [1.0, 10.0, 3.0], "b": [4.0, 10.0, 6.0]}


@pytest.mark.slow  # 25–35 s on the loaded 2-core machine
def test_ground_truth_of_each_new_space_trains_every_seed(nas_modules):
    _, gt = nas_modules
    assert set(gt.ALL_SPACES) == {
        "digits_cnn",
        "cancer_mlp",
        "seq_attention",
        "seq_conv",
        "synth_mlp",
    }
    for name in gt.ALL_SPACES:
        truth = gt.ground_truth(name, seeds=(0, 1), n=2)
        archs = truth["architectures"]
        assert len(archs) == 2
        for a in archs.values():
            assert len(a["accuracy"]) == 2 and all(0 <= v <= 1 for v in a["accuracy"])
            assert a["mean"] == pytest.approx(np.mean(a["accuracy"]), abs=1e-4)
        assert set(truth["ceiling"]) == {"kendall_tau", "spearman_rho"}


@pytest.mark.slow  # 25–35 s on the loaded 2-core machine
def test_compare_smoke_prints_tau_per_space_and_the_held_out_choice():
    proc = _script("compare.py", "--smoke")
    assert proc.returncode == 0, proc.stderr
    taus = _table(proc.stdout, "| proxy |")
    assert {"lga", "naswot", "params"} <= set(taus)
    assert all(-1 <= float(v) <= 1 for row in taus.values() for v in row)
    folds = _table(proc.stdout, "| held-out space |")
    assert set(folds) == {"digits_mlp", "digits_cnn", "cancer_mlp", "seq_attention"}
    assert "rank default chosen on all spaces" in proc.stdout


@pytest.mark.slow  # ~20 s on the loaded 2-core machine
def test_holdout_smoke_scores_the_coded_defaults_on_spaces_no_rule_reads(nas_modules):
    """holdout.py checks the defaults as coded on the held-out spaces; the scripts that choose
    the defaults never read those spaces."""
    compare = nas_modules[0]
    proc = _script("holdout.py", "--smoke")
    assert proc.returncode == 0, proc.stderr
    import holdout

    for space in ("seq_conv", "synth_mlp"):
        rows = _table(proc.stdout.split(f"{space}: ")[1], "| proxy |")
        assert {holdout.SCORE_DEFAULT, holdout.RANK_DEFAULT, "naswot", "params"} == set(rows)
        assert all(-1 <= float(row[0]) <= 1 for row in rows.values())
    assert proxies.DEFAULT in holdout.SCORE_DEFAULT
    assert " + ".join(proxies.DEFAULT_RANKING) in holdout.RANK_DEFAULT
    assert not set(holdout.HELD_OUT_SPACES) & set(compare.SPACE_NAMES)


def test_nb201_smoke_and_cached_report_without_the_truth_package():
    """NAS-Bench-201 from the committed sample and truth: a smoke scoring of 6 cells, and the
    cached five-space report whose rank default is the vote in ntk.proxies."""
    smoke = _script("nb201.py", "--smoke")
    assert smoke.returncode == 0, smoke.stderr
    taus = _table(smoke.stdout, "| proxy |")
    assert {"lga", "naswot", "params"} <= set(taus)
    assert all(-1 <= float(row[0]) <= 1 for row in taus.values())
    cached = _script("nb201.py", "--cached")
    assert cached.returncode == 0, cached.stderr
    folds = _table(cached.stdout, "| held-out space |")
    assert set(folds) == {"digits_mlp", "digits_cnn", "cancer_mlp", "seq_attention", "nb201"}
    vote = " + ".join(proxies.DEFAULT_RANKING)
    assert f"rank: chosen on all five spaces {vote} " in cached.stdout


def test_the_committed_repeat_scores_choose_the_coded_numbers_of_repeats(nas_modules):
    """The guard of proxies.DEFAULT_REPEATS and RANKING_REPEATS: repeats.py's rule on the
    committed per-repeat scores of the five spaces picks them; and of compare.OUTSIDE_POOL: it
    holds compare.JUDGED's metrics if and only if the pool with them chooses worse held out."""
    compare = nas_modules[0]
    proc = _script("repeats.py", "--cached")
    assert proc.returncode == 0, proc.stderr
    chosen = [line for line in proc.stdout.splitlines() if line.startswith("chosen on all")]
    score_line, rank_line = chosen
    assert score_line.startswith(f"chosen on all spaces: {proxies.DEFAULT_REPEATS} repeats")
    assert rank_line.startswith(f"chosen on all spaces: {proxies.RANKING_REPEATS} repeats")
    code = compare.proxy_label(proxies.DEFAULT, proxies.DEFAULT_BATCH_SIZE)
    assert f"jointly {code} with {proxies.DEFAULT_REPEATS} repeats" in score_line
    vote = compare.proxy_label(" + ".join(proxies.DEFAULT_RANKING), proxies.RANKING_BATCH_SIZE)
    assert f"jointly {vote} with {proxies.RANKING_REPEATS} repeats" in rank_line
    # compare.OUTSIDE_POOL holds compare.JUDGED's metrics exactly when their joining the pool
    # lowers the held-out worst of either default
    worst = {}
    for line in proc.stdout.splitlines():
        if line.startswith("pool for "):
            words = line.split()
            worst[words[2].rstrip(":")] = (float(words[6]), float(words[8]))
    assert set(worst) == {"score", "rank"}
    lowers = any(with_ < without for without, with_ in worst.values())
    assert compare.OUTSIDE_POOL == (compare.JUDGED if lowers else ())


def test_repeats_resume_a_label_cut_short_at_the_next_candidate(nas_modules, tmp_path, monkeypatch):
    """repeats.py cached a label only once every candidate was scored (hours for `tse` on
    NAS-Bench-201): a run cut short lost it all. It now resumes with the candidates not yet
    scored, by name (a candidate scored out of order, e.g. by another process, is kept), and
    the finished label holds what one uninterrupted run gives; the cache keeps no partial entry."""
    import json

    import repeats
    import torch
    from torch import nn

    def net(width):
        return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))

    cands = {f"w{w}": (lambda w=w: net(w)) for w in (2, 5, 9)}
    x, y = torch.randn(20, 4, generator=torch.Generator().manual_seed(0)), torch.arange(20) % 3
    monkeypatch.setattr(repeats, "HERE", tmp_path)
    monkeypatch.setattr(repeats, "load_space", lambda name: (cands, x, y, np.arange(3.0)))
    monkeypatch.setattr(repeats, "LABELS", {"params": ("params", 8), "trace": ("trace", 8)})
    whole = repeats.score_repeats(cands, x, y, "trace", 8)
    score, calls, stop = proxies.score, [], [True]

    def cut_short(*args, metric, **kwargs):
        calls.append(metric)
        if calls.count("trace") == 2 and stop and stop.pop():  # once: trace's 2nd candidate
            raise KeyboardInterrupt
        return score(*args, metric=metric, **kwargs)

    monkeypatch.setattr(proxies, "score", cut_short)
    with pytest.raises(KeyboardInterrupt):
        repeats.scored("toy", cached_only=False)
    kept = json.loads((tmp_path / "repeats_toy.json").read_text())
    assert set(kept["scores"]) == {"params"} and list(kept["partial"]["trace"]) == ["w2"]
    kept["partial"]["trace"]["w9"] = whole[2]  # the last one, scored elsewhere
    (tmp_path / "repeats_toy.json").write_text(json.dumps(kept))
    calls.clear()
    values, _ = repeats.scored("toy", cached_only=False)
    assert calls == ["trace"]  # the one candidate left
    np.testing.assert_array_equal(values["trace"], whole)
    assert "partial" not in json.loads((tmp_path / "repeats_toy.json").read_text())


def test_nb201_takes_a_label_repeats_scored_as_score_space_would_score_it(
    nas_modules, tmp_path, monkeypatch
):
    """nb201.py's 2-repeat cache takes a label that repeats.py scored to the end (`tse` takes
    hours there) as the mean of its first repeats: the values score_space gives, not the mean of
    all four repeats; only for the same cells and network size, and never over a cached label."""
    import json

    import nb201
    import repeats
    import torch
    from torch import nn

    compare, _ = nas_modules
    cands = {
        f"w{w}": (lambda w=w: nn.Sequential(nn.Linear(4, w), nn.ReLU(), nn.Linear(w, 3)))
        for w in (2, 5, 9)
    }
    x, y = torch.randn(20, 4, generator=torch.Generator().manual_seed(0)), torch.arange(20) % 3
    kept = {
        "repeats": repeats.REPEATS,
        "architectures": list(cands),
        "scores": {
            m: repeats.score_repeats(cands, x, y, m, compare.SMALL) for m in ("trace", "params")
        },
    }
    (tmp_path / "repeats_nb201.json").write_text(json.dumps(kept))
    monkeypatch.setattr(nb201, "HERE", tmp_path)
    setup = {"channels": 8, "cells": 1, "repeats": 2, "architectures": list(cands)}
    scores = {"params": [1.0, 2.0, 3.0]}
    assert nb201.from_repeats(scores, setup) == ["trace"]
    expected = compare.score_space(cands, x, y, ["trace"], 2)["trace"]
    np.testing.assert_array_equal(scores["trace"], expected)
    assert scores["params"] == [1.0, 2.0, 3.0]
    assert nb201.from_repeats({}, {**setup, "channels": 16}) == []
    assert nb201.from_repeats({}, {**setup, "architectures": ["w2", "w5"]}) == []


@pytest.mark.slow  # 25–35 s on the loaded 2-core machine
def test_layer_families_smoke_prints_both_truths_and_the_held_out_choice():
    proc = _script("layer_families.py", "--smoke", cwd=BENCH)
    assert proc.returncode == 0, proc.stderr
    for truth in ("loss_increase", "prune_finetune"):
        rows = _table(proc.stdout.split(f"score vs {truth}")[1], "| score |")
        assert "sensitivity" in rows
    held = _table(proc.stdout, "| held-out family |")
    assert set(held) == {"mlp", "resnet"}


def test_layer_families_held_out_report_names_the_code_default_without_choosing():
    """--held-out --cached re-prints the families no choice reads: the code default's figures,
    no leave-one-family-out choice."""
    proc = _script("layer_families.py", "--held-out", "--cached", cwd=BENCH)
    assert proc.returncode == 0, proc.stderr
    rows = _table(proc.stdout.split("score vs loss_increase")[1], "| score |")
    assert "sensitivity" in rows and len(rows["sensitivity"]) == 8 + 2  # models, mean, worst
    assert f"loss_increase: code default {DEFAULT_SCORE} mean ρ" in proc.stdout
    assert "Leave-one-family-out" not in proc.stdout


def test_score_script_averages_the_librarys_default_repeats():
    """score.py averaged 3 repeats by default, neither proxies.DEFAULT_REPEATS nor RANKING_REPEATS;
    it takes score's constant, so it follows the library when the constant changes."""
    proc = _script("score.py", "--help")
    assert proc.returncode == 0, proc.stderr
    assert f"(default: {proxies.DEFAULT_REPEATS}, proxies.DEFAULT_REPEATS)" in " ".join(
        proc.stdout.split()
    )

"""`ntk nas` as a user runs it: a subprocess on the demo space, on a candidates file, and errors."""

import csv
import io
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from attribution.cli import main
from ntk import proxies

CANDIDATES = """
import torch
from torch import nn

def net(width):
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))

torch.manual_seed(0)
space = {"w3": lambda: net(3), "w12": lambda: net(12), "w6": net(6)}  # factories and a module
empty = {}
def broken():
    raise ZeroDivisionError("no luck")
bad = {"ok": lambda: net(3), "broken": broken}
not_a_dict = [net(3)]

class Functional(nn.Module):  # its activation is a function: naswot cannot see it
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

mixed = {"w6": lambda: net(6), "functional": Functional}

class Pair(nn.Module):  # returns (logits, features), read with --output-fn
    def __init__(self):
        super().__init__()
        self.net = net(5)

    def forward(self, x):
        return self.net(x), x

def first(out):
    return out[0]

pairs = {"a": Pair, "b": Pair}
twins = {"w6a": lambda: net(6), "w3": lambda: net(3), "w6b": lambda: net(6)}
"""


def run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "attribution.cli", "nas", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def write_inputs(tmp_path, features=4):
    (tmp_path / "cands.py").write_text(CANDIDATES)
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "data.npz",
        x=rng.normal(size=(20, features)).astype(np.float32),
        y=np.arange(20) % 3,
    )


def test_no_arguments_ranks_the_demo_space():
    result = run("--format", "json", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    scores = [r["mean_rank"] for r in rows]  # the default: a vote of two proxies
    assert len(rows) == 6 and scores == sorted(scores, reverse=True)
    ranks = [r["rank"] for r in rows]  # ties (equal mean ranks) share the first one's
    assert ranks[0] == 1 and all(
        ranks[i] == (ranks[i - 1] if scores[i] == scores[i - 1] else i + 1) for i in range(1, 6)
    )
    assert all(m in rows[0] for m in proxies.DEFAULT_RANKING)


def test_candidates_file_data_and_formats(tmp_path):
    write_inputs(tmp_path)
    result = run(
        "--candidates",
        "cands.py:space",
        "--data",
        "data.npz",
        "--metric",
        "params",
        "--format",
        "csv",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["candidate"] for r in rows] == ["w12", "w6", "w3"]
    assert float(rows[0]["params"]) == 4 * 12 + 12 + 12 * 3 + 3


def test_tied_candidates_share_their_rank(tmp_path):
    """Two architectures with the same score were ranked 1 and 2 (by the order of the file)."""
    write_inputs(tmp_path)
    result = run(
        "--candidates", "cands.py:twins", "--data", "data.npz", "--metric", "params",
        "--format", "json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [(r["rank"], r["candidate"]) for r in rows] == [(1, "w6a"), (1, "w6b"), (3, "w3")]


def test_condition_number_rows_match_the_library(tmp_path, monkeypatch, capsys):
    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_here(
        capsys,
        "--candidates",
        "cands.py:space",
        "--data",
        "data.npz",
        "--metric",
        "condition_number",
        "--repeats",
        "2",
        "--batch-size",
        "10",
        "--format",
        "json",
    )
    assert code == 0, err
    rows = json.loads(out)["rows"]
    data = np.load(tmp_path / "data.npz")
    sys.path.insert(0, str(tmp_path))
    try:
        import cands
    finally:
        sys.path.pop(0)
    expected = proxies.rank(
        cands.space,
        torch.tensor(data["x"]),
        torch.tensor(data["y"]),
        metric="condition_number",
        repeats=2,
        batch_size=10,
    )
    assert [(r["candidate"], r["condition_number"]) for r in rows] == expected
    assert all(r["kappa"] >= 1 for r in rows)

    code, out, err = run_here(
        capsys,
        "--candidates",
        "cands.py:space",
        "--data",
        "data.npz",
        "--metric",
        "params",
        "--metric",
        "condition_number",
        "--repeats",
        "2",
        "--batch-size",
        "10",
        "--format",
        "json",
    )
    assert code == 0, err
    vote = json.loads(out)["rows"]
    kappa = dict(expected)
    for r in vote:  # params rank w3 < w6 < w12 (1..3); condition_number ranks from the run above
        assert r["condition_number"] == kappa[r["candidate"]]
    assert [r["mean_rank"] for r in vote] == sorted((r["mean_rank"] for r in vote), reverse=True)


def run_here(capsys, *args):
    """The console entry point in this process (exit code, stdout, stderr): cheaper than a
    subprocess."""
    with pytest.raises(SystemExit) as stop:
        main(["nas", *args])
    captured = capsys.readouterr()
    return stop.value.code, captured.out, captured.err


def test_table_format(tmp_path, monkeypatch, capsys):
    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_here(
        capsys, "--candidates", "cands.py:space", "--data", "data.npz", "--metric", "params"
    )
    assert code == 0, err
    assert out.index("w12") < out.index("w6") < out.index("w3")


def test_the_vote_column_has_one_name_in_every_format(tmp_path, monkeypatch, capsys):
    """The mean rank of a vote is `mean_rank` in the table's header and note, in --columns, in
    json and in csv (the table called it `vote`, a name --columns did not know)."""
    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = ["--candidates", "cands.py:space", "--data", "data.npz", "--repeats", "1"]
    args += ["--metric", "params", "--metric", "trace"]
    code, out, err = run_here(capsys, *args)
    assert code == 0, err
    assert "mean_rank ↑" in out and "mean_rank ↑: the mean of each proxy's rank" in out
    assert "vote" not in out
    code, out, err = run_here(capsys, *args, "--columns", "candidate,mean_rank")
    assert code == 0 and "mean_rank ↑" in out, err
    code, out, _ = run_here(capsys, *args, "--format", "csv")
    assert "mean_rank" in next(csv.reader(io.StringIO(out)))


def test_usage_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    for args, message in [
        (["--candidates", "cands.py:empty"], "empty"),
        (["--candidates", "cands.py:not_a_dict"], "not a dict"),
        (["--candidates", "nowhere.py:space"], "does not exist"),
        (["--candidates", "cands.py:space", "--data", "missing.npz"], "does not exist"),
        (["--candidates", "cands.py:space", "--metric", "accuracy"], "accuracy"),
    ]:
        code, _, err = run_here(capsys, *args)
        assert code == 2, (args, err)
        assert message in err and len(err.strip().splitlines()) == 1


def test_failures_name_the_candidate(tmp_path, monkeypatch, capsys):
    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_here(capsys, "--candidates", "cands.py:bad", "--data", "data.npz")
    assert code == 2  # bad input, as a --model factory that raises
    assert "candidate 'broken': the factory raised ZeroDivisionError: no luck" in err

    write_inputs(tmp_path, features=7)  # data that the networks cannot read
    code, _, err = run_here(capsys, "--candidates", "cands.py:space", "--data", "data.npz")
    assert code == 2 and "candidate 'w3'" in err


def test_the_default_vote_without_naswot_says_so(tmp_path, monkeypatch, capsys):
    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_here(capsys, "--candidates", "cands.py:mixed", "--data", "data.npz")
    assert code == 0, err
    words = " ".join(out.split())  # notes are folded to the terminal's width
    assert "label_condition (" in words and "naswot is left out of the vote" in words
    assert "candidate 'functional': naswot needs activation modules" in words


def test_tse_says_what_it_trains_and_matches_the_library(tmp_path, monkeypatch, capsys):
    """--metric tse: the library's scores; its title counts training steps, not the batch it
    does not read, and a note says what it trains."""
    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(proxies, "TSE_STEPS", 3)
    args = ["--candidates", "cands.py:space", "--data", "data.npz", "--metric", "tse"]
    code, out, err = run_here(capsys, *args, "--repeats", "1")
    assert code == 0, err
    assert "tse (1 × 3 training steps, higher is better)" in out
    assert "tse: −(mean loss) of 3 Adam steps on minibatches of 64" in out
    code, out, err = run_here(capsys, *args, "--repeats", "1", "--format", "json")
    data = np.load(tmp_path / "data.npz")
    sys.path.insert(0, str(tmp_path))
    try:
        import cands
    finally:
        sys.path.pop(0)
    x, y = torch.tensor(data["x"]), torch.tensor(data["y"])
    expected = proxies.rank(cands.space, x, y, metric="tse", repeats=1)
    assert [(r["candidate"], r["tse"]) for r in json.loads(out)["rows"]] == expected


def test_output_fn_and_the_samples_actually_scored(tmp_path, monkeypatch, capsys):
    write_inputs(tmp_path)  # 20 samples: fewer than the batch size asked for
    monkeypatch.chdir(tmp_path)
    args = ["--candidates", "cands.py:pairs", "--data", "data.npz", "--batch-size", "64"]
    code, _, err = run_here(capsys, *args)
    assert code == 2 and "pass --output-fn" in err
    code, out, err = run_here(capsys, *args, "--output-fn", "cands.py:first", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["batch_size"] == 20  # what was scored, not what was asked


def test_regression_targets_are_ignored_by_metrics_that_never_read_labels(
    tmp_path, monkeypatch, capsys
):
    """--data with real-valued y was refused ("--data's y must hold integer class labels") even
    for --metric naswot, which never reads y; the default vote reads it and still refuses it."""
    write_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(20, 4)).astype(np.float32)
    np.savez(tmp_path / "targets.npz", x=x, y=rng.normal(size=20))
    code, _, err = run_here(
        capsys, "--candidates", "cands.py:space", "--data", "targets.npz", "--metric", "naswot"
    )
    assert code == 0, err
    code, _, err = run_here(capsys, "--candidates", "cands.py:space", "--data", "targets.npz")
    assert code == 2 and "--data's y must hold integer class labels" in err

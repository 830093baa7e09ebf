"""`ntk kernel` as a user runs it: a subprocess, every format, saving, and usage errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from disks import file_size_limit

import ntk


def run(*args, cwd=None, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "attribution.cli", "kernel", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        **kwargs,
    )


FACTORY = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
"""


def test_kernel_on_a_factory_file_in_every_format(tmp_path):
    (tmp_path / "factory.py").write_text(FACTORY)
    x = np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x)
    common = ["--model", str(tmp_path / "factory.py:build"), "--data", str(tmp_path / "data.npz")]

    out = run(*common, "--kind", "trace", "--format", "json", "--save", str(tmp_path / "k.npy"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["samples"] == 12 and report["rows"][0]["shape"] == "12x12"
    assert abs(sum(row["share"] for row in report["layers"]) - 1) < 1e-6

    namespace = {}
    exec(FACTORY, namespace)
    expected = ntk.empirical_ntk(namespace["build"]().eval(), torch.from_numpy(x), kind="trace")
    assert np.allclose(np.load(tmp_path / "k.npy"), expected.numpy(), rtol=1e-5)
    assert not list(tmp_path.glob("*.part"))

    csv_out = run(*common, "--format", "csv")
    assert csv_out.returncode == 0
    assert csv_out.stdout.splitlines()[0].startswith("kind,shape,seconds")
    assert len(csv_out.stdout.splitlines()) == 5 + 2  # header, four kinds, two layers
    table = run(*common, "--kind", "sum_logits")
    assert table.returncode == 0 and "sum_logits" in table.stdout and "per-layer" in table.stdout


def test_usage_errors_exit_2_with_one_line(tmp_path):
    cases = [
        ["--model", "no_colon"],
        ["--model", str(tmp_path / "missing.py:f")],
        ["--model", "json:nothing_here"],
        ["--kind", "bogus"],
        ["--save", str(tmp_path / "k.npy")],
    ]
    for args in cases:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


DIAGONAL = """
from torch import nn

def build():  # no bias: the trace kernel of samples x is exactly x xᵀ
    return nn.Linear(4, 1, bias=False)
"""


def test_a_finite_condition_number_comes_with_full_rank(tmp_path):
    """K = diag(1, 1, 1, 2⁻²⁴) exactly: λ4 > 0 but below the rank tolerance 4·ε(float32), so the
    rank is 3 and κ = λ1/λ4 = 2²⁴ would only measure rounding: κ is inf, as the rank says."""
    (tmp_path / "factory.py").write_text(DIAGONAL)
    np.savez(tmp_path / "data.npz", x=np.diag([1, 1, 1, 2**-12]).astype(np.float32))
    common = ["--model", str(tmp_path / "factory.py:build"), "--data", str(tmp_path / "data.npz")]
    out = run(*common, "--kind", "trace", "--format", "json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    row = report["rows"][0]
    assert row["lambda_1"] == 1 and row["rank"] == 3
    assert row["condition_number"] is None  # κ = inf: null in JSON
    assert report["notes"] == ["κ = inf for trace: rank-deficient: N = 4 > rank 3"]
    help_text = run("--help").stdout
    assert "λ1 · n · ε(float32)" in help_text and "inf whenever the rank is below n" in help_text


def test_every_format_carries_the_layer_shares_the_untrained_note_and_the_saved_path(tmp_path):
    (tmp_path / "factory.py").write_text(FACTORY)
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x)
    common = ["--model", str(tmp_path / "factory.py:build"), "--data", str(tmp_path / "data.npz")]
    common += ["--kind", "trace"]

    table = run(*common)
    assert "[untrained: no --weights]" in table.stdout and "per-layer" in table.stdout
    as_json = json.loads(run(*common, "--format", "json").stdout)
    assert as_json["untrained"] is True
    shares = {row["layer"]: row["share"] for row in as_json["layers"]}
    assert set(shares) == {"0", "2"}

    lines = run(*common, "--format", "csv").stdout.splitlines()
    header = lines[0].split(",")
    assert header[:2] == ["kind", "shape"] and header[-4:] == ["layer", "type", "trace", "share"]
    assert len(lines) == 1 + 1 + 2  # header, the trace kernel, one row per layer
    for line in lines[2:]:
        cells = dict(zip(header, line.split(",")))
        assert cells["kind"] == "trace" and cells["shape"] == ""
        assert float(cells["share"]) == shares[cells["layer"]]

    saved = run(*common, "--format", "json", "--save", str(tmp_path / "k.npy"))
    assert saved.returncode == 0, saved.stderr
    assert saved.stderr.splitlines()[-1] == f"ntk: wrote the trace kernel (6x6) to {tmp_path}/k.npy"
    assert json.loads(saved.stdout)["saved"] == str(tmp_path / "k.npy")  # stdout stays JSON

    # --output with the table: both tables in the file
    assert run(*common, "--output", str(tmp_path / "k.txt")).returncode == 0
    written = (tmp_path / "k.txt").read_text()
    assert "eNTK of 6 samples" in written and "per-layer trace shares" in written


@pytest.mark.parametrize(
    "fmt, flag",
    [("json", "--output"), ("csv", "--output"), ("table", "--output"), (None, "--save")],
)
def test_an_output_that_fails_part_way_leaves_the_earlier_file(tmp_path, fmt, flag):
    """--output was written in place: a write that failed part-way (here a full disk, made by a
    file size limit of 64 bytes) left the first 64 bytes of the result under the output's name
    in place of the earlier file. The error, "OSError: [Errno 27] File too large", named
    neither the file nor the flag; it names both now (exit 1 still: the command line was fine)."""
    (tmp_path / "factory.py").write_text(FACTORY)
    np.savez(tmp_path / "data.npz", x=np.zeros((6, 4), np.float32))
    target = tmp_path / "k.out"
    target.write_text("an earlier result\n")
    common = ["--model", str(tmp_path / "factory.py:build"), "--data", str(tmp_path / "data.npz")]

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    written = ["--format", fmt, "--output"] if fmt else ["--format", "json", "--save"]
    args = [*common, "--kind", "trace", *written, str(target)]
    out = run(*args, preexec_fn=file_size_limit(64), env=env)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"ntk: error: {flag} {target}: cannot write: File too large"
    ), out.stderr
    assert target.read_text() == "an earlier result\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.npz", "factory.py", "k.out"]
    assert run(*args).returncode == 0 and target.read_bytes() != b"an earlier result\n"


ZERO = """
import torch
from torch import nn

def build():
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.fill_(-1.0)  # every ReLU off: no parameter moves the outputs but the last bias
        net[2].bias.requires_grad_(False)
    return net
"""


def test_a_kernel_that_is_zero_everywhere_and_a_kind_given_twice(tmp_path):
    """A model whose eNTK is zero (no parameter reaches the outputs) crashed after the work with
    "ZeroDivisionError: float division by zero" in the layers' trace shares; a kind given twice
    was computed and printed twice."""
    (tmp_path / "factory.py").write_text(ZERO)
    np.savez(tmp_path / "data.npz", x=np.ones((5, 4), dtype=np.float32))
    common = ["--model", str(tmp_path / "factory.py:build"), "--data", str(tmp_path / "data.npz")]
    out = run(*common, "--kind", "trace", "--kind", "trace", "--format", "json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [row["kind"] for row in report["rows"]] == ["trace"]
    assert report["rows"][0]["lambda_1"] == 0
    assert [layer["share"] for layer in report["layers"]] == [0.0, 0.0]

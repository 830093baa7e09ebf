"""`ntk layers` as a user runs it: a subprocess on a factory file in every format, the plot,
weights, the built-in demo, and the usage errors (exit 2, one line, no traceback)."""

import csv
import gzip
import io
import json
import os
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
import torch
from disks import file_size_limit
from matplotlib.figure import Figure

from attribution import layer_importance
from attribution.cli import main


def run(*args, cwd=None, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "attribution.cli", "layers", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        **kwargs,
    )


FACTORY = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), Block(), Block(), nn.Linear(6, 3))

class Scaled(nn.Module):  # the root module owns a parameter of its own: layer ""
    def __init__(self):
        super().__init__()
        self.scale, self.head = nn.Parameter(torch.ones(4)), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(x * self.scale)

def frozen():  # the first layer frozen (requires_grad=False), as when fine-tuning a head
    model = build()
    model[0].requires_grad_(False)
    return model
"""


def setup(tmp_path):
    (tmp_path / "factory.py").write_text(FACTORY)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=16)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    return (
        x,
        y,
        ["--model", str(tmp_path / "factory.py:build"), "--data", str(tmp_path / "data.npz")],
    )


def test_every_format_matches_the_library(tmp_path):
    x, y, common = setup(tmp_path)
    namespace = {}
    exec(FACTORY, namespace)
    expected = layer_importance(
        namespace["build"]().eval(), torch.from_numpy(x), torch.from_numpy(y)
    )

    out = run(*common, "--format", "json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["samples"] == 16 and report["score"] == "sensitivity"
    rows = report["rows"]
    assert [r["layer"] for r in rows] == [r["layer"] for r in expected]
    assert [r["rank"] for r in rows] == list(range(1, 7))
    assert np.allclose([r["share"] for r in rows], [r["share"] for r in expected], rtol=1e-5)
    assert abs(sum(r["share"] for r in rows) - 1) < 1e-6
    assert rows[0]["block_influence"] is None

    out = run(*common, "--format", "csv", "--score", "share")
    assert out.returncode == 0, out.stderr
    table = list(csv.DictReader(io.StringIO(out.stdout)))
    assert len(table) == 6 and table[0]["rank"] == "1"
    shares = [float(r["share"]) for r in table]
    assert shares == sorted(shares, reverse=True)

    out = run(
        *common,
        "--group",
        "blocks",
        "--output",
        str(tmp_path / "t.txt"),
        "--plot",
        str(tmp_path / "bars.png"),
    )
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "t.txt").read_text()
    assert "1.fc1" not in text and "layer importance by sensitivity" in text
    assert all(name in text for name in ("0", "1", "2", "3"))
    assert (tmp_path / "bars.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"ntk: wrote the bar chart of sensitivity to {tmp_path / 'bars.png'}" in out.stderr

    out = run(
        *common,
        "--group",
        "blocks",
        "--depth",
        "2",
        "--score",
        "block_influence",
        "--format",
        "json",
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert {r["layer"] for r in rows} == {"0", "1.fc1", "1.fc2", "2.fc1", "2.fc2", "3"}


def test_weights_are_loaded(tmp_path):
    x, y, common = setup(tmp_path)
    namespace = {}
    exec(FACTORY, namespace)
    model = namespace["build"]()
    with torch.no_grad():
        model[3].weight.zero_()  # nothing upstream of the head reaches the output
    torch.save(model.state_dict(), tmp_path / "w.pt")
    out = run(*common, "--weights", str(tmp_path / "w.pt"), "--format", "json", "--score", "share")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert rows[0]["layer"] == "3" and rows[0]["share"] == 1.0
    assert all(r["share"] == 0 for r in rows[1:])


def test_usage_errors_exit_2_with_one_line(tmp_path):
    _, _, common = setup(tmp_path)
    np.savez(tmp_path / "wide.npz", x=np.zeros((8, 7), np.float32))
    cases = [
        ["--model", "no_colon"],
        ["--model", str(tmp_path / "missing.py:build")],
        [*common[:2], "--data", str(tmp_path / "missing.npz")],
        [*common[:2], "--data", str(tmp_path / "wide.npz")],  # 7 features for 4 inputs
        [*common, "--group", "heads"],
        [*common, "--weights", str(tmp_path / "missing.pt")],
        [*common, "--score", "block_influence"],  # refused after the work, blocks not grouped
    ]
    for args in cases:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


LONG_NAMES = """
from torch import nn

class Long(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_projection_of_the_encoder = nn.Linear(4, 6)
        self.output_head_mapping_features_to_logits = nn.Linear(6, 3)

    def forward(self, x):
        return self.output_head_mapping_features_to_logits(
            self.input_projection_of_the_encoder(x).tanh()
        )
"""


def test_the_plot_holds_its_title_and_long_layer_names(tmp_path, monkeypatch, capsys):
    (tmp_path / "long.py").write_text(LONG_NAMES)
    _, _, common = setup(tmp_path)
    common[1] = str(tmp_path / "long.py:Long")
    saved = []
    original = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: saved.append(fig) or original(fig, *a, **k)
    )
    with pytest.raises(SystemExit) as stop:
        main(["layers", *common, "--plot", str(tmp_path / "p.png")])
    assert stop.value.code == 0, capsys.readouterr().err
    (fig,) = saved
    texts = [*fig.texts, fig.axes[0].title]  # a figure title or the axes'
    title = [t for t in texts if t.get_text() == "layer importance (sensitivity)"]
    box, bounds = title[0].get_window_extent(), fig.bbox
    assert (
        bounds.x0 <= box.x0 and box.x1 <= bounds.x1 and bounds.y0 <= box.y0 <= box.y1 <= bounds.y1
    )
    # the saved image is as wide as the title and every name (in inches; saved at dpi 120)
    boxes = [t.get_window_extent() for t in title + fig.axes[0].get_yticklabels()]
    span = (max(b.x1 for b in boxes) - min(b.x0 for b in boxes)) / fig.dpi
    assert matplotlib.image.imread(tmp_path / "p.png").shape[1] / 120 >= span


def test_the_root_module_reads_root_in_tables_and_stays_empty_in_json(tmp_path, capsys):
    """The CLI tables name the root module (layer "") "(root)", as --plot and the HTML report
    do; json and csv keep the name `named_modules()` gives it."""
    _, _, common = setup(tmp_path)
    common[1] = common[1].replace(":build", ":Scaled")
    for command in ("layers", "kernel"):
        with pytest.raises(SystemExit) as stop:
            main([command, *common, *(["--kind", "trace"] if command == "kernel" else [])])
        out = capsys.readouterr().out
        assert stop.value.code == 0
        rows = [line.split() for line in out.splitlines()]
        assert ["(root)", "Scaled"] in [row[:2] for row in rows], out
    with pytest.raises(SystemExit):
        main(["layers", *common, "--format", "json"])
    assert sorted(r["layer"] for r in json.loads(capsys.readouterr().out)["rows"]) == ["", "head"]


def test_frozen_layers_are_named_as_not_ranked(tmp_path, capsys):
    """A layer whose parameters are all frozen has no share of the eNTK and no row: the table
    says which layers were left out and why, the JSON lists them (they used to vanish unsaid)."""
    _, _, common = setup(tmp_path)
    common[1] = common[1].replace(":build", ":frozen")
    with pytest.raises(SystemExit) as stop:
        main(["layers", *common])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    assert "not ranked, no trainable parameters (requires_grad=False): 0" in out
    with pytest.raises(SystemExit):
        main(["layers", *common, "--format", "json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["frozen"] == ["0"] and "0" not in [r["layer"] for r in printed["rows"]]


@pytest.mark.parametrize("name", ["p.txt", "p"])
def test_a_plot_in_a_format_matplotlib_cannot_write_is_refused_naming_plot(tmp_path, capsys, name):
    """matplotlib's "Format 'txt' is not supported" came after the work, without the flag; a name
    without a suffix was saved as p.png while the command said p."""
    _, _, common = setup(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["layers", *common, "--plot", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ntk: error: --plot: {tmp_path / name}") and "png, ps, raw" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.npz", "factory.py"]


@pytest.mark.parametrize(
    "name, usetex, program",
    [("p.pgf", False, "xelatex"), ("p.png", True, "latex"), ("p.eps", True, "latex")],
)
def test_a_plot_whose_writer_runs_a_program_not_installed_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch, name, usetex, program
):
    """pgf, whose writer measures text with rcParams['pgf.texsystem'] (xelatex), and any format
    with rcParams['text.usetex'] (latex) were accepted, to fail once the work was done (exit 1)
    with "--plot p.pgf: cannot write: No such file or directory" or "RuntimeError: Failed to
    process string with tex because latex could not be found". Here no such program is on
    PATH."""
    _, _, common = setup(tmp_path)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setitem(matplotlib.rcParams, "text.usetex", usetex)
    monkeypatch.setitem(matplotlib.rcParams, "pgf.texsystem", "xelatex")
    with pytest.raises(SystemExit) as stop:
        main(["layers", *common, "--plot", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ntk: error: --plot: cannot write {tmp_path / name}: "), err
    assert err.strip().endswith(f" {program}, which is not on PATH"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "data.npz", "factory.py"]


def test_formats_that_matplotlib_writes_itself_need_no_program(tmp_path, monkeypatch):
    """Without text.usetex every format but pgf is written by matplotlib alone (PS, EPS and SVG
    included): accepted with an empty PATH; pgf once its TeX engine is on PATH."""
    from matplotlib.backend_bases import FigureCanvasBase

    from attribution.cli.layers import _check_plot

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(matplotlib.rcParams, "text.usetex", False)
    for fmt in FigureCanvasBase.get_supported_filetypes():
        if fmt != "pgf":
            _check_plot(f"p.{fmt}")
    engine = tmp_path / "lualatex"
    engine.write_text("#!/bin/sh\n")
    engine.chmod(0o755)
    monkeypatch.setitem(matplotlib.rcParams, "pgf.texsystem", "lualatex")
    _check_plot("p.pgf")


@pytest.mark.parametrize(
    "name, magic", [("p.png", b"\x89PNG\r\n\x1a\n"), ("p.svg", b"<?xml"), ("p.pdf", b"%PDF-")]
)
def test_a_plot_that_fails_part_way_leaves_the_earlier_file(tmp_path, capsys, name, magic):
    """--plot was saved in place: a write that failed part-way (here a full disk, made by a file
    size limit of 1 KiB) left the first KiB of the image under its name instead of the earlier
    file. It is written to a temporary file renamed once complete, in the format of its name's
    suffix (the temporary's name ends in .part)."""
    _, _, common = setup(tmp_path)
    target = tmp_path / name
    target.write_bytes(b"an earlier plot\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = run(*common, "--plot", str(target), preexec_fn=file_size_limit(1024), env=env)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"ntk: error: --plot {target}: cannot write: File too large"
    ), out.stderr
    assert target.read_bytes() == b"an earlier plot\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.npz", "factory.py", name]
    with pytest.raises(SystemExit) as stop:
        main(["layers", *common, "--plot", str(target)])
    assert stop.value.code == 0, capsys.readouterr().err
    assert target.read_bytes().startswith(magic) and target.stat().st_size > 1024
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.npz", "factory.py", name]


@pytest.mark.parametrize("name", ["p.ps", "p.eps", "p.svgz", "p.pdf", "p.svg"])
def test_a_plot_does_not_hold_the_name_of_its_temporary_file(tmp_path, capsys, name):
    """The plot, written to a temporary file renamed onto its name, held the temporary's name
    (".p.ps.1a2b3c4d.part"): as the %%Title of PS and EPS (now left out: matplotlib takes it
    only from a path) and in the gzip header of svgz (now naming the plot); PDF and SVG never
    held it."""
    _, _, common = setup(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["layers", *common, "--plot", str(tmp_path / name)])
    assert stop.value.code == 0, capsys.readouterr().err
    written = (tmp_path / name).read_bytes()
    held = [written]
    if name.endswith(".svgz"):
        held.append(gzip.decompress(written))
        assert written[3] & 0x08 and written[10:].split(b"\0")[0] == name.encode()  # FNAME
    for data in held:
        assert b".part" not in data and f".{name}.".encode() not in data

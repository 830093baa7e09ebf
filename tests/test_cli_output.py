"""What the subcommands print on the built-in demo: tables that fit 80 and 120 columns with every
value whole (rich's console width set through COLUMNS), folded rather than cut when even the
chosen columns do not fit; and the numbers' meaning where it could mislead (κ = inf, undefined
scores, untrained weights)."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

import ntk
from attribution.cli import main
from attribution.cli.common import cell
from attribution.cli.main import cli
from attribution.cli.nas import columns as nas_columns

# Small budgets: the rendering is under test, not the numbers.
DEMO_RUNS = {
    "layers": (["--samples", "64"], ["layer", "type", "params", "sensitivity", "share", "rank"]),
    "kernel": (
        ["--samples", "12"],
        ["kind", "shape", "lambda_1", "condition_number", "rank", "seconds"],
    ),
    "attribute": (["--samples", "80", "--test-samples", "2", "--top", "2"], None),
    "nas": (["--repeats", "1", "--batch-size", "16"], None),
    "report": (
        ["--samples", "80", "--test-samples", "40", "--examples", "2", "--kernel-samples", "40"],
        ["measure", "value", "samples"],
    ),
    "featurize": (
        ["--samples", "40", "--dim", "16"],
        ["store", "samples", "shape", "blocks", "ranks", "seconds"],
    ),
}


def run(capsys, *args):
    with pytest.raises(SystemExit) as stop:
        main(list(args))
    captured = capsys.readouterr()
    return stop.value.code, captured.out, captured.err


def split(line):
    return re.split(r" {2,}", line.strip())


def tables(text):
    """(header cells, rows of cells) of every table printed as a table."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.strip() and set(line.strip()) == {"─"}:
            rows = []
            for row in lines[i + 1 :]:
                if not row.strip():
                    break
                rows.append(split(row))
            found.append((split(lines[i - 1]), rows))
    return found


def folded(text, count):
    """The values of `count` rows folded into blocks (after the title, each block a paragraph of
    `label  value` lines; a value longer than its column goes on over the next lines)."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()][1 : 1 + count]
    blocks = []
    for paragraph in paragraphs:
        values = []
        for line in paragraph.splitlines():
            if line.startswith(" "):  # a value folded onto the next line
                values[-1] += line.strip()
            else:
                values.append((split(line) + [""])[1])
        blocks.append(values)
    return blocks


def expected(rows, columns):
    """The cells of `rows`; timings (which differ from run to run) as the pattern of a number."""
    return [[NUMBER if c == "seconds" else cell(r[c]) for c in columns] for r in rows]


class _Number(str):
    def __eq__(self, other):
        return re.fullmatch(r"\d+(\.\d+)?(e-?\d+)?", other) is not None

    __hash__ = str.__hash__


NUMBER = _Number("<a number>")


def args_for(command, tmp_path):
    extra, _ = DEMO_RUNS[command]
    if command == "featurize":
        return [command, str(tmp_path / "store"), *extra]
    if command == "report":
        return [command, *extra, "--out", str(tmp_path / "r.html")]
    return [command, *extra]


@pytest.mark.parametrize("command", sorted(DEMO_RUNS))
def test_demo_tables_fit_80_and_120_columns_with_no_value_cut(
    command, tmp_path, monkeypatch, capsys
):
    args = args_for(command, tmp_path)
    code, out, err = run(capsys, *args, "--format", "json")
    assert code == 0, err
    result = json.loads(out)
    rows = result["rows"]
    columns = DEMO_RUNS[command][1] or list(rows[0])
    # the columns --columns accepts (and its help lists) before any work are the rows' own
    if command == "nas":
        assert list(nas_columns(())) == list(rows[0])
    else:
        option = next(p for p in cli.commands[command].params if p.name == "columns")
        listed = re.sub(r" \([^)]*\)", "", option.help.split(", of ")[1])  # headers: κ, λ1
        assert sorted(listed.split(", ")) == sorted(rows[0])
    if command == "report":  # every section says the samples it used: the run's one budget
        samples = {r["measure"]: r["samples"] for r in rows}
        assert (
            samples["condition_number"] == "40 train" and samples["share of layer 0"] == "40 train"
        )
        assert samples["label_agreement"] == "40 test"
    for width in (80, 120):
        monkeypatch.setenv("COLUMNS", str(width))
        code, out, err = run(capsys, *args)
        assert code == 0, err
        assert "…" not in out and max(map(len, out.splitlines())) <= width, out
        if tables(out):
            header, shown = tables(out)[0]
            assert len(header) == len(columns)
        else:  # folded: one block per row
            shown = folded(out, len(rows))
        assert shown == expected(rows, columns), out
        if command == "kernel":  # the per-layer shares, a second table
            layer_columns = ["layer", "type", "trace", "share"]
            assert tables(out)[1][1] == expected(result["layers"], layer_columns)

        code, out, err = run(capsys, *args, "--all")
        assert code == 0, err
        assert "…" not in out and max(map(len, out.splitlines())) <= width, out
        every = list(rows[0])
        as_table = [cells for header, cells in tables(out) if len(header) == len(every)]
        shown = as_table[0] if as_table else folded(out, len(rows))
        assert shown == expected(rows, every), out


def test_numbers_take_at_most_nine_characters():
    for value in (
        0.0,
        1.0,
        -0.0012345,
        3.2391e5,
        -3.2391e5,
        1.234e-12,
        -9.87e300,
        12345.678,
        9999.7,
    ):
        text = cell(value)
        assert len(text) <= 9 and abs(float(text) - value) <= 1e-3 * abs(value), (value, text)
    assert cell(float("inf")) == "inf" and cell(None) == "–" and cell(123456789) == "123456789"


FACTORY = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 2))

class Attention(nn.Module):  # torch notes that vmap has no batching rule for its fused kernel
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.attention(h, h, h, need_weights=False)[0].mean(1))

class Branchy(nn.Module):  # data-dependent control flow: cannot be vmapped
    def __init__(self):
        super().__init__()
        self.lin = build()

    def forward(self, x):
        return self.lin(x) if float(x.sum()) > -1e9 else -self.lin(x)
"""


def write_model(tmp_path, samples=12):
    (tmp_path / "factory.py").write_text(FACTORY)
    x = np.random.default_rng(0).normal(size=(samples, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=np.arange(samples) % 2)
    return ["--model", str(tmp_path / "factory.py:build"), "--data", str(tmp_path / "data.npz")]


def test_torchs_notes_on_its_vmap_speed_are_not_relayed(tmp_path, capsys):
    """torch's "There is a performance drop because we have not yet implemented the batching
    rule for aten::_scaled_dot_product…" came out as three to five `ntk: warning:` lines on any
    attention model: a note for torch's developers, not the user."""
    (tmp_path / "factory.py").write_text(FACTORY)
    x = np.random.default_rng(0).normal(size=(6, 5, 4)).astype(np.float32)
    np.savez(tmp_path / "seq.npz", x=x, y=np.arange(6) % 3)
    model = ["--model", f"{tmp_path}/factory.py:Attention", "--data", f"{tmp_path}/seq.npz"]
    for command in ("kernel", "layers"):
        code, _, err = run(capsys, command, *model)
        assert code == 0, err
        assert "performance drop" not in err and "batching rule" not in err, err


def test_an_infinite_condition_number_is_explained(tmp_path, capsys):
    # 12 samples × 2 outputs are 24 rows of J but P = 4·2 + 2 = 10 parameters: rank 10, κ = inf;
    # the trace kernel of a linear layer is O·[x, 1][x, 1]ᵀ: rank 4 + 1 = 5 < 12
    common = write_model(tmp_path)
    code, out, err = run(capsys, "kernel", *common, "--kind", "full", "--kind", "trace")
    assert code == 0, err
    assert "κ = inf for full: rank-deficient: N·O = 12·2 = 24 > rank 10" in out
    assert "κ = inf for trace: rank-deficient: N = 12 > rank 5" in out

    code, out, _ = run(capsys, "kernel", *common, "--kind", "full", "--format", "json")

    def not_json(constant):
        raise ValueError(f"{constant} is not JSON")

    row = json.loads(out, parse_constant=not_json)["rows"][0]  # strict JSON: κ = inf as null
    namespace = {}
    exec(FACTORY, namespace)
    x = torch.from_numpy(np.load(tmp_path / "data.npz")["x"])
    k = ntk.empirical_ntk(namespace["build"]().eval(), x, kind="full")
    assert row["condition_number"] is None
    assert row["rank"] == np.linalg.matrix_rank(k.permute(0, 2, 1, 3).reshape(24, 24).numpy())

    np.savez(tmp_path / "few.npz", x=np.eye(4, dtype=np.float32)[:3])  # 3 samples: full rank
    code, out, _ = run(capsys, "kernel", *common[:2], "--data", str(tmp_path / "few.npz"))
    assert code == 0 and "κ = inf" not in out


def test_random_weights_are_warned_about(tmp_path, capsys):
    common = write_model(tmp_path)
    code, out, err = run(capsys, "layers", *common)
    assert code == 0
    assert "warning: --model" in err and "without --weights" in err
    title = " ".join(out.split("─")[0].split())  # the title, however it wraps
    assert title.startswith("layer importance") and "[untrained: no --weights]" in title

    namespace = {}
    exec(FACTORY, namespace)
    torch.save(namespace["build"]().state_dict(), tmp_path / "w.pt")
    code, out, err = run(capsys, "layers", *common, "--weights", str(tmp_path / "w.pt"))
    assert code == 0 and "warning" not in err and "untrained" not in out


@pytest.mark.parametrize(
    "command, options",
    [
        ("layers", []),
        ("attribute", ["--test-samples", "2", "--top", "1"]),
        ("featurize", ["--dim", "4"]),
    ],
)
def test_json_says_whether_the_weights_are_the_factorys(tmp_path, capsys, command, options):
    """Every subcommand taking --model writes "untrained" in its JSON, as `ntk kernel` does."""
    common = write_model(tmp_path)
    if command == "attribute":
        options = [*options, "--test", common[-1]]
    if command == "featurize":
        options = [*options, str(tmp_path / "store")]
    namespace = {}
    exec(FACTORY, namespace)
    torch.save(namespace["build"]().state_dict(), tmp_path / "w.pt")
    for weights, untrained in (([], True), (["--weights", str(tmp_path / "w.pt")], False)):
        code, out, err = run(capsys, command, *common, *options, *weights, "--format", "json")
        assert code == 0, err
        assert json.loads(out)["untrained"] is untrained
        shutil.rmtree(tmp_path / "store", ignore_errors=True)


def test_library_warnings_are_one_line_without_source(tmp_path, capsys):
    common = write_model(tmp_path, samples=2)
    common[1] = common[1].replace(":build", ":Branchy")
    code, _, err = run(capsys, "kernel", *common, "--kind", "trace", "--method", "jacobian")
    assert code == 0, err
    lines = err.splitlines()
    assert any(line.startswith("ntk: warning: Branchy cannot be vmapped") for line in lines), err
    assert all(line.startswith("ntk: warning: ") for line in lines), err  # no file, no source
    assert "Warning" not in err


def test_undefined_scores_are_named(capsys):
    # naswot's log det is -inf on the 8-wide MLP of the demo space (a singular activation kernel)
    code, out, err = run(capsys, "nas", "--metric", "naswot", "--repeats", "1", "--format", "json")
    assert code == 0, err
    rows = {r["candidate"]: r for r in json.loads(out)["rows"]}
    assert rows["mlp-8x1"]["naswot"] is None and rows["mlp-8x1"]["rank"] == 6
    code, out, err = run(capsys, "nas", "--metric", "naswot", "--repeats", "1")
    assert "-inf" not in out and "– undefined (naswot" in out and "naswot ↑" in out


def test_data_cut_to_a_default_size_is_said(tmp_path, capsys):
    """No silent truncation: a data file longer than the command's default sample count, or a
    test file longer than the default --test-samples, is used in part with a warning saying so;
    a count given on the command line is not warned about (--test-samples was)."""
    common = write_model(tmp_path, samples=300)  # `ntk kernel` takes 256 by default
    code, out, err = run(capsys, "kernel", *common, "--kind", "trace")
    assert code == 0, err
    assert "ntk: warning: using the first 256 of the 300 samples of --data (--samples N" in err
    code, _, err = run(capsys, "kernel", *common, "--kind", "trace", "--samples", "300")
    assert code == 0 and "first" not in err
    weights = tmp_path / "w.pt"
    namespace = {}
    exec(FACTORY, namespace)
    torch.save(namespace["build"]().state_dict(), weights)
    args = ["attribute", *common, "--weights", str(weights), "--samples", "20"]
    code, _, err = run(capsys, *args, "--test", common[3], "--top", "1")
    assert code == 0, err
    assert "using the first 5 of the 300 samples of --test (--test-samples N to change)" in err
    code, _, err = run(capsys, *args, "--test", common[3], "--test-samples", "2", "--top", "1")
    assert code == 0 and "of --test" not in err, err


def test_asking_for_more_samples_than_a_file_holds_is_said(tmp_path, capsys):
    """--samples or --test-samples above what the file holds: all of it is used, with a warning
    (a default above it, like attribute's 5 test samples, says nothing)."""
    common = write_model(tmp_path, samples=12)
    code, _, err = run(capsys, "kernel", *common, "--kind", "trace", "--samples", "50")
    assert code == 0, err
    assert "ntk: warning: --samples 50: --data holds only 12 samples; using all 12" in err
    test = tmp_path / "test.npz"
    np.savez(test, x=np.zeros((3, 4), np.float32))
    args = ["attribute", *common, "--test", str(test), "--top", "1"]
    code, _, err = run(capsys, *args)
    assert code == 0 and "holds only" not in err, err
    code, _, err = run(capsys, *args, "--test-samples", "7")
    assert code == 0, err
    assert "ntk: warning: --test-samples 7: --test holds only 3 samples; using all 3" in err
    report = ["report", *common, "--test", str(test), "--out", str(tmp_path / "r.html")]
    code, _, err = run(capsys, *report, "--no-posterior", "--kernel-samples", "40")
    assert code == 0, err
    assert "ntk: warning: --kernel-samples 40: --data holds only 12 samples; using all 12" in err
    # --samples cut the file: it was said to hold only what --samples kept
    code, _, err = run(
        capsys, *report, "--no-posterior", "--samples", "10", "--kernel-samples", "11"
    )
    assert code == 0, err
    assert "--kernel-samples 11: --samples 10 keeps only 10 samples of --data; using all 10" in err
    # --train and --data both given: --data was ignored without a word
    code, _, err = run(capsys, *report, "--train", common[3], "--no-posterior")
    assert code == 2 and "both name the training data" in err, err
    # --kind full with another machine: refused in the library's Python words (kind='full',
    # machine='ridge', normalize=False) after loading the model and data
    for extra in (["--machine", "svm"], ["--normalize"]):
        code, _, err = run(capsys, *report, "--kind", "full", *extra)
        assert code == 2, err
        assert err.strip() == (
            "ntk: error: --kind full (a multi-output kernel) works with --machine ridge only, "
            "without --normalize"
        )


def test_the_report_records_the_output_fn_it_was_given(tmp_path, capsys):
    """`--output-fn` changes every number of the report; its settings did not say it was given."""
    common = write_model(tmp_path, samples=12)
    (tmp_path / "fns.py").write_text("def doubled(out):\n    return 2 * out\n")
    test = tmp_path / "test.npz"
    np.savez(test, x=np.zeros((3, 4), np.float32))
    html = tmp_path / "r.html"
    report = ["report", *common, "--test", str(test), "--out", str(html), "--no-posterior"]
    code, _, err = run(capsys, *report, "--output-fn", f"{tmp_path / 'fns.py'}:doubled")
    assert code == 0, err
    settings = json.loads(html.with_suffix(".json").read_text())["settings"]
    assert settings["output fn"] == f"{tmp_path / 'fns.py'}:doubled"
    code, _, err = run(capsys, *report)
    assert code == 0, err
    settings = json.loads(html.with_suffix(".json").read_text())["settings"]
    assert settings["output fn"] == "none (the model's output)"

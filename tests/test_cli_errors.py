"""Bad input to the CLI: exit 2 with one line that names the flag, before any computation; no
traceback and no advice from numpy or torch."""

import errno
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from disks import file_size_limit, skip_as_root

import ntk.distributed
import projections
from attribution.cli import main

FACTORY = """
import pathlib
import torch
from torch import nn

def build():
    pathlib.Path(__file__).with_name("built").touch()  # shows that the model was made
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))

def broken():
    raise ZeroDivisionError("no luck")

def mismatched():  # a bug inside the model: its second layer does not fit its first
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(5, 3))

class Divide(nn.Module):  # a bug in the model's own code, not in a torch layer
    def forward(self, h):
        return h * (1 / (h.shape[1] - 6))  # ZeroDivisionError on the 6 features it gets

def dividing():
    return nn.Sequential(nn.Linear(4, 6), Divide(), nn.Linear(6, 3))

def cnn():  # made for 8x8 images: its head takes 2 channels of 8x8
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(128, 3))

def double():  # a float64 model
    return build().double()

CANDIDATES = {"one": build}

class Picky(nn.Module):  # its own code fails on one sample past the first, once a layer took it
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        if (x[:, 0] > 50).any():
            raise ValueError("feature 0 too large")
        return self.b(torch.tanh(h))

def picky():
    torch.manual_seed(0)
    return Picky()

class Bag(nn.Module):  # token ids of any length, mean-pooled
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))
"""


def run(capsys, *args):
    with pytest.raises(SystemExit) as stop:
        main(list(args))
    captured = capsys.readouterr()
    return stop.value.code, captured.out, captured.err


@pytest.fixture
def files(tmp_path):
    (tmp_path / "factory.py").write_text(FACTORY)
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "train.npz", x=rng.normal(size=(10, 4)).astype(np.float32), y=np.arange(10) % 3
    )
    np.savez(tmp_path / "wide.npz", x=np.zeros((3, 7), np.float32))
    return tmp_path


def _files(folder) -> dict:
    """{path: bytes} of every file under `folder`: what a refused command must leave as it was."""
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def usage_error(capsys, *args):
    code, _, err = run(capsys, *args)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_test_data_is_checked_like_training_data(files, capsys):
    model = ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    err = usage_error(capsys, "attribute", *model, "--test", f"{files}/wide.npz")
    assert "--test: the model cannot take samples of shape (7,)" in err
    err = usage_error(capsys, "attribute", *model, "--test", f"{files}/missing.npz")
    assert "--test: file" in err and "does not exist" in err


def test_a_failing_model_factory_names_model(files, capsys):
    err = usage_error(capsys, "kernel", "--model", f"{files}/factory.py:broken")
    assert err.startswith("ntk: error: --model:") and "ZeroDivisionError: no luck" in err
    (files / "typo.py").write_text("def build(:\n    pass\n")
    err = usage_error(capsys, "layers", "--model", f"{files}/typo.py:build")
    assert err.startswith("ntk: error: --model:") and "SyntaxError" in err


def test_a_model_failing_inside_its_forward_pass_is_not_blamed_on_the_data(files, capsys):
    """The data fits the model's first layer, a later layer fails: exit 1 (not a usage error),
    one line saying that the forward pass failed, where, on what shape, and torch's reason."""
    model = ["--model", f"{files}/factory.py:mismatched", "--data", f"{files}/train.npz"]
    for command in ("kernel", "layers", "attribute"):
        code, _, err = run(capsys, command, *model)
        assert code == 1, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("ntk: error: the model's forward pass failed in module '2' (Linear)")
        assert "shape (4,)" in err and "mat1 and mat2 shapes cannot be multiplied" in err
        assert "--data:" not in err and "cannot take" not in err
    # data that the first layer refuses is still the data's fault
    err = usage_error(capsys, "kernel", *model[:2], "--data", f"{files}/wide.npz")
    assert "--data: the model cannot take samples of shape (7,)" in err


def test_a_model_failing_on_a_later_sample_is_said_as_on_the_first(files, capsys):
    """A model whose own code fails on sample 7 only (the first, which the commands try before
    any work, passes): the library's ModelForwardError came out as "ModelForwardError: x1: the
    model's forward pass failed …", naming a Python argument; now as on the first sample, exit 1
    naming the flag."""
    x = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    x[7, 0] = 100.0
    np.savez(files / "late.npz", x=x, y=np.arange(10) % 3)
    model = ["--model", f"{files}/factory.py:picky", "--data", f"{files}/late.npz"]
    for command, extra in (
        ("kernel", ()),
        ("layers", ()),
        ("attribute", ("--test", f"{files}/train.npz")),
        ("featurize", (f"{files}/store",)),
    ):
        code, _, err = run(capsys, command, *model, *extra)
        assert code == 1, err
        line = err.strip().splitlines()[-1]
        assert line.startswith("ntk: error: the model's forward pass failed in module 'Picky'")
        assert line.endswith("ValueError: feature 0 too large (on --data)"), line
        assert "x1" not in line and "ModelForwardError" not in line


def test_any_exception_of_the_model_past_its_first_layer_is_the_models_failure(files, capsys):
    """Not only torch's shape errors: a ZeroDivisionError of the model's own code once its first
    layer took the data is exit 1 naming the module, not a usage error blaming --data."""
    model = ["--model", f"{files}/factory.py:dividing", "--data", f"{files}/train.npz"]
    code, _, err = run(capsys, "kernel", *model)
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("ntk: error: the model's forward pass failed in module '1' (Divide)")
    assert "ZeroDivisionError: division by zero" in err and "--data:" not in err


def test_images_of_the_wrong_size_name_the_layer_and_the_shapes(files, capsys):
    """A CNN given 7x7 images instead of 8x8: its convolution takes them, its head does not; the
    one line names the head, the sample's shape and torch's shapes, so the size shows."""
    np.savez(files / "small.npz", x=np.zeros((4, 1, 7, 7), np.float32), y=np.arange(4) % 3)
    model = ["--model", f"{files}/factory.py:cnn", "--data", f"{files}/small.npz"]
    code, _, err = run(capsys, "layers", *model)
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "failed in module '2' (Linear) on one --data sample of shape (1, 7, 7)" in err
    assert "mat1 and mat2 shapes cannot be multiplied (1x98 and 128x3)" in err


def test_a_file_that_is_not_npz_gets_our_message(files, capsys):
    (files / "garbage.npz").write_bytes(b"\x00not an archive at all" * 10)
    model = ["--model", f"{files}/factory.py:build"]
    err = usage_error(capsys, "kernel", *model, "--data", f"{files}/garbage.npz")
    assert "--data:" in err and "not an .npz archive" in err and "trust" not in err
    np.savez(files / "objects.npz", x=np.array([{"a": 1}], dtype=object))
    err = usage_error(capsys, "kernel", *model, "--data", f"{files}/objects.npz")
    assert "--data:" in err and "pickled" in err and "trust" not in err


@pytest.mark.parametrize(
    "command, flag",
    [
        ("kernel", "--output"),
        ("kernel", "--save"),
        ("layers", "--plot"),
        ("report", "--out"),
        ("nas", "--output"),
    ],
)
def test_an_output_into_a_missing_directory_is_refused_before_computing(
    files, capsys, command, flag
):
    target = f"{files}/no/such/dir/result.html"
    args = [command, flag, target]
    if command != "nas":
        args += ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
        args += ["--kind", "trace"] if command == "kernel" else []
    else:
        args += ["--candidates", f"{files}/factory.py:nothing"]
    err = usage_error(capsys, *args)
    assert flag in err and "does not exist" in err and f"{files}/no/such/dir" in err
    assert ".part" not in err
    assert not (files / "built").exists()  # refused before the model was even made


MODEL = "--model {f}/factory.py:build --weights {f}/w.pt --data {f}/train.npz"


@pytest.mark.parametrize(
    "args, flags, read",
    [
        ("layers --output {f}/lp.png --plot {f}/lp.png", ("--output", "--plot"), None),
        ("kernel --kind trace --save {f}/k.npy --output {f}/./k.npy", ("--save", "--output"), None),
        (
            "report --out {f}/r.html --output {f}/r.html --test {f}/t.npz",
            ("--out", "--output"),
            None,
        ),
        (
            "report --out {f}/r.html --output {f}/r.json --test {f}/t.npz",
            ("--out", "--output"),
            None,
        ),
        ("layers --output {f}/w.pt", ("--output", "--weights"), "w.pt"),
        ("kernel --kind trace --save {f}/train.npz", ("--save", "--data"), "train.npz"),
        ("layers --output {f}/factory.py", ("--output", "--model"), "factory.py"),
        (
            "report --test {f}/t.npz --out {f}/t.html --output {f}/t.npz",
            ("--output", "--test"),
            "t.npz",
        ),
        (
            "attribute --test {f}/t.npz --checkpoint {f}/c.pt --output {f}/c.pt",
            ("--output", "--checkpoint"),
            "c.pt",
        ),
        (
            "nas --candidates {f}/factory.py:CANDIDATES --output {f}/factory.py",
            ("--output", "--candidates"),
            "factory.py",
        ),
    ],
)
def test_an_output_that_names_another_output_or_an_input_is_refused_before_any_work(
    labelled, capsys, args, flags, read
):
    """Two outputs on one file, or an output on an input file, once exited 0 having overwritten
    one with the other; now refused naming both flags, with nothing written."""
    f = labelled
    np.savez(f / "t.npz", x=np.zeros((4, 4), np.float32))
    (f / "c.pt").write_bytes((f / "w.pt").read_bytes())
    before = _files(f)
    command, *rest = args.format(f=f).split()
    model = MODEL.format(f=f).split()[-2:] if command == "nas" else MODEL.format(f=f).split()
    err = usage_error(capsys, command, *model, *rest)
    assert all(re.search(rf"(^|\s){flag}\b", err) for flag in flags), err
    assert read is None or f"{f}/{read}" in err, err
    assert _files(f) == before  # nothing written
    assert not (f / "built").exists()  # refused before the model was even made


@pytest.mark.parametrize(
    "args, flag",
    [
        ("layers --model mine.models:build --output {out}", "--model"),
        ("kernel --kind trace --model mine.models:build --save {out}", "--model"),
        ("nas --candidates mine.models:CANDIDATES --output {out}", "--candidates"),
    ],
)
def test_an_output_onto_the_module_a_dotted_spec_names_is_refused(
    labelled, capsys, monkeypatch, args, flag
):
    """--model package.module:attr was not resolved to its file, so --output overwrote the
    model's source; the module's file is found without importing anything (its package's
    __init__ is not run), before any work."""
    f = labelled
    (f / "mine").mkdir()
    (f / "mine" / "__init__.py").write_text("import pathlib\npathlib.Path('imported').touch()\n")
    (f / "mine" / "models.py").write_text(FACTORY)
    monkeypatch.chdir(f)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI may add the working directory
    before = _files(f)
    out = "mine/./models.py"
    command, *rest = args.format(out=out).split()
    err = usage_error(capsys, command, *rest, "--data", "train.npz")
    written = "--save" if "--save" in rest else "--output"
    assert f"{written} {out} is the input of {flag}" in err, err
    assert _files(f) == before
    assert not (f / "imported").exists() and "mine" not in sys.modules


OUTPUT_FN = """
import pathlib

def scores(z):
    pathlib.Path(__file__).with_name("called").touch()  # shows that it was imported and run
    return z
"""


@pytest.mark.parametrize(
    "args, written",
    [
        ("layers --output-fn {fn} --output {out}", "--output"),
        ("kernel --kind trace --output-fn {fn} --save {out}", "--save"),
        ("attribute --output-fn {fn} --test train.npz --output {out}", "--output"),
        ("featurize st --dim 8 --output-fn {fn} --output {out}", "--output"),
        ("report --out r.html --test train.npz --output-fn {fn} --output {out}", "--output"),
        ("nas --candidates factory.py:CANDIDATES --output-fn {fn} --output {out}", "--output"),
    ],
)
@pytest.mark.parametrize(
    "fn, out", [("fns.py:scores", "./fns.py"), ("mine.fns:scores", "mine/fns.py")]
)
def test_an_output_onto_the_file_of_output_fn_is_refused(
    labelled, capsys, monkeypatch, args, written, fn, out
):
    """--output-fn file.py:fn (or package.module:fn) reads a Python file that was not among the
    inputs of the collision check: --output or --save onto it exited 0 having overwritten the
    user's source. Now refused naming both flags, before any work."""
    f = labelled
    (f / "fns.py").write_text(OUTPUT_FN)
    (f / "mine").mkdir()
    (f / "mine" / "__init__.py").write_text("")
    (f / "mine" / "fns.py").write_text(OUTPUT_FN)
    monkeypatch.chdir(f)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI may add the working directory
    before = _files(f)
    command, *rest = args.format(fn=fn, out=out).split()
    model = [] if command == "nas" else ["--model", "factory.py:build", "--weights", "w.pt"]
    err = usage_error(capsys, command, *model, *rest, "--data", "train.npz")
    assert f"{written} {out} is the input of --output-fn" in err, err
    assert _files(f) == before
    assert not (f / "built").exists() and not (f / "called").exists()
    assert "mine" not in sys.modules


def test_an_attribute_name_given_to_output_fn_is_not_taken_for_a_module(
    labelled, capsys, monkeypatch
):
    """--output-fn real names an attribute of the model's output, not a module: a real.py in the
    working directory is no input of the command, and --output may replace it."""
    f = labelled
    (f / "real.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.chdir(f)
    monkeypatch.setattr(sys, "path", list(sys.path))
    model = MODEL.format(f=f).split()
    code, _, err = run(capsys, "layers", *model, "--output-fn", "real", "--output", "real.py")
    assert code == 0, err
    assert "imported" not in (f / "real.py").read_text()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(
    "command, flag, name",
    [
        ("kernel --kind trace --format json", "--output", "out.json"),
        ("kernel --kind trace", "--output", "out.txt"),  # the table, written in two parts
        ("layers", "--plot", "layers.png"),
    ],
)
def test_an_output_that_cannot_be_written_names_its_flag_and_path(
    labelled, capsys, command, flag, name
):
    """A write that fails once the work is done (here a full disk: the output is a link to
    /dev/full, which --output and --plot write in place) exited 1 with "OSError: [Errno 28] No
    space left on device", naming neither the file nor the flag. Still exit 1: the command line
    was fine (`check_paths` accepted the path), the machine refused the write."""
    f = labelled
    (f / name).symlink_to("/dev/full")
    code, _, err = run(capsys, *command.split(), *MODEL.format(f=f).split(), flag, str(f / name))
    assert code == 1, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.strip() == f"ntk: error: {flag} {f / name}: cannot write: No space left on device"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_report_that_cannot_be_written_names_out(labelled, capsys, monkeypatch):
    """The report's HTML, written by the library, failed with an OSError naming no file; the
    library now names the file, and the CLI --out. The temporary file is a link to /dev/full here
    (a full disk)."""
    from ntk.core import files

    def full_disk(target):
        link = target.parent / f".{target.name}.full"
        link.symlink_to("/dev/full")
        return link

    monkeypatch.setattr(files, "_new_temporary", full_disk)
    f = labelled
    np.savez(f / "t.npz", x=np.zeros((4, 4), np.float32))
    args = ["report", *MODEL.format(f=f).split(), "--test", f"{f}/t.npz", "--out", f"{f}/r.html"]
    code, _, err = run(capsys, *args, "--kernel-samples", "4", "--examples", "2")
    assert code == 1, err
    assert err.strip().splitlines()[-1] == (
        f"ntk: error: --out {f}/r.html: cannot write: No space left on device"
    ), err


def run_limited(size, *args):
    """`ntk *args` in a subprocess whose files cannot grow past `size` bytes (a full disk)."""
    return subprocess.run(
        [sys.executable, "-m", "attribution.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=file_size_limit(size),
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )


def test_a_feature_store_that_cannot_be_written_names_store_and_stays_incomplete(labelled, capsys):
    """A failed write of the store (here the manifest that would complete it, past a file size
    limit) exited 1 with "OSError: [Errno 27] File too large", naming neither STORE nor its
    path. The store is left as before that write, incomplete, and the same line completes it."""
    f = labelled
    line = ["featurize", *MODEL.format(f=f).split(), "--dim", "1", "--block", "1"]
    assert run(capsys, *line, str(f / "whole"))[0] == 0
    last = (f / "whole" / "manifest.json").stat().st_size  # the largest file the store writes
    out = run_limited(last - 1, *line, str(f / "st"))
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == f"ntk: error: STORE {f}/st: cannot write: File too large"
    info = projections.store_info(f / "st")
    assert len(info["blocks"]) == info["num_blocks"] - 1
    with pytest.raises(projections.StoreError, match="incomplete"):
        projections.open_store(f / "st")
    assert run(capsys, *line, str(f / "st"))[0] == 0
    assert np.array_equal(projections.open_store(f / "st"), projections.open_store(f / "whole"))


@skip_as_root
def test_a_feature_store_whose_array_is_read_only_is_not_called_damaged(labelled, capsys):
    """Resuming a store whose features.npy lost its write permission exited 2 with "cannot read
    …/features.npy (truncated or damaged?): [Errno 13] Permission denied". Still exit 2, as for
    an output refused by `check_paths`: no features were computed."""
    f = labelled
    line = ["featurize", *MODEL.format(f=f).split(), "--dim", "1", "--block", "1"]
    assert run(capsys, *line, str(f / "whole"))[0] == 0
    last = (f / "whole" / "manifest.json").stat().st_size
    assert run_limited(last - 1, *line, str(f / "st")).returncode == 1  # an incomplete store
    (f / "st" / "features.npy").chmod(0o444)
    err = usage_error(capsys, *line, str(f / "st"))
    assert err.strip() == (
        f"ntk: error: cannot open {f}/st/features.npy for writing: Permission denied"
    )
    (f / "st" / "features.npy").chmod(0o644)
    assert run(capsys, *line, str(f / "st"))[0] == 0


@pytest.mark.parametrize(
    "refused",
    ["directory", "os.open", pytest.param("chmod", marks=skip_as_root)],
)
def test_a_feature_store_whose_lock_may_not_be_opened_is_refused_naming_it(
    labelled, capsys, monkeypatch, refused
):
    """A store whose writer's lock file may not be opened for writing (a directory in its
    place; its write permission taken away, which binds every user but root: here os.open
    refuses it as it would them, or chmod where it binds) exited 1, once the model was loaded,
    with "STORE …: cannot write: Is a directory" (Permission denied), as a failed write of the
    output. Exit 2 naming the lock, as for a read-only features.npy; nothing is written."""
    f = labelled
    store, lock = f / "st", f / "st" / "lock"
    line = ["featurize", *MODEL.format(f=f).split(), "--dim", "1", "--block", "1", str(store)]
    store.mkdir()
    if refused == "directory":
        lock.mkdir()
    else:
        lock.touch()
        lock.chmod(0o444)
    if refused == "os.open":
        real_open = os.open

        def as_a_user(path, flags, *args, **kwargs):
            if os.fspath(path) == str(lock) and flags & (os.O_WRONLY | os.O_RDWR):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", as_a_user)
    err = usage_error(capsys, *line)
    why = "Is a directory" if refused == "directory" else "Permission denied"
    assert err.strip() == f"ntk: error: cannot open {lock} for writing: {why}"
    assert sorted(p.name for p in store.iterdir()) == ["lock"]


def test_kernel_tiles_that_cannot_be_written_name_the_flag(labelled, capsys):
    """A failed write of a kernel tile (past a file size limit) exited 1 with "OSError: [Errno
    27] File too large", naming neither --kernel-tiles nor its path. No kernel looks complete
    there, and the same line writes it."""
    f = labelled
    line = ["featurize", str(f / "st"), *MODEL.format(f=f).split(), "--dim", "8"]
    assert run(capsys, *line)[0] == 0  # the store: complete, the line below only reads it
    line += ["--kernel-tiles", str(f / "tiles")]
    out = run_limited(64, *line)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == (
        f"ntk: error: --kernel-tiles {f}/tiles: cannot write: File too large"
    )
    with pytest.raises(ValueError, match="no complete kernel"):
        ntk.distributed.load_tiles(f / "tiles")
    assert run(capsys, *line)[0] == 0
    assert ntk.distributed.load_tiles(f / "tiles").shape == (10, 10)


def test_an_output_inside_the_store_that_featurize_writes_is_refused(labelled, capsys):
    f = labelled
    args = ["featurize", str(f / "st"), *MODEL.format(f=f).split(), "--dim", "8"]
    assert run(capsys, *args)[0] == 0
    manifest = (f / "st" / "manifest.json").read_bytes()
    for extra, flag in (
        (["--output", str(f / "st" / "manifest.json"), "--format", "json"], "--output"),
        (["--kernel-tiles", str(f / "st" / "tiles")], "--kernel-tiles"),
    ):
        err = usage_error(capsys, *args, *extra)
        assert err.startswith(f"ntk: error: {flag} ") and "STORE" in err and f"{f}/st" in err, err
        assert (f / "st" / "manifest.json").read_bytes() == manifest
    assert sorted(p.name for p in (f / "st").iterdir()) == ["features.npy", "lock", "manifest.json"]
    args[1] = str(f / "new")
    err = usage_error(capsys, *args, "--output", str(f / "new"))
    assert err.startswith(f"ntk: error: --output and STORE both name {f}/new"), err
    assert not (f / "new").exists()


@pytest.mark.parametrize(
    "args, flag, where",
    [
        ("layers --output /proc/a.json --format json", "--output", "/proc"),
        ("layers --plot /proc/a.png", "--plot", "/proc"),
        ("kernel --kind trace --save /sys/k.npy", "--save", "/sys"),
        ("report --test {f}/train.npz --out /proc/r.html", "--out", "/proc"),
        ("report --test {f}/train.npz --out {f}/r.html --output /proc/s.json", "--output", "/proc"),
        ("featurize /proc/st --dim 8", "STORE", "/proc"),
        ("featurize {f}/st --dim 8 --kernel-tiles /proc/kt", "--kernel-tiles", "/proc"),
        ("layers --output {f}/train.npz/a.json", "--output", "{f}/train.npz is not a directory"),
        ("kernel --kind trace --save {f}", "--save", "{f} is a directory, not a file"),
        ("report --test {f}/train.npz --out {f}/d.html", "--out", "{f}/d.json is a directory"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
    labelled, capsys, args, flag, where
):
    """Unwritable outputs once failed with a FileNotFoundError on a temporary .part file, after
    all the work (`report --output` after writing the report): exit 2 naming the flag and where."""
    f = labelled
    (f / "d.json").mkdir()
    before = sorted(p.name for p in f.iterdir())
    command, *rest = args.format(f=f).split()
    err = usage_error(capsys, command, *MODEL.format(f=f).split(), *rest)
    assert err.startswith(f"ntk: error: {flag}") and where.format(f=f) in err, err
    assert ".part" not in err and "Error" not in err
    assert sorted(p.name for p in f.iterdir()) == before  # nothing written
    assert not (f / "built").exists()


@pytest.fixture
def unwritable(monkeypatch):
    """A function making the directories it is given refuse the trial file of `check_paths`, as
    directories a user may not write (root, here, writes anywhere)."""
    import tempfile

    trial, denied = tempfile.TemporaryFile, set()

    def as_a_user(*args, dir=None, **kwargs):
        if str(dir) in denied:
            raise PermissionError(13, "Permission denied")
        return trial(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", as_a_user)
    return lambda *folders: denied.update(map(str, folders))


def test_a_device_is_an_output_written_in_place(files, capsys, unwritable):
    """--output /dev/null is judged by its own permission, not by a trial file in /dev, where
    only root may create one (as for every user but root here)."""
    unwritable("/dev")
    model = ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    err = usage_error(capsys, "kernel", *model, "--kind", "trace", "--save", "/dev/k.npy")
    assert "--save: cannot write /dev/k.npy: directory /dev is not writable" in err
    code, out, err = run(capsys, "layers", *model, "--output", "/dev/null")
    assert code == 0 and out == "", err


LINKED = pytest.mark.parametrize(
    "command, flag",
    [("kernel --kind trace --save", "--save"), ("layers --format json --output", "--output")],
)


@pytest.fixture
def linked(files, unwritable):
    """A directory `locked` that is not writable, one `open` that is, and the arguments of the
    model; an output that is a link is written through it (`atomic_path`), into the directory
    of the file it names, where `check_paths` must try its trial file: it tried the link's own."""
    (files / "locked").mkdir()
    (files / "open").mkdir()
    unwritable(files / "locked")
    return ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]


@LINKED
def test_an_output_linked_into_a_directory_that_is_not_writable_is_refused(
    files, capsys, linked, command, flag
):
    """It was accepted, to fail once the work was done."""
    into = files / "open" / "into"
    into.symlink_to(files / "locked" / "result")
    err = usage_error(capsys, *command.split(), str(into), *linked)
    assert err.strip() == (
        f"ntk: error: {flag}: cannot write {into}: directory {files}/locked is not writable"
    )
    assert not (files / "built").exists() and not (files / "locked" / "result").exists()


@LINKED
def test_an_output_linked_out_of_a_directory_that_is_not_writable_is_written(
    files, capsys, linked, command, flag
):
    """It was refused: "cannot write …: directory …/locked is not writable"."""
    out_of = files / "locked" / "out_of"
    out_of.symlink_to(files / "open" / "result")
    code, _, err = run(capsys, *command.split(), str(out_of), *linked)
    assert code == 0, err
    assert out_of.is_symlink() and (files / "open" / "result").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ("kernel --kind trace --save {p}", "--save"),
        ("report --test {f}/train.npz --out {p}.html", "--out"),
        ("report --test {f}/train.npz --out {p}x.html", "--out (its .json)"),
    ],
)
def test_an_output_written_by_a_rename_refuses_a_device(files, capsys, args, flag):
    """--save /dev/null run as root replaced the device by a regular file (the output is
    written to a temporary file renamed onto the path); a FIFO stands in for the device."""
    pipe = files / "pipe"
    os.mkfifo(pipe)
    os.mkfifo(files / "pipe.html")
    os.mkfifo(files / "pipex.json")
    command, *rest = args.format(f=files, p=pipe).split()
    err = usage_error(capsys, command, "--model", f"{files}/factory.py:build", *rest)
    assert f"ntk: error: {flag}: " in err and "is not a regular file; the output replaces" in err
    assert pipe.is_fifo() and (files / "pipe.html").is_fifo() and (files / "pipex.json").is_fifo()


@pytest.mark.parametrize("command", ["kernel", "featurize", "layers"])
def test_labels_of_another_length_than_x_are_refused_by_every_command(files, capsys, command):
    """kernel and featurize never use the labels but ran on a file whose y did not fit its x."""
    np.savez(files / "ylen.npz", x=np.zeros((10, 4), np.float32), y=np.arange(7) % 3)
    args = [command, "--model", f"{files}/factory.py:build", "--data", f"{files}/ylen.npz"]
    args += [str(files / "st"), "--dim", "8"] if command == "featurize" else []
    err = usage_error(capsys, *args)
    assert "--data: x has 10 samples but y has shape (7,)" in err
    assert not (files / "st").exists()


def test_a_report_on_one_test_sample_names_the_flag(files, capsys):
    np.savez(files / "one.npz", x=np.zeros((1, 4), np.float32))
    args = ["report", "--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    err = usage_error(capsys, *args, "--test", f"{files}/one.npz", "--out", f"{files}/r.html")
    assert err.startswith("ntk: error: --test:") and "at least 2" in err


@pytest.mark.parametrize("command", ["kernel", "layers", "attribute", "nas", "featurize"])
def test_an_unknown_column_is_refused_before_any_work_with_the_valid_ones(files, capsys, command):
    args = [command, "--columns", "kind,foo"]
    if command == "nas":
        args += ["--candidates", f"{files}/factory.py:CANDIDATES", "--metric", "params"]
    else:
        args += ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    if command == "featurize":
        args += [str(files / "store")]
    err = usage_error(capsys, *args)
    assert err.startswith(
        "ntk: error: --columns: no column 'kind'"
        if command != "kernel"
        else "ntk: error: --columns: no column 'foo'"
    )
    assert not (files / "built").exists()  # refused before the model was even made
    valid = err.split("the columns are ")[1].strip().split(", ")
    if command == "nas":
        assert valid == ["rank", "candidate", "params", "std", "seconds"]
    help_text = " ".join(run(capsys, command, "--help")[1].split())
    listed = help_text.split("table: the columns to show, comma-separated, of ")[1]
    assert all(column in listed for column in valid if column != "params")  # nas: a --metric
    assert "layer,share,rank" not in help_text  # the example once shown for every command


def test_columns_are_listed_with_their_table_headers_and_taken_by_either(files, capsys):
    """`ntk kernel` heads condition_number κ and lambda_1 λ1: --help and the error for an unknown
    column list both, and --columns takes the header as the name."""
    help_text = " ".join(run(capsys, "kernel", "--help")[1].split())
    assert "lambda_1 (λ1), lambda_2, lambda_3, condition_number (κ), rank" in help_text
    assert "it runs in eval mode (Dropout off" in help_text  # what --model's model is switched to
    model = ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    err = usage_error(capsys, "kernel", *model, "--columns", "kind,kappa")
    assert err.rstrip().endswith("lambda_1 (λ1), lambda_2, lambda_3, condition_number (κ), rank")
    code, out, err = run(capsys, "kernel", *model, "--kind", "trace", "--columns", "κ,λ1,kind")
    assert code == 0, err
    assert out.split("\n")[2].split() == ["κ", "λ1", "kind"]


def test_weights_that_do_not_fit_name_the_tensor_and_shapes(files, capsys):
    torch.save(
        torch.nn.Sequential(
            torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
        ).state_dict(),
        files / "w.pt",
    )
    err = usage_error(
        capsys,
        "kernel",
        "--model",
        f"{files}/factory.py:build",
        "--data",
        f"{files}/train.npz",
        "--weights",
        f"{files}/w.pt",
    )
    assert "tensor '0.weight' is [5, 4] in the file but [6, 4] in the model" in err
    assert "(and 2 more)" in err  # 0.bias and 2.weight


def test_weights_saved_from_a_wrapper_or_in_a_training_checkpoint_are_read(files, capsys):
    """A state_dict saved from DataParallel / DDP ('module.' on every key) or torch.compile
    ('_orig_mod.') was refused as "tensor '0.weight' is missing from the file (and 3 more)",
    and a tutorial's checkpoint {'model_state_dict': ..., 'epoch': ...} as "does not hold a
    state_dict of tensors"; each is read as the plain state_dict, the prefix said once."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    state = net.state_dict()
    torch.save(state, files / "plain.pt")
    torch.save({f"module.{k}": v for k, v in state.items()}, files / "dp.pt")
    torch.save({f"_orig_mod.{k}": v for k, v in state.items()}, files / "compiled.pt")
    torch.save({"model_state_dict": state, "epoch": 3}, files / "checkpoint.pt")
    torch.save({"net": state, "epoch": 3}, files / "unknown.pt")
    model = ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    options = ["--kind", "trace", "--format", "json"]
    code, want, err = run(capsys, "kernel", *model, *options, "--weights", f"{files}/plain.pt")
    assert code == 0, err
    want = {k: v for k, v in json.loads(want)["rows"][0].items() if k != "seconds"}
    for name, said in (
        ("dp", "module.… (saved from DataParallel"),
        ("compiled", "_orig_mod.…"),
        ("checkpoint", None),
    ):
        code, got, err = run(capsys, "kernel", *model, *options, "--weights", f"{files}/{name}.pt")
        assert code == 0, err
        assert {k: v for k, v in json.loads(got)["rows"][0].items() if k != "seconds"} == want
        assert (said in err) if said else "names its tensors" not in err, err
    err = usage_error(capsys, "kernel", *model, "--weights", f"{files}/unknown.pt")
    assert "unknown.pt does not hold a state_dict of tensors: a dict of 'net', 'epoch'" in err
    assert "no entry 'state_dict' / 'model_state_dict' / 'model' holding one" in err


def test_kernel_of_two_samples(files, capsys):
    code, out, err = run(
        capsys,
        "kernel",
        "--model",
        f"{files}/factory.py:build",
        "--data",
        f"{files}/train.npz",
        "--samples",
        "2",
        "--all",
    )
    assert code == 0, err
    assert "2x2x3x3" in out and "trace" in out


def test_files_found_by_fuzzing_get_exit_2_and_the_right_flag(files, capsys):
    model = ["--model", f"{files}/factory.py:build"]
    (files / "afile").write_text("not a store")
    err = usage_error(
        capsys,
        "featurize",
        *model,
        "--data",
        f"{files}/train.npz",
        "--dim",
        "8",
        str(files / "afile"),
    )
    assert "STORE:" in err and "is a file" in err
    (files / "garbage.pt").write_bytes(b"not a pickle")
    err = usage_error(capsys, "layers", *model, "--weights", f"{files}/garbage.pt")
    assert "--weights:" in err and "torch.save" in err and "weights_only" not in err
    x = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    np.savez(files / "names.npz", x=x, y=np.array(list("abcabcabca")))
    err = usage_error(capsys, "report", *model, "--train", f"{files}/names.npz")
    assert err.startswith("ntk: error: --train:") and "must hold numbers" in err
    # featurize never reads the labels: string labels do not stop it
    code, _, err = run(
        capsys,
        "featurize",
        *model,
        "--data",
        f"{files}/names.npz",
        "--dim",
        "8",
        str(files / "store"),
    )
    assert code == 0, err


def test_the_output_fn_remedy_names_the_flag(files, capsys):
    """A model returning a tuple was told to "pass output_fn", the Python argument, on the
    command line too."""
    (files / "pair.py").write_text(
        "from torch import nn\n"
        "class Pair(nn.Linear):\n"
        "    def __init__(self):\n"
        "        super().__init__(4, 3)\n"
        "    def forward(self, x):\n"
        "        out = super().forward(x)\n"
        "        return out, out.sum(1)\n"
    )
    model = ["--model", f"{files}/pair.py:Pair", "--data", f"{files}/train.npz"]
    code, _, err = run(capsys, "kernel", *model)
    assert code == 2 and "Traceback" not in err
    assert "pass --output-fn (a field name such as logits, or file.py:fn)" in err
    assert "output_fn " not in err


def test_an_output_fn_name_reads_a_key_of_a_dict_output(files, capsys):
    """--output-fn logits on a model returning a plain dict failed ("AttributeError: 'dict'
    object has no attribute 'logits'"): a field name is a key of a dict output too, and a
    missing key is named with the keys there are."""
    (files / "keyed.py").write_text(
        "from torch import nn\n"
        "class Keyed(nn.Linear):\n"
        "    def __init__(self):\n"
        "        super().__init__(4, 3)\n"
        "    def forward(self, x):\n"
        "        return {'logits': super().forward(x), 'hidden': x}\n"
    )
    (files / "plain.py").write_text(
        "from torch import nn\ndef build():\n    return nn.Linear(4, 3)\n"
    )
    keyed = ["--model", f"{files}/keyed.py:Keyed", "--data", f"{files}/train.npz"]
    plain = ["--model", f"{files}/plain.py:build", "--data", f"{files}/train.npz"]
    options = ["--kind", "trace", "--format", "json"]
    code, got, err = run(capsys, "kernel", *keyed, *options, "--output-fn", "logits")
    assert code == 0, err
    code, want, err = run(capsys, "kernel", *plain, *options)
    assert code == 0, err
    got, want = json.loads(got), json.loads(want)
    # a linear model's eNTK does not depend on its weights
    assert [r["trace"] for r in got["layers"]] == [r["trace"] for r in want["layers"]]
    for a, b in zip(got["rows"], want["rows"], strict=True):
        assert {k: v for k, v in a.items() if k != "seconds"} == pytest.approx(
            {k: v for k, v in b.items() if k != "seconds"}
        )
    code, _, err = run(capsys, "kernel", *keyed, "--output-fn", "logit")
    assert code == 2 and "Traceback" not in err
    assert "KeyError: \"no key 'logit' (its keys: 'logits', 'hidden')\"" in err


def test_an_output_fn_that_fails_on_the_output_is_bad_input(files, capsys):
    model = ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    code, _, err = run(capsys, "kernel", *model, "--output-fn", "logits")  # a tensor has none
    assert code == 2 and "Traceback" not in err
    assert "--output-fn logits failed on the model's output (a Tensor): AttributeError" in err
    code, _, err = run(capsys, "kernel", *model, "--output-fn", "grad")  # None on a tensor
    assert code == 2 and "--output-fn grad gave None" in err


def test_test_sequences_of_another_length_are_attributed(files, capsys):
    """--test sequences of 7 tokens after --data's 5 were refused ("its inputs differ from the
    training data's: (5,) vs (7,)") though the model takes both; inputs of another structure
    (keyword instead of positional) are refused before any work, naming both options."""
    ids = np.random.default_rng(0).integers(0, 10, size=(8, 5))
    np.savez(files / "ids5.npz", x=ids, y=np.arange(8) % 3)
    np.savez(files / "ids7.npz", x=np.concatenate([ids, ids[:, :2]], 1)[:3])
    np.savez(files / "keyword.npz", **{"x.ids": ids[:3]})
    model = ["--model", f"{files}/factory.py:Bag", "--data", f"{files}/ids5.npz"]
    for method in ("auto", "surrogate"):
        code, out, err = run(
            capsys,
            "attribute",
            *model,
            "--test",
            f"{files}/ids7.npz",
            "--top",
            "2",
            "--method",
            method,
        )
        assert code == 0, err
        assert "of 8 training examples on 3 test predictions" in out
    err = usage_error(capsys, "attribute", *model, "--test", f"{files}/keyword.npz")
    assert "--data and --test must have the same structure, got Tensor and dict" in err


def interrupted(*_):
    raise KeyboardInterrupt


def test_featurize_refuses_a_directory_of_other_files_but_resumes_a_partial_store(
    files, capsys, monkeypatch
):
    import projections._format

    args = ["featurize", "--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    args += ["--dim", "8"]
    (files / "mine").mkdir()
    (files / "mine" / "notes.txt").write_text("keep me")
    err = usage_error(capsys, *args, str(files / "mine"))
    assert "STORE:" in err and f"{files}/mine" in err and "notes.txt" in err
    assert [p.name for p in (files / "mine").iterdir()] == ["notes.txt"]
    (files / "empty").mkdir()
    assert run(capsys, *args, str(files / "empty"))[0] == 0
    # a writer stopped after preallocating features.npy, before its first manifest
    with monkeypatch.context() as m:
        m.setattr(projections._format, "write_manifest", interrupted)
        assert run(capsys, *args, str(files / "partial"))[0] == 1
    (files / "partial" / "manifest.json.999.tmp").write_text("{")  # another one's leftovers
    assert sorted(p.name for p in (files / "partial").iterdir()) == [
        "features.npy",
        "lock",
        "manifest.json.999.tmp",
    ]
    code, out, err = run(capsys, *args, str(files / "partial"))
    assert code == 0, err
    assert projections.open_store(files / "partial").shape == (10, 3, 8)


def test_a_store_that_is_a_dangling_symlink_is_made_where_it_points(files, capsys):
    """A STORE that is a symlink to a folder not yet made exited 1 once the model was loaded,
    "STORE …: cannot write: File exists" (the link's own mkdir). A missing STORE is made when
    its parent directory exists and refused up front when not; a link is written through, so
    the same holds for the folder it names: made there (the link kept), or refused naming that
    folder's missing parent."""
    args = ["featurize", "--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    args += ["--dim", "8"]
    link = files / "link"
    link.symlink_to(files / "target")
    code, out, err = run(capsys, *args, str(link))
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(files / "target")
    assert projections.open_store(files / "target").shape == (10, 3, 8)
    assert run(capsys, *args, str(link))[0] == 0  # the link now names a complete store
    far = files / "far"
    far.symlink_to(files / "missing" / "target")
    err = usage_error(capsys, *args, str(far))
    assert err.strip() == (
        f"ntk: error: STORE: directory {files}/missing does not exist (for {far})"
    )
    assert not (files / "missing").exists()


def test_an_error_of_one_rank_under_torchrun_names_the_rank(files, capsys, monkeypatch):
    """A rank's own error did not name its rank, where the others' say "rank N failed: …";
    torchrun's WORLD_SIZE and RANK say which it is before any process group is joined. A single
    process (WORLD_SIZE 1 or unset) prints the line as it was."""
    args = ["kernel", "--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    args += ["--kind", "trace", "--save", str(files)]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    err = usage_error(capsys, *args)
    assert err.strip() == f"ntk: error: rank 1: --save: {files} is a directory, not a file"
    monkeypatch.setenv("WORLD_SIZE", "1")
    err = usage_error(capsys, *args)
    assert err.strip() == f"ntk: error: --save: {files} is a directory, not a file"


def test_a_complete_store_in_a_directory_that_is_not_writable_is_read(files, capsys, monkeypatch):
    """featurize only reads a complete store (the library's promise: it may sit in a read-only
    directory), but the command refused one up front ("STORE: … is not writable"). A store still
    to be written there is refused as before. Root writes anywhere, so os.access says what it
    would say to a user."""
    import os

    args = ["featurize", "--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    args += ["--dim", "8"]
    assert run(capsys, *args, str(files / "done"))[0] == 0
    (files / "new").mkdir()
    access, locked = os.access, {str(files / "done"), str(files / "new")}
    monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and str(p) not in locked)
    before = _files(files / "done")
    code, out, err = run(capsys, *args, str(files / "done"))
    assert code == 0 and "10 samples" in out, err
    assert _files(files / "done") == before
    err = usage_error(capsys, *args, str(files / "new"))
    assert f"STORE: {files}/new is not writable" in err
    (files / "afile").write_text("x")  # not a store: the flag's own message
    err = usage_error(capsys, *args, str(files / "afile"))
    assert f"STORE: {files}/afile is a file, not a directory" in err


def test_kernel_tiles_into_an_existing_folder_are_refused_before_any_work(files, capsys):
    (files / "tiles").mkdir()
    (files / "tiles" / "notes.txt").write_text("keep me")
    model = ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    err = usage_error(
        capsys,
        "featurize",
        *model,
        "--dim",
        "8",
        str(files / "store"),
        "--kernel-tiles",
        str(files / "tiles"),
    )
    assert err.startswith(f"ntk: error: --kernel-tiles: path {files}/tiles exists"), err
    assert [p.name for p in (files / "tiles").iterdir()] == ["notes.txt"]
    assert not (files / "store").exists() and not (files / "built").exists()


def test_kernel_tiles_at_a_dangling_symlink_are_written_where_it_points(files, capsys):
    """--kernel-tiles LINK, a symlink to a folder not made yet, exited 1 once the store was
    written ("--kernel-tiles LINK: cannot write: File exists", mkdir of the link itself)."""
    import ntk.distributed

    line = ["featurize", "--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    link = files / "tiles"
    link.symlink_to(files / "target")
    line += ["--dim", "8", str(files / "store"), "--kernel-tiles", str(link)]
    code, _, err = run(capsys, *line)
    assert code == 0, err
    assert link.is_symlink() and (files / "target" / "index.json").exists()
    assert ntk.distributed.load_tiles(link).shape == (10, 10)


def test_a_device_the_machine_lacks_is_a_usage_error_before_any_work(capsys):
    err = usage_error(capsys, "layers", "--device", "foo")
    assert "'foo' is not a torch device" in err, err
    err = usage_error(capsys, "nas", "--device", f"cuda:{torch.cuda.device_count()}")
    assert "--device" in err and "cuda device(s)" in err, err


def test_kernel_tiles_of_an_earlier_run_are_rewritten(files, capsys):
    """The README's "killed half-way? the same line resumes": rerunning a featurize line with
    --kernel-tiles rewrites the tiles (and the index) it wrote before."""
    import ntk.distributed

    line = ["featurize", "--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    line += ["--dim", "8", "--block", "4", str(files / "store"), "--kernel-tiles"]
    line += [str(files / "tiles")]
    assert run(capsys, *line)[0] == 0
    first = ntk.distributed.load_tiles(files / "tiles")
    (files / "tiles" / "index.json").write_text("{}")  # as if a different, older kernel
    code, _, err = run(capsys, *line)
    assert code == 0, err
    torch.testing.assert_close(ntk.distributed.load_tiles(files / "tiles"), first)


def test_module_specs_find_modules_in_the_working_directory(files, capsys, monkeypatch):
    (files / "cwd_models.py").write_text(FACTORY + "\ndef first(out):\n    return out[:, :2]\n")
    monkeypatch.chdir(files)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI may add the working directory
    code, out, err = run(
        capsys,
        "kernel",
        "--model",
        "cwd_models:build",
        "--output-fn",
        "cwd_models:first",
        "--data",
        "train.npz",
        "--kind",
        "full",
        "--samples",
        "2",
    )
    assert code == 0, err
    assert "2x2x2x2" in out  # the kernel of the two outputs that --output-fn keeps


@pytest.fixture
def labelled(files):
    """Labels of 10 classes for a model of 3 outputs, labels of the wrong shape, and weights."""
    x = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    np.savez(files / "labels.npz", x=x, y=np.arange(10))
    np.savez(files / "pairs.npz", x=x, y=np.zeros((10, 2), int))
    np.savez(files / "nolabels.npz", x=x)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    torch.save(net.state_dict(), files / "w.pt")
    return files


@pytest.mark.parametrize(
    "args, message",
    [
        ("attribute --data {f}/labels.npz --test {f}/train.npz", "--data: y holds labels outside"),
        ("attribute --data {f}/train.npz --test {f}/pairs.npz", "--test: y must be a 1-d tensor"),
        ("report --train {f}/labels.npz --test {f}/train.npz", "--train: y holds labels outside"),
        ("report --train {f}/train.npz --test {f}/labels.npz", "--test: y holds labels outside"),
        ("report --train {f}/train.npz --test {f}/train.npz --image-shape 3x3", "--image-shape (3"),
        ("report --train {f}/wide.npz --test {f}/train.npz", "--train: the model cannot take"),
        ("layers --data {f}/labels.npz", "--data: y holds labels outside 0..2: 3 at sample"),
        ("layers --data {f}/pairs.npz", "--data: y holds integer class labels of shape (10, 2)"),
        ("layers --data {f}/nolabels.npz --score fisher", "--score fisher needs labels: --data"),
    ],
)
def test_bad_labels_and_image_shapes_name_the_flag(labelled, capsys, args, message):
    f = labelled
    args = args.format(f=f).split() + ["--model", f"{f}/factory.py:build", "--weights", f"{f}/w.pt"]
    err = usage_error(capsys, *args, *(["--out", f"{f}/r.html"] if args[0] == "report" else []))
    assert message in err
    assert not any(name in err for name in ("y_train", "y_test", "image_shape"))


def test_nas_names_the_labels_of_data(labelled, capsys):
    candidates = f"{labelled}/factory.py:CANDIDATES"
    err = usage_error(capsys, "nas", "--data", f"{labelled}/labels.npz", "--candidates", candidates)
    assert (
        "candidate 'one': --data's y holds labels outside 0..2: 3 at sample 3 (the model has 3"
        in err
    )


def test_top_that_would_list_an_example_on_both_sides_is_refused(labelled, capsys):
    args = ["attribute", "--model", f"{labelled}/factory.py:build", "--weights"]
    args += [f"{labelled}/w.pt", "--data", f"{labelled}/train.npz", "--test"]
    args += [f"{labelled}/train.npz", "--top", "6"]
    err = usage_error(capsys, *args)
    assert "--top 6 with 10 training samples" in err and "at most 5" in err


def test_a_dict_without_x_names_the_layouts_that_work(files, capsys):
    torch.save(
        {"input_ids": torch.zeros(4, 3, dtype=torch.long), "y": torch.zeros(4)}, files / "t.pt"
    )
    err = usage_error(
        capsys, "kernel", "--model", f"{files}/factory.py:build", "--data", f"{files}/t.pt"
    )
    assert "arrays x.<name>" in err and "{'x': {name: tensor}, 'y': labels}" in err


def test_float_inputs_take_the_models_dtype_and_values_it_cannot_hold_are_refused(files, capsys):
    x = np.random.default_rng(0).normal(size=(6, 4))
    np.savez(files / "f64.npz", x=x, y=np.arange(6) % 3)
    for data in ("f64.npz", "train.npz"):  # float64 and float32 files for a float64 model
        model = ["--model", f"{files}/factory.py:double", "--data", f"{files}/{data}"]
        code, _, err = run(capsys, "attribute", *model, "--test", f"{files}/f64.npz", "--top", "2")
        assert code == 0, err
    x[2, 1] = 1e300  # finite in the file, inf in the float32 model's dtype
    np.savez(files / "huge.npz", x=x)
    err = usage_error(
        capsys, "kernel", "--model", f"{files}/factory.py:build", "--data", f"{files}/huge.npz"
    )
    assert "--data: x holds values too large for the model's dtype torch.float32" in err


def test_a_directory_given_for_a_file_is_named_as_one(files, capsys):
    (files / "data.npz").mkdir()
    model = ["--model", f"{files}/factory.py:build"]
    err = usage_error(capsys, "layers", *model, "--data", f"{files}/data.npz")
    assert f"--data: {files}/data.npz is a directory, not a file" in err
    err = usage_error(capsys, "layers", *model, "--weights", str(files))
    assert f"--weights: {files} is a directory, not a file" in err


def test_nas_blames_data_that_no_candidate_can_use_on_data_not_a_candidate(labelled, capsys):
    candidates = f"{labelled}/factory.py:CANDIDATES"
    err = usage_error(
        capsys, "nas", "--data", f"{labelled}/nolabels.npz", "--candidates", candidates
    )
    assert "ntk: error: --data's y is missing: metric 'label_condition' needs class labels" in err
    np.savez(labelled / "one.npz", x=np.zeros((1, 4), np.float32), y=np.zeros(1, int))
    err = usage_error(capsys, "nas", "--data", f"{labelled}/one.npz", "--candidates", candidates)
    assert "ntk: error: --data's x must hold at least 2 samples, got 1" in err


def test_a_train_features_store_that_does_not_fit_names_the_flag(files, capsys):
    common = ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    args = ["attribute", *common, "--test", f"{files}/train.npz", "--top", "1"]
    err = usage_error(capsys, *args, "--train-features", str(files))
    assert err.startswith(f"ntk: error: --train-features: {files} is not a feature store")
    code, _, err = run(capsys, "featurize", str(files / "store"), *common, "--dim", "8")
    assert code == 0, err
    code, _, err = run(capsys, *args, "--train-features", str(files / "store"))
    assert code == 2 and "Traceback" not in err, err
    assert f"ntk: error: --train-features {files / 'store'}: it holds kind='trace' features" in err


@pytest.mark.parametrize("content", [b"", b"hello", b"PK\x03\x04 cut short"])
def test_a_pt_file_that_torch_cannot_parse_is_called_one(files, capsys, content):
    (files / "bad.pt").write_bytes(content)
    model = ["--model", f"{files}/factory.py:build"]
    for flag in ("--data", "--weights"):
        err = usage_error(capsys, "layers", *model, flag, f"{files}/bad.pt")
        assert f"{flag}: cannot read {files}/bad.pt: not a file written by torch.save" in err


def test_arrays_that_are_not_read_are_named(files, capsys):
    x = np.zeros((6, 4), np.float32)
    np.savez(files / "named.npz", x=x, labels=np.arange(6) % 3, **{"x.mask": x})
    model = ["--model", f"{files}/factory.py:build"]
    code, _, err = run(capsys, "kernel", *model, "--data", f"{files}/named.npz")
    assert code == 0, err
    message = "holds arrays that are not read: 'labels', 'x.mask' (read: x, or x.<name>"
    assert f"ntk: warning: --data: {files}/named.npz {message}" in err
    code, _, err = run(
        capsys,
        "nas",
        "--candidates",
        f"{files}/factory.py:CANDIDATES",
        "--data",
        f"{files}/named.npz",
        "--metric",
        "naswot",
        "--repeats",
        "1",
    )
    assert code == 0 and message in err, err


@pytest.mark.parametrize(
    "command, targets",  # attribute refuses data without labels first
    [("report", "real"), ("report", "none"), ("attribute", "real")],
)
def test_a_single_output_model_is_refused_as_no_classifier_with_the_cli_remedy(
    files, capsys, command, targets
):
    """A regression model (real targets), or one output without labels, given to a command that
    explains class predictions: one line saying it needs a classifier, with the --output-fn that
    gives one logit class scores (a regression target was called a bad class label, and the
    remedy was a Python lambda the command line cannot take)."""
    (files / "single.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(4, 1))\n"
    )
    x = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    y = {"real": x[:, 0] * 0.5, "binary": np.arange(10) % 2, "none": None}[targets]
    np.savez(files / "d.npz", x=x, **({} if y is None else {"y": y}))
    args = [command, "--model", f"{files}/single.py:build", "--test", f"{files}/d.npz"]
    args += ["--train" if command == "report" else "--data", f"{files}/d.npz"]
    args += ["--out", f"{files}/r.html"] if command == "report" else ["--top", "2"]
    err = usage_error(capsys, *args)
    assert f"ntk {command} needs a classifier" in err and "the model has 1 output" in err
    assert "--output-fn file.py:fn" in err and "lambda" not in err


@pytest.mark.parametrize("command", ["attribute", "report"])
def test_a_one_logit_model_with_labels_0_and_1_is_read_as_a_binary_classifier(
    files, capsys, command
):
    """One output per sample and labels 0 and 1: a binary classifier's logit z, explained as the
    class scores [0, z] with a warning saying so; the same numbers as the --output-fn that
    stacks them (it was refused, and the user had to write that file)."""
    (files / "single.py").write_text(
        "import torch\nfrom torch import nn\n\ndef build():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))\n"
    )
    (files / "fns.py").write_text(
        "import torch\n\ndef two(z):\n"
        "    return torch.stack([torch.zeros_like(z), z], -1).reshape(len(z), 2)\n"
    )
    x = np.random.default_rng(0).normal(size=(24, 4)).astype(np.float32)
    np.savez(files / "d.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
    args = [command, "--model", f"{files}/single.py:build", "--test", f"{files}/d.npz"]
    args += ["--train" if command == "report" else "--data", f"{files}/d.npz"]
    args += ["--no-posterior"] if command == "report" else ["--top", "2"]
    out = {}
    for name, extra in (("read", []), ("explicit", ["--output-fn", f"{files}/fns.py:two"])):
        where = files / f"{name}.json"  # report: its --out's; attribute: its --output
        place = ["--out", str(files / f"{name}.html")] if command == "report" else []
        place += [] if command == "report" else ["--format", "json", "--output", str(where)]
        code, _, err = run(capsys, *args, *place, *extra)
        assert code == 0, err
        said = "read as a binary classifier's logit z, with class scores [0, z]" in err
        assert said == (name == "read"), err
        out[name] = json.loads(where.read_text())
    if command == "report":
        read, explicit = out["read"], out["explicit"]
        assert read["settings"]["output fn"] == "[0, z] of the one logit z of the model"
        assert read["faithfulness"] == explicit["faithfulness"]
        assert read["attribution"] == explicit["attribution"]
    else:
        assert out["read"]["rows"] == out["explicit"]["rows"] and out["read"]["rows"]


def test_weights_saved_as_a_whole_module_name_its_class_and_the_state_dict_to_save(files, capsys):
    """torch.save(model) instead of torch.save(model.state_dict()): --weights (loaded with
    weights_only=True, never unpickled) says which class the file pickles and what to save
    instead; it used to say only "not a file of tensors"."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    torch.save(net, files / "whole.pt")
    model = ["--model", f"{files}/factory.py:build", "--data", f"{files}/train.npz"]
    err = usage_error(capsys, "layers", *model, "--weights", f"{files}/whole.pt")
    assert "--weights: cannot read" in err and "torch.nn.modules.container.Sequential" in err
    assert "torch.save(model.state_dict()" in err and "weights_only" not in err


def test_nas_ranks_one_logit_binary_classifiers(files, capsys):
    """`ntk nas`'s default vote reads the labelled kernel, which refused a one-logit binary
    classifier (with the --output-fn remedy); its lpNTK is now that of the class scores (0, z).
    The remedy's translation to a flag is checked with the commands that still need class
    scores (`test_a_single_output_model_is_refused_as_no_classifier_with_the_cli_remedy`)."""
    (files / "single.py").write_text(
        "from torch import nn\n\nCANDIDATES = {'a': lambda: nn.Sequential(nn.Linear(4, 1))}\n"
    )
    x = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    np.savez(files / "d.npz", x=x, y=np.arange(10) % 2)
    code, out, err = run(
        capsys, "nas", "--candidates", f"{files}/single.py:CANDIDATES", "--data", f"{files}/d.npz"
    )
    assert code == 0, err
    assert "label_condition" in out
    assert any(line.split()[:2] == ["1", "a"] for line in out.splitlines())  # rank 1: a


def test_a_malformed_output_fn_names_every_form_it_takes(capsys):
    """The message listed two of the three forms --output-fn takes (not path/file.py:function)."""
    err = usage_error(capsys, "layers", "--output-fn", "not valid")
    assert "package.module:function or path/file.py:function, got 'not valid'" in err, err


def test_library_warnings_are_shown_in_the_command_lines_words(capsys):
    """The CLI shows the library's warnings on one line each; those naming Python attributes
    (the surrogate's alpha_ and ALPHA_STEPS, coherence(x), x_test, batch_size) say the flags
    instead. The messages are the library's own, raised as the tests of each raise them."""
    import importlib
    import warnings

    from torch import nn

    from attribution import KernelSurrogate
    from ntk import proxies

    torch.manual_seed(0)
    untrained = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    x = torch.randn(40, 5, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        surrogate = KernelSurrogate(untrained).fit(x)  # no alpha is readable: warned
        surrogate.faithfulness(x[:4] * 0)  # one sample four times: a constant side, warned
        narrow = {
            f"w{w}": nn.Sequential(nn.Linear(5, w), nn.ReLU(), nn.Linear(w, 3)) for w in (2, 3)
        }
        proxies.rank(  # fewer parameters than samples: both tied at a singular kernel's -inf
            narrow, x[:, :5].float(), torch.arange(40) % 3, metric="label_condition", repeats=1
        )
    shown = {w.message.args[0][:30] for w in caught}
    assert len(caught) >= 3, shown
    cli_main = importlib.import_module("attribution.cli.main")  # the module, not its main()
    for w in caught:
        cli_main._show_warning(w.message, w.category, w.filename, w.lineno)
    err = capsys.readouterr().err
    assert "--alpha" in err and "test sample" in err and "--batch-size" in err, err
    for python in ("ALPHA_STEPS", "alpha_", "coherence(x)", "x_test", " batch_size"):
        assert python not in err, err


def test_featurize_refuses_a_store_directory_of_other_files(files, capsys):
    """STORE naming a directory of the user's files, a lone features.npy among them (it was
    taken for a killed writer's and overwritten): one line, before the model is loaded."""
    mine = files / "mine"
    mine.mkdir()
    np.save(mine / "features.npy", np.arange(3.0))
    err = usage_error(
        capsys,
        "featurize",
        str(mine),
        "--model",
        f"{files}/factory.py:build",
        "--data",
        f"{files}/train.npz",
    )
    assert f"STORE: {mine} is a directory of other files (features.npy)" in err
    np.testing.assert_array_equal(np.load(mine / "features.npy"), np.arange(3.0))

"""Every ```python block of README.md runs as written, in order, in one fresh interpreter on the
demo model (as the notebooks are executed); the torchrun block inside a one-process Gloo group."""

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block."""
    return [
        (text[: m.start(1)].count("\n") + 1, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)
    ]


def test_the_readme_has_the_entry_points():
    code = "\n".join(block for _, block in python_blocks(README.read_text()))
    for name in (
        "ntk.empirical_ntk",
        "projections.features",
        "projections.featurize",
        "attribution.KernelSurrogate",
        "attribution.influence",
        "attribution.trak",
        "attribution.lds",
        "attribution.layer_importance",
        "attribution.report",
        "attribution.NTKPosterior",
        "attribution.sample_interactions",
        "proxies.rank",
    ):
        assert name in code, name
    assert "pandas" not in code


@pytest.mark.slow
def test_every_python_block_runs(tmp_path):
    blocks = python_blocks(README.read_text())
    script = "\n".join(
        f"exec(compile({code!r}, 'README.md:{line}', 'exec'), namespace)" for line, code in blocks
    )
    with socket.socket() as s:  # a free port for the one-process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(README.parent), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", f"namespace = {{}}\n{script}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "report.html").is_file() and (tmp_path / "K").is_dir()


def shown_output(marker: str) -> str:
    """The text of the first ``` block after the line of README.md that starts with `marker`."""
    text = README.read_text()
    start = text.index("\n" + marker) + 1
    m = re.compile(r"^```\n(.*?)^```", re.S | re.M).search(text, start)
    return m.group(1)


def same_output(shown: str, printed: str) -> bool:
    """Line by line and word by word, numbers to 0.5 % (the last printed digit may differ with
    the BLAS), everything else exactly; blank lines and trailing spaces ignored."""

    def number(word: str) -> float | None:
        try:
            return float(word)
        except ValueError:
            return None

    a, b = ([w.split() for w in t.splitlines() if w.strip()] for t in (shown, printed))
    if len(a) != len(b):
        return False
    for line_a, line_b in zip(a, b, strict=True):
        if len(line_a) != len(line_b):
            return False
        for x, y in zip(line_a, line_b, strict=True):
            nx, ny = number(x), number(y)
            if nx is None or ny is None:
                if x != y:
                    return False
            elif not math.isclose(nx, ny, rel_tol=5e-3, abs_tol=1e-9):
                return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize(
    "marker, args",
    [
        ("`ntk layers` on the demo", ["layers"]),
        (
            "`ntk attribute --test-samples 1 --top 3` on the demo",
            ["attribute", "--test-samples", "1", "--top", "3"],
        ),
    ],
)
def test_the_shown_command_outputs_are_what_the_commands_print(marker, args, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "attribution.cli", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    shown = shown_output(marker)
    assert same_output(shown, out.stdout), (
        f"README shows:\n{shown}\nthe command prints:\n{out.stdout}"
    )

"""Every ```python block of README.md runs as written, in order, in one fresh interpreter on the
demo model (as the notebooks are executed); the torchrun block inside a one-process Gloo group."""

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

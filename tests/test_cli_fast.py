"""`ntk --help` and `ntk <command> --help` start without importing torch, and the choices the
CLI offers without importing the library are the library's own."""

import subprocess
import sys

import pytest

import attribution.surrogate
import ntk
import projections
from attribution import _influence, _report, layers
from attribution.cli import choices
from ntk import proxies
from ntk.core import persample

COMMANDS = ["attribute", "featurize", "kernel", "layers", "nas", "report"]


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
def test_help_does_not_import_torch(command):
    probe = (
        "import sys\n"
        "from attribution.cli import main\n"
        "try:\n"
        f"    main({[*command, '--help']!r})\n"
        "except SystemExit as stop:\n"
        "    assert stop.code == 0, stop.code\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'numpy', 'sklearn', 'scipy', 'matplotlib'})\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_choices_are_the_librarys():
    assert choices.KERNEL_KINDS == ntk.KINDS
    assert choices.KERNEL_METHODS == ntk.METHODS
    assert choices.INFLUENCE_METHODS == _influence.METHODS
    assert choices.LAYER_SCORES == layers.SCORES
    assert choices.LABEL_SCORES == layers.LABEL_SCORES
    assert choices.DEFAULT_LAYER_SCORE == layers.DEFAULT_SCORE
    assert choices.PROXY_METRICS == proxies.METRICS
    assert choices.DEFAULT_RANKING == proxies.DEFAULT_RANKING
    assert choices.RANKING_BATCH_SIZE == proxies.RANKING_BATCH_SIZE
    assert choices.RANKING_REPEATS == proxies.RANKING_REPEATS
    assert choices.PROJECTORS == projections.PROJECTORS
    assert choices.BATCHING_NOTE == persample.BATCHING_NOTE
    assert choices.DEFAULT_PROJECTOR == projections.DEFAULT_PROJECTOR
    assert choices.SURROGATE_KINDS == attribution.surrogate.KINDS
    assert choices.SURROGATE_MACHINES == attribution.surrogate.MACHINES
    assert choices.POSTERIOR_AUTO_MAX == _report.POSTERIOR_AUTO_MAX


def test_ntk_alone_prints_its_help_not_an_error():
    """`ntk` without a command printed its help as "ntk: error: Usage: …" on stderr, exit 2: a
    newcomer's first try read as a mistake."""
    out = subprocess.run(
        [sys.executable, "-m", "attribution.cli"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Usage: ntk") and "Commands:" in out.stdout
    assert "error" not in out.stderr

"""The `ntk` command group and its error handling (exit 2: usage errors; 1: anything else, a
model whose own forward pass fails included, `common.ModelFailure`); on a rank of a distributed
run (torchrun) the error names the rank."""

from __future__ import annotations

import os
import sys
import warnings

import click

from .attribute import attribute
from .choices import BATCHING_NOTE
from .common import warn
from .featurize import featurize
from .kernel import kernel
from .layers import layers
from .nas import nas
from .report import report


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Empirical neural tangent kernels: kernels, layer importance, attribution, NAS proxies."""


cli.add_command(attribute)
cli.add_command(featurize)
cli.add_command(kernel)
cli.add_command(layers)
cli.add_command(nas)
cli.add_command(report)


# The library's remedies name its Python argument output_fn (for a one-logit binary classifier,
# ntk.core.kinds.ONE_LOGIT; for an output that is not a [B, O] tensor, "pass output_fn ..."); on
# the command line they are the --output-fn flag.
_FLAG = "--output-fn (a field name such as logits, or file.py:fn)"
_OUTPUT_FN_WORDS = (
    ("output_fn=lambda z: ", "--output-fn file.py:fn with fn(z) = "),
    ("pass output_fn ", f"pass {_FLAG} "),
    ("Pass output_fn ", f"Pass {_FLAG} "),
)


# Remedies that name a Python argument the command line has no flag for (a zero Gauss–Newton
# curvature leaves no rule for the damping or the posterior's prior precision).
_PYTHON_ONLY_WORDS = (
    (
        "pass damping= explicitly",
        "the command line chooses the damping by that rule (no flag sets it): call "
        "attribution.influence(..., damping=λ) in Python",
    ),
    (
        "pass prior_precision= explicitly",
        "--no-posterior leaves the uncertainty section out (in Python: "
        "attribution.NTKPosterior(model, prior_precision=δ))",
    ),
)

# Warnings of the library that name its Python attributes and arguments.
_WARNING_WORDS = (
    ("no alpha of ALPHA_STEPS makes", "no --alpha the search tries makes"),
    ("alpha_=", "--alpha "),
    ("alpha_ is the largest", "--alpha is the largest the search tries"),
    ("`coherence(x)` measures it", "the attribution cards of `ntk report` measure it"),
    ("every sample of x_test", "every test sample"),
    ("a smaller batch_size", "a smaller --batch-size"),
    (" folds (cv) that choose alpha", " folds that choose the regularisation"),
    ("pass a number as alpha, or a smaller cv", "pass --alpha"),
)


def _message(text: str) -> str:
    """An error or warning message in the command line's words."""
    for python, flag in (*_OUTPUT_FN_WORDS, *_PYTHON_ONLY_WORDS, *_WARNING_WORDS):
        text = text.replace(python, flag)
    return text


def _first_line(exc: BaseException) -> str:
    return _message(str(exc).splitlines()[0]) if str(exc) else ""


def _named(exc: Exception) -> str:
    """`exc` as "Type: first line"; another rank's failure (`ntk.distributed.RankFailed`) as
    its first line, which names the rank and its error's type."""
    distributed = sys.modules.get("ntk.distributed")  # imported wherever one is raised
    if distributed is not None and isinstance(exc, distributed.RankFailed):
        return _first_line(exc)
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _rank(exc: BaseException) -> str:
    """The prefix "rank N: " of this rank's own error `exc` in a distributed run (world size > 1:
    an initialised process group's, else torchrun's WORLD_SIZE and RANK), as the other ranks'
    lines name it ("rank N failed: …", a `RankFailed`, which gets none); "" in one process."""
    distributed = sys.modules.get("ntk.distributed")
    if distributed is not None and isinstance(exc, distributed.RankFailed):
        return ""
    dist = sys.modules.get("torch.distributed")  # not imported to print a usage error
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        try:
            rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            return ""
    return f"rank {rank}: " if world > 1 else ""


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line on stderr, in the command line's words, without the source file
    and line."""
    warn(_message(str(message)))


def main(argv=None) -> None:
    """Console entry point: one-line messages instead of tracebacks (NTK_DEBUG=1 shows them)."""
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        warnings.filterwarnings("ignore", message=BATCHING_NOTE)  # torch's, on its vmap's speed
        _run(argv)


_NO_ARGUMENTS = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click ≥ 8.2


def _run(argv) -> None:
    try:
        cli.main(args=argv, prog_name="ntk", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("ntk: aborted", err=True)
        sys.exit(1)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except _NO_ARGUMENTS as exc:  # `ntk` alone asks what it can do: its help, not an error
        click.echo(exc.format_message())
        sys.exit(0)
    except click.UsageError as exc:
        click.echo(f"ntk: error: {_rank(exc)}{_message(exc.format_message())}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"ntk: error: {_rank(exc)}{_message(exc.format_message())}", err=True)
        sys.exit(exc.exit_code)
    except (ValueError, TypeError) as exc:
        if os.environ.get("NTK_DEBUG"):
            raise
        # Bad input that the library refused before doing any work: a usage problem.
        click.echo(f"ntk: error: {_rank(exc)}{_first_line(exc) or type(exc).__name__}", err=True)
        sys.exit(2)
    except Exception as exc:
        if os.environ.get("NTK_DEBUG"):
            raise
        click.echo(f"ntk: error: {_rank(exc)}{_named(exc)}", err=True)
        sys.exit(1)
    sys.exit(0)

"""The `ntk` command line: one group, one module per subcommand."""

from .main import main

__all__ = ["main"]

"""``slimspec`` command line (typer): parse, build a config, call one library function, print.

Importing this package registers every command on :data:`app`.
"""

from slimspec_convert.cli import bench, convert, distill, fetch, generate, train  # noqa: F401  (registers commands)
from slimspec_convert.cli.app import app, main

__all__ = ["app", "main"]

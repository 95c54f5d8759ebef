"""``slimspec`` command line (typer). Thin: parse, build a config, call one library function, print.

Commands live in ``cli_*.py`` modules, one per area, each registering on :data:`app`.
Our own exceptions (``ValueError``, ``FileNotFoundError``, ``FileExistsError``) become one line on
stderr and exit code 2; anything else keeps its traceback.
"""

from __future__ import annotations

import sys

import typer

app = typer.Typer(
    name="slimspec",
    help="Low-rank LM heads for EAGLE-3 drafters: convert, fine-tune, run and benchmark.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, KeyError)


def fail(err: BaseException) -> None:
    """Print ``error: ...`` on one line to stderr and exit with code 2."""
    typer.echo(f"error: {err}".replace("\n", " "), err=True)
    raise typer.Exit(code=2)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except USER_ERRORS as err:  # raised outside a command's own handler
        typer.echo(f"error: {err}".replace("\n", " "), err=True)
        sys.exit(2)


# Command modules register themselves on `app` when imported.
from . import cli_convert, cli_generate, cli_bench, cli_train  # noqa: E402,F401,I001

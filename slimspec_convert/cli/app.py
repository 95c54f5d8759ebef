"""The typer app, the error policy (our exceptions -> one line on stderr, exit code 2) and ``main``.

Commands live in one module per area (``convert``, ``generate``, ``bench``, ``train``, ``fetch``),
each registering on :data:`app` through :func:`command`, which wraps the command in the one
error-to-exit-2 handler. Anything that is not one of :data:`USER_ERRORS` keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable

import torch
import typer

app = typer.Typer(
    name="slimspec",
    help="Low-rank LM heads for EAGLE-3 drafters: convert, fine-tune, run and benchmark.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench_app = typer.Typer(
    help="Benchmarks: LM-head latency and end-to-end speculative decoding.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, KeyError)


def fail(err: BaseException) -> None:
    """Print ``error: ...`` on one line to stderr and exit with code 2."""
    typer.echo(f"error: {err}".replace("\n", " "), err=True)
    raise typer.Exit(code=2)


def command(name: str | None = None, on: typer.Typer = app) -> Callable:
    """Register a command on ``on`` with the error policy: a user error exits 2 with one line."""

    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except USER_ERRORS as err:
                fail(err)

        return on.command(name)(wrapper)

    return register


LINEAR_PRODUCT_HELP = (
    "linear layers' product: auto (time the target's verification both ways once per machine, keep the "
    "faster), torch (x @ W.T) or transposed ((W @ x.T).T)"
)

LOOKUP_HELP = (
    "prompt lookup: graft up to N tokens copied from the context (after the latest earlier match of the "
    "last tokens) onto each round's drafts, losslessly (0 = off)"
)
RERANK_CONTEXT_HELP = (
    "with --rerank: also rescore the last N distinct tokens of each sequence (prompt and answer) "
    "exactly, the content words a rank-r preview ranks too low (0 = top-K only)"
)
LOOKUP_MIN_HELP = "prompt lookup: shortest suffix matched (tokens)"
LOOKUP_MAX_HELP = "prompt lookup: longest suffix matched, tried first (tokens)"


def apply_threads(threads: int | None) -> None:
    """``--threads``: torch CPU threads (None keeps torch's default).

    Raises:
        ValueError: threads < 1.
    """
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads={threads}: expected >= 1")
    torch.set_num_threads(threads)


def csv_items(text: str, what: str) -> tuple[str, ...]:
    """``"a, b"`` -> ``("a", "b")``.

    Raises:
        ValueError: an empty list.
    """
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise ValueError(f"{what}={text!r}: expected a comma-separated list")
    return items


def csv_ints(text: str, what: str) -> tuple[int, ...]:
    """``"1,64"`` -> ``(1, 64)``.

    Raises:
        ValueError: an item that is not an integer.
    """
    try:
        return tuple(int(x) for x in csv_items(text, what))
    except ValueError as e:
        raise ValueError(f"{what}={text!r}: expected comma-separated integers") from e


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except USER_ERRORS as err:  # raised outside a command's own handler
        typer.echo(f"error: {err}".replace("\n", " "), err=True)
        sys.exit(2)


def config_fields(cls: type, values: dict, **overrides) -> dict:
    """The keyword arguments of dataclass ``cls`` among a command's arguments (``locals()``).

    A command's options carry their config field's name (``tests/unit/cli/test_defaults.py`` checks
    names and defaults), so the config is built by name; ``overrides`` replace values that need a
    conversion first (a list option -> a tuple field).
    """
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names} | overrides


def default(cls: type, name: str):
    """The default of field ``name`` of dataclass ``cls`` (for configs with required fields)."""
    f = cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")

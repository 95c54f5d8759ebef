"""The typer app, the error policy (our exceptions -> one line on stderr, exit code 2) and ``main``.

Commands live in one module per area (``convert``, ``generate``, ``bench``, ``train``, ``fetch``),
each registering on :data:`app` through :func:`command`, which wraps the command in the one
error-to-exit-2 handler (:mod:`slimspec_convert.cli.errors` decides what is a user's or the machine's
fault: our errors, file-system and I/O failures, safetensors' errors, an interrupt). Anything else
keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Annotated

import torch
import typer

from slimspec_convert.cli.errors import error_line, install_signal_handlers
from slimspec_convert.measure.machine import ThreadChoice, choose_threads

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


def fail(err: BaseException) -> None:
    """Print ``error: ...`` on one line to stderr and exit with code 2 (a bug re-raises: traceback)."""
    line = error_line(err)
    if line is None:
        raise err
    typer.echo(f"error: {line}".replace("\n", " "), err=True)
    raise typer.Exit(code=2)


THREADS_HELP = (
    "torch CPU threads (default: the cores other work leaves free, from the CPU time other processes"
    " use now (/proc/stat); at least 1)"
)
_THREADS = inspect.Parameter(
    "threads",
    inspect.Parameter.KEYWORD_ONLY,
    default=None,
    annotation=Annotated[int | None, typer.Option(help=THREADS_HELP)],
)


def apply_threads(threads: int | None) -> ThreadChoice:
    """``--threads``: set torch's CPU threads to the number asked or to what the machine can give.

    Says on stderr what it chose when other work holds cores (the default took fewer than all).

    Raises:
        ValueError: threads < 1.
    """
    choice = choose_threads(threads)
    torch.set_num_threads(choice.threads)
    if choice.reduced:
        typer.echo(choice.summary(), err=True)
    return choice


def command(name: str | None = None, on: typer.Typer = app) -> Callable:
    """Register a command on ``on`` with the error policy (a user's or the machine's fault exits 2 with
    one line, :mod:`slimspec_convert.cli.errors`) and the ``--threads`` option every command takes."""

    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, threads: int | None = None, **kwargs):
            install_signal_handlers()
            try:
                apply_threads(threads)
                return fn(*args, **kwargs)
            except (Exception, KeyboardInterrupt) as err:
                if error_line(err) is None:
                    raise
                fail(err)

        sig = inspect.signature(fn, eval_str=True)
        wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), _THREADS])
        return on.command(name)(wrapper)

    return register


LINEAR_PRODUCT_HELP = (
    "linear layers' product: auto (time the target's verification both ways once per machine, keep the "
    "faster), torch (x @ W.T) or transposed ((W @ x.T).T)"
)

CHAT_HELP = (
    "prompts through the target's chat template (--chat) or as raw completion text after <bos> "
    "(--no-chat); default: chat when the tokenizer has a template (base models, e.g. Gemma 3 270M, have none)"
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
    install_signal_handlers()
    try:
        app()
    except (Exception, KeyboardInterrupt) as err:  # raised outside a command's own handler
        line = error_line(err)
        if line is None:
            raise
        typer.echo(f"error: {line}".replace("\n", " "), err=True)
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

